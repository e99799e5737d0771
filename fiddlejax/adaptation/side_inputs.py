"""Side inputs travel with the activation: one ``[batch, features]`` message between layers.

An adapted model's blocks get more than the activation (masks, positions, segment ids, rotary
tables). A pipeline moves one array between stages, so :func:`pack` concatenates the flattened
activation and side inputs (in the activation's dtype, without gradients) and :func:`unpack`
rebuilds the block's arguments from it with the :class:`Side` recorded at packing.

Side inputs come in three kinds, each rebuilt as the blocks got it:

- computed from the batch with its batch axis (a padding mask ``[B, S]``): carried per example,
  so a microbatch carries its own rows;
- constants, computed from neither the batch nor the parameters (rotary tables ``(S, d/2)``, a
  causal mask ``(1, 1, S, S)``, positions from ``arange``): not carried at all, but handed to
  every block whole, as values (``consts``, found by :func:`constant_leaves`);
- computed from the batch without a batch axis: carried once per example row, rebuilt whole.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Side:
    """How the side inputs of a block call are rebuilt from the packed message."""

    treedef: Any                 # of (args[1:], kwargs) with array leaves as None placeholders
    statics: tuple               # the non-array leaves, in order (None where an array goes)
    shapes: tuple                # per-example shapes of the array leaves
    dtypes: tuple
    x_shape: tuple               # per-example shape of the activation
    x_dtype: Any
    whole: tuple = ()            # per carried array: True when it has no batch axis
    keys: int = 0                # message columns holding dropout key data (then a counter)
    counter: bool = False        # a counter of the blocks run, without keys


class _Const:
    """A constant side input (see the module docstring), handed to every block as it is."""

    def __init__(self, value: np.ndarray):
        self.value = value

    def __eq__(self, other):
        return (isinstance(other, _Const) and self.value.shape == other.value.shape
                and self.value.dtype == other.value.dtype
                and bool(np.array_equal(self.value, other.value)))

    def __hash__(self):
        return hash((self.value.shape, str(self.value.dtype)))


def pack(x: jax.Array, args: tuple, kwargs: dict, sides: dict, where: str,
         consts: dict | None = None, keys: jax.Array | None = None,
         counter: bool = False) -> jax.Array:
    """The message for activation ``x`` and side inputs ``(args, kwargs)``; records its
    :class:`Side` in ``sides`` under the message's per-example shape. ``consts``: the array
    leaves (by their index among the arrays) that are constants, with their values: they are
    not carried. ``keys``: per-example dropout key data ``[B, 2]`` uint32, carried bit for
    bit at the end of the message, followed by a counter of the blocks run (see
    :func:`keys_of`); ``counter``: the counter without keys (blocks that pick their own
    constants by it). ``where`` names the blocks in errors."""
    b = x.shape[0]
    consts = consts or {}
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [a for a in leaves if isinstance(a, jax.Array)]
    carried = [a for k, a in enumerate(arrays) if k not in consts]
    for a in carried:
        _check_travels(a, x.dtype, where)
    whole = tuple(not (a.ndim and a.shape[0] == b) for a in carried)
    per = [jnp.broadcast_to(a, (b, *a.shape)) if w else a for a, w in zip(carried, whole)]
    statics, k = [], 0
    for a in leaves:  # None where a carried array goes
        if isinstance(a, jax.Array):
            statics.append(_Const(np.asarray(consts[k])) if k in consts else None)
            k += 1
        else:
            statics.append(a)
    parts = [x.reshape(b, -1)] + [jax.lax.stop_gradient(a).reshape(b, -1).astype(x.dtype)
                                  for a in per]
    if keys is not None:  # the key bits in the message's dtype, then the block counter
        words = jax.lax.bitcast_convert_type(keys.astype(jnp.uint32), x.dtype)
        parts += [words.reshape(b, -1), jnp.zeros((b, 1), x.dtype)]
    elif counter:
        parts.append(jnp.zeros((b, 1), x.dtype))
    side = Side(treedef, tuple(statics), tuple(a.shape[1:] for a in per),
                tuple(a.dtype for a in per), x.shape[1:], x.dtype, whole,
                0 if keys is None else parts[-2].shape[1], counter and keys is None)
    msg = jnp.concatenate(parts, axis=1)
    known = sides.setdefault(msg.shape[1:], side)
    if known.treedef != side.treedef or known.shapes != side.shapes:
        raise ValueError(f"{where}: two batch shapes give the same message width "
                         f"{msg.shape[1]}; use one batch shape per trainer")
    return msg


def _check_travels(a: jax.Array, x_dtype: Any, where: str) -> None:
    """Refuse a side input that the activation's dtype would not carry exactly."""
    if not (jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_
            or jnp.issubdtype(a.dtype, jnp.floating)):
        raise TypeError(f"{where}: a side input of dtype {a.dtype} cannot travel "
                        "between stages")
    if (jnp.issubdtype(a.dtype, jnp.integer) and jnp.dtype(x_dtype).itemsize < 4):
        raise TypeError(
            f"{where}: an integer side input ({a.dtype}{list(a.shape)}) would "
            f"travel between stages in the {jnp.dtype(x_dtype).name} activation, which "
            "rounds integers above 256 (bfloat16) or 2048 (float16). Use "
            "compute_dtype='float32' for this model, or pass the blocks a boolean mask "
            "or a float side input instead")


def unpack(msg: jax.Array, side: Side) -> tuple[jax.Array, tuple, dict]:
    """The activation and the side inputs ``(args, kwargs)`` packed in ``msg``."""
    b = msg.shape[0]
    n = math.prod(side.x_shape)
    x = msg[:, :n].reshape(b, *side.x_shape).astype(side.x_dtype)
    start, arrays = n, []
    whole = side.whole or (False,) * len(side.shapes)
    for shape, dtype, w in zip(side.shapes, side.dtypes, whole, strict=True):
        size = math.prod(shape)
        a = jax.lax.stop_gradient(msg[:, start:start + size]).reshape(b, *shape)
        arrays.append((a[0] if w else a).astype(dtype))  # whole: every row holds it
        start += size
    it = iter(arrays)
    leaves = [next(it) if s is None else jnp.asarray(s.value) if isinstance(s, _Const) else s
              for s in side.statics]
    args, kwargs = jax.tree.unflatten(side.treedef, leaves)
    return x, args, kwargs


def keys_of(msg: jax.Array, side: Side) -> tuple[jax.Array | None, jax.Array | None]:
    """The dropout key data ``[B, 2]`` and the blocks run so far (a scalar) in ``msg``."""
    if side.counter:
        return None, jax.lax.stop_gradient(msg[0, -1]).astype(jnp.int32)
    if not side.keys:
        return None, None
    words = jax.lax.stop_gradient(msg[:, -1 - side.keys:-1])
    if jnp.dtype(msg.dtype).itemsize < 4:
        words = words.reshape(msg.shape[0], 2, -1)
    data = jax.lax.bitcast_convert_type(words, jnp.uint32)
    return data.reshape(msg.shape[0], 2), jax.lax.stop_gradient(msg[0, -1]).astype(jnp.int32)


def counted(msg: jax.Array, side: Side, blocks: int) -> jax.Array:
    """``msg`` after ``blocks`` more blocks ran (its counter advanced)."""
    return msg if not (side.keys or side.counter) else msg.at[:, -1].add(blocks)


def activation(out: Any) -> jax.Array:
    """The activation a block returns: its first array (alone, or first in a tuple whose other
    outputs, e.g. Mamba2's states, training drops:
    :func:`fiddlejax.adaptation.standins.check_log`)."""
    arrays = [a for a in jax.tree.leaves(out) if isinstance(a, jax.Array)]
    if not arrays:
        raise TypeError(f"a block returned {describe(out)}; fiddlejax carries one activation")
    return arrays[0]


def describe(x) -> str:
    """A short name for what a block returned, for errors."""
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    return type(x).__name__


def constant_leaves(closed: Any) -> dict[int, Any]:
    """The outputs of ``closed`` (a ClosedJaxpr) that depend on none of its inputs, evaluated:
    ``{output index: value}``. Only the equations they need run (eagerly, on constants), so
    the model's real work (embeddings) is never computed here."""
    jaxpr = closed.jaxpr
    env = dict(zip((id(v) for v in jaxpr.constvars), closed.consts, strict=True))
    dep = {id(v) for v in jaxpr.invars}

    def read(v):
        return v.val if _literal(v) else env[id(v)]

    with jax.ensure_compile_time_eval():
        for eqn in jaxpr.eqns:
            if any(id(v) in dep for v in eqn.invars if not _literal(v)):
                dep.update(id(v) for v in eqn.outvars)
                continue
            out = eqn.primitive.bind(*(read(v) for v in eqn.invars), **eqn.params)
            outs = out if eqn.primitive.multiple_results else [out]
            env.update((id(v), o) for v, o in zip(eqn.outvars, outs, strict=True))
    return {k: np.asarray(read(v)) for k, v in enumerate(jaxpr.outvars)
            if _literal(v) or (id(v) not in dep and id(v) in env)}


def _literal(v) -> bool:
    from jax.extend.core import Literal

    return isinstance(v, Literal)
