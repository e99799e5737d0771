"""Side inputs travel with the activation: one ``[batch, features]`` message between layers.

An adapted model's blocks get more than the activation (masks, positions, segment ids, rotary
tables). A pipeline moves one array between stages, so :func:`pack` concatenates the flattened
activation and side inputs (in the activation's dtype, without gradients) and :func:`unpack`
rebuilds the block's arguments from it with the :class:`Side` recorded at packing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Side:
    """How the side inputs of a block call are rebuilt from the packed message."""

    treedef: Any                 # of (args[1:], kwargs) with array leaves as None placeholders
    statics: tuple               # the non-array leaves, in order (None where an array goes)
    shapes: tuple                # per-example shapes of the array leaves
    dtypes: tuple
    x_shape: tuple               # per-example shape of the activation
    x_dtype: Any


def pack(x: jax.Array, args: tuple, kwargs: dict, sides: dict, where: str) -> jax.Array:
    """The message for activation ``x`` and side inputs ``(args, kwargs)``; records its
    :class:`Side` in ``sides`` under the message's per-example shape. ``where`` names the
    blocks in errors."""
    b = x.shape[0]
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [a for a in leaves if isinstance(a, jax.Array)]
    for a in arrays:
        _check_travels(a, x.dtype, where)
    per = [a if a.ndim and a.shape[0] == b else jnp.broadcast_to(a, (b, *a.shape))
           for a in arrays]
    side = Side(treedef, tuple(None if isinstance(a, jax.Array) else a for a in leaves),
                tuple(a.shape[1:] for a in per), tuple(a.dtype for a in per),
                x.shape[1:], x.dtype)
    parts = [x.reshape(b, -1)] + [jax.lax.stop_gradient(a).reshape(b, -1).astype(x.dtype)
                                  for a in per]
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
    for shape, dtype in zip(side.shapes, side.dtypes, strict=True):
        size = math.prod(shape)
        a = jax.lax.stop_gradient(msg[:, start:start + size]).reshape(b, *shape)
        arrays.append(a.astype(dtype))
        start += size
    it = iter(arrays)
    leaves = [next(it) if s is None else s for s in side.statics]
    args, kwargs = jax.tree.unflatten(side.treedef, leaves)
    return x, args, kwargs


def activation(out: Any) -> jax.Array:
    """The one array a block returns (alone, or in a tuple with Nones)."""
    arrays = [a for a in jax.tree.leaves(out) if isinstance(a, jax.Array)]
    if len(arrays) != 1:
        raise TypeError(f"a block returned {describe(out)}; fiddlejax carries one activation")
    return arrays[0]


def describe(x) -> str:
    """A short name for what a block returned, for errors."""
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    return type(x).__name__
