"""Where each parameter's FSDP shard lies: the dimension ``zero=3`` splits over ``data`` (and
the storage axes beside it, ``context`` or ``expert``), and the specs that say so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

# Parameters this small with no dimension divisible by ``data`` stay replicated under zero=3
# (norm scales, biases); a larger one is an error that names it.
SMALL = 1 << 16


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def fsdp_dims(params: nnx.State, spec_tree: nnx.State, data: int | Callable,
              lead: Callable) -> nnx.State:
    """The dimension of each leaf sharded over ``data`` (-1: replicated).

    The largest dimension that ``data`` divides and no other mesh axis shards, after the
    ``lead(path)`` leading dimensions that index layers or stages. ``data``: the shard count,
    or a function of a leaf's spec giving it (1: the leaf stays whole). Raises, naming the
    parameter, for a large leaf with no such dimension.
    """
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
    specs = jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P))
    dims = []
    shards_of = data if callable(data) else lambda _: data
    for (path, v), spec in zip(flat, specs, strict=True):
        data = shards_of(spec)
        if data == 1:
            dims.append(-1)
            continue
        parts = tuple(spec) + (None,) * (v.ndim - len(spec))
        start = lead(path)
        free = [d for d in range(start, v.ndim) if parts[d] is None and v.shape[d] % data == 0]
        if free:
            dims.append(max(free, key=lambda d: (v.shape[d], -d)))
            continue
        if int(np.prod(v.shape[start:])) >= SMALL:
            raise ValueError(
                f"zero=3 shards every parameter over data={data}, but no free dimension of "
                f"{jax.tree_util.keystr(path)} (shape {tuple(v.shape)}, sharded as {spec}) is "
                f"divisible by {data}; use a data size that divides one of its dimensions, or "
                "zero=1 (only the optimizer state sharded)")
        dims.append(-1)
    return jax.tree.unflatten(jax.tree.structure(params, is_leaf=_is_var), dims)


def add_data_axis(spec: P, d: int, axes: str | tuple[str, ...] = "data") -> P:
    """``spec`` with ``data`` (or the storage ``axes``) on dimension ``d`` (unchanged for -1)."""
    if d < 0:
        return spec
    parts = [*spec, *([None] * (d + 1 - len(spec)))]
    parts[d] = axes
    return P(*parts)


def with_data_axis(spec_tree: nnx.State, dims: nnx.State,
                   axes: str | tuple[str, ...] = "data") -> nnx.State:
    """``spec_tree`` with ``data`` (or the storage ``axes``, less those a leaf is already split
    over: :func:`free_of`) added on each leaf's FSDP dimension."""
    def add(spec, d):
        if isinstance(axes, str):
            return add_data_axis(spec, d, axes)
        mine = free_of(axes, spec)
        return spec if d < 0 else add_data_axis(spec, d, mine if len(mine) > 1 else mine[0])

    def one(d, s):
        return s.replace(add(s.get_value(), d)) if _is_var(s) else add(s, d)

    return jax.tree.map(one, dims, spec_tree)


def free_of(axes: tuple[str, ...], spec: P) -> tuple[str, ...]:
    """``axes`` less those ``spec`` already splits a dimension over: zero=3 stores the dense
    weights over ``data`` x ``expert``, the experts' own (split over ``expert`` by expert)
    over ``data`` alone."""
    used = {a for part in spec if part for a in (part if isinstance(part, tuple) else (part,))}
    return tuple(a for a in axes if a not in used)


def only_data(dims: Any, spec_tree: Any) -> Any:
    """shard_map specs over ``data`` alone: ``data`` on each FSDP dimension, else replicated."""
    return jax.tree.map(lambda d, _: P() if d < 0 else P(*([None] * d), "data"), dims,
                        spec_tree)


__all__ = ["SMALL", "add_data_axis", "free_of", "fsdp_dims", "only_data", "with_data_axis"]
