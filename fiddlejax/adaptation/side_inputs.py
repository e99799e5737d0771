"""Side inputs travel with the activation: a pytree message between layers, leaf by leaf.

An adapted model's blocks get more than the activation (masks, positions, segment ids, rotary
tables). :func:`pack` makes the message a dict: the activation ``"x"``, the carried side inputs
``"side"`` each in its own dtype (int32 positions stay int32 under bf16 compute), and for
layout-independent dropout the per-example keys ``"keys"`` (uint32) and a counter of the blocks
run ``"count"`` (int32); the pipeline stashes and sends each leaf as it is
(:mod:`fiddlejax.message`). :func:`unpack` rebuilds the block's arguments from it with the
:class:`Side` recorded at packing.

Side inputs come in three kinds, each rebuilt as the blocks got it:

- computed from the batch with its batch axis (a padding mask ``[B, S]``): carried per example,
  so a microbatch carries its own rows;
- constants, computed from neither the batch nor the parameters (rotary tables ``(S, d/2)``, a
  causal mask ``(1, 1, S, S)``, positions from ``arange``): not carried at all, but handed to
  every block whole, as values (``consts``, found by :func:`constant_leaves`);
- computed from the batch without a batch axis: carried once per example row, rebuilt whole.

A side input computed from the parameters (an encoder's output, which a decoder's blocks
cross-attend to) is ``learned``: carried like the others but differentiated. Every layer passes
it on unchanged and also reads it, so its cotangent at a layer's input is the one at its output
plus what that layer's blocks add: the backward through the stack (and through the pipeline's
stages, microbatch by microbatch) sums every block's share into the message entering the stack,
whose cotangent the prologue's backward takes to the encoder's parameters. The others stay
behind ``stop_gradient`` (a mask's gradient is never computed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Side:
    """How the side inputs of a block call are rebuilt from the message."""

    treedef: Any                 # of (args[1:], kwargs) with array leaves as None placeholders
    statics: tuple               # the non-array leaves, in order (None where an array goes)
    dtypes: tuple                # each carried array's own dtype (booleans travel as int8)
    whole: tuple = ()            # per carried array: True when it has no batch axis
    learned: tuple = ()          # per carried array: True when computed from the parameters


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
         counter: bool = False, learned: frozenset = frozenset()) -> dict:
    """The message for activation ``x`` and side inputs ``(args, kwargs)``; records its
    :class:`Side` in ``sides`` under the message's :func:`key`. ``consts``: the array leaves
    (by their index among the arrays) that are constants, with their values: they are not
    carried. ``keys``: per-example dropout key data ``[B, 2]`` uint32, carried with a counter
    of the blocks run (see :func:`keys_of`); ``counter``: the counter without keys (blocks
    that pick their own constants by it); ``learned``: the array leaves (by index) computed
    from the parameters, carried with their gradient. ``where`` names the blocks in errors."""
    b = x.shape[0]
    consts = consts or {}
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [a for a in leaves if isinstance(a, jax.Array)]
    carried = [a for k, a in enumerate(arrays) if k not in consts]
    grads = tuple(k in learned for k in range(len(arrays)) if k not in consts)
    for a in carried:
        _check_travels(a, where)
    whole = tuple(not (a.ndim and a.shape[0] == b) for a in carried)
    per = [jnp.broadcast_to(a, (b, *a.shape)) if w else a for a, w in zip(carried, whole)]
    statics, k = [], 0
    for a in leaves:  # None where a carried array goes
        if isinstance(a, jax.Array):
            statics.append(_Const(np.asarray(consts[k])) if k in consts else None)
            k += 1
        else:
            statics.append(a)
    msg = {"x": x, "side": tuple(_held(a.astype(jnp.int8) if a.dtype == jnp.bool_ else a, g)
                                 for a, g in zip(per, grads, strict=True))}
    if keys is not None:
        msg["keys"] = keys.astype(jnp.uint32)
    if keys is not None or counter:
        msg["count"] = jnp.zeros((b,), jnp.int32)
    side = Side(treedef, tuple(statics), tuple(a.dtype for a in per), whole, grads)
    known = sides.setdefault(key(msg), side)
    if (known.treedef, known.dtypes, known.learned) != (side.treedef, side.dtypes, grads):
        raise ValueError(f"{where}: two batch shapes give the same message; use one batch "
                         "shape per trainer")
    return msg


def _held(a: jax.Array, learned: bool) -> jax.Array:
    """A side input as the message carries it: with its gradient only when ``learned``."""
    return a if learned else jax.lax.stop_gradient(a)


def key(msg: dict) -> tuple:
    """What identifies a message's :class:`Side`: its structure and per-example shapes."""
    return jax.tree.structure(msg), tuple((a.shape[1:], jnp.dtype(a.dtype).name)
                                          for a in jax.tree.leaves(msg))


def _check_travels(a: jax.Array, where: str) -> None:
    """Refuse a side input that no stage buffer holds."""
    if not (jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_
            or jnp.issubdtype(a.dtype, jnp.floating)):
        raise TypeError(f"{where}: a side input of dtype {a.dtype} cannot travel "
                        "between stages")


def unpack(msg: dict, side: Side) -> tuple[jax.Array, tuple, dict]:
    """The activation and the side inputs ``(args, kwargs)`` carried in ``msg``."""
    whole = side.whole or (False,) * len(side.dtypes)
    learned = side.learned or (False,) * len(side.dtypes)
    arrays = [_held(a[0] if w else a, g).astype(dtype)  # whole: every row holds it
              for a, dtype, w, g in zip(msg["side"], side.dtypes, whole, learned, strict=True)]
    it = iter(arrays)
    leaves = [next(it) if s is None else jnp.asarray(s.value) if isinstance(s, _Const) else s
              for s in side.statics]
    args, kwargs = jax.tree.unflatten(side.treedef, leaves)
    return msg["x"], args, kwargs


def keys_of(msg: dict) -> tuple[jax.Array | None, jax.Array | None]:
    """The dropout key data ``[B, 2]`` and the blocks run so far (a scalar) in ``msg``."""
    count = msg["count"][0] if "count" in msg else None
    return msg.get("keys"), count


def counted(msg: dict, blocks: int) -> dict:
    """``msg`` after ``blocks`` more blocks ran (its counter advanced)."""
    return {**msg, "count": msg["count"] + blocks} if "count" in msg else msg


def activation(out: Any, select: Callable[[Any], Any] | None = None) -> jax.Array:
    """The activation a block returns: ``select(out)`` (``parallelize(block_output=)``), else
    its first array (alone, or first in a tuple whose other outputs, e.g. Mamba2's states,
    training drops: :func:`fiddlejax.adaptation.standins.check_log`)."""
    if select is not None:
        x = select(out)
        if not isinstance(x, jax.Array):
            raise TypeError(f"block_output picked {describe(x)} from a block that returned "
                            f"{describe(out)}; it must return the activation array")
        return x
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
