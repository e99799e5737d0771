"""Parameter layouts: the canonical tree users see versus the internal tree a plan trains.

The internal tree differs from the canonical one only where sharding needs it: vocabulary axes
padded to a multiple of the ``tensor`` axis (padded rows get zero gradients and masked logits, so
the loss and gradients are unchanged), and, for pipelines, the layer stack regrouped per stage.
Conversions are pure functions, so they jit and run on sharded arrays.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax.sharding import DEFAULT_RULES, logical_to_spec


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _axes(v: nnx.Variable) -> tuple:
    return tuple(v.get_metadata().get("out_sharding") or ())


def pad_vocab(params: nnx.State, multiple: int) -> nnx.State:
    """Zero-pad every ``vocab`` axis to a multiple of ``multiple``."""

    def pad(v):
        axes = _axes(v)
        if "vocab" not in axes or multiple == 1:
            return v
        d = axes.index("vocab")
        extra = -v.shape[d] % multiple
        if not extra:
            return v
        widths = [(0, 0)] * v.ndim
        widths[d] = (0, extra)
        return v.replace(jnp.pad(v[...], widths))

    return jax.tree.map(pad, params, is_leaf=_is_var)


def vocab_pads(params: nnx.State, multiple: int) -> tuple[tuple[int, int], ...]:
    """``(padded, true)`` sizes of the vocabulary axes that :func:`pad_vocab` pads."""
    pads = set()
    for v in jax.tree.leaves(params, is_leaf=_is_var):
        axes = _axes(v) if _is_var(v) else ()
        if "vocab" in axes and multiple > 1:
            n = v.shape[axes.index("vocab")]
            if n % multiple:
                pads.add((n + -n % multiple, n))
    return tuple(sorted(pads))


def unpad_vocab(params: nnx.State, template: nnx.State) -> nnx.State:
    """Slice every ``vocab`` axis back to the canonical size given by ``template``."""

    def unpad(v, t):
        axes = _axes(v)
        if "vocab" not in axes or v.shape == t.shape:
            return v
        d = axes.index("vocab")
        return v.replace(jax.lax.slice_in_dim(v[...], 0, t.shape[d], axis=d))

    return jax.tree.map(unpad, params, template, is_leaf=_is_var)


def specs(params: nnx.State, rules: Mapping[str, str | None] = DEFAULT_RULES) -> nnx.State:
    """A PartitionSpec per parameter (same tree structure as ``params``)."""
    return jax.tree.map(lambda v: v.replace(logical_to_spec(_axes(v), rules)), params,
                        is_leaf=_is_var)


def shardings(mesh, spec_tree) -> nnx.State:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                        is_leaf=lambda x: isinstance(x, P))


def check_divisible(params: nnx.State, spec_tree: nnx.State, mesh) -> None:
    """Raise before compiling when a sharded dimension does not divide its mesh axis."""
    flat_p = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
    flat_s = jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P))
    for (path, v), spec in zip(flat_p, flat_s, strict=True):
        for dim, (size, ax) in enumerate(zip(v.shape, tuple(spec) + (None,) * v.ndim)):
            if ax is None:
                continue
            names = ax if isinstance(ax, tuple) else (ax,)
            n = 1
            for a in names:
                n *= int(mesh.shape[a])
            if size % n:
                logical = _axes(v)[dim] if dim < len(_axes(v)) else "?"
                what = {"heads": "n_heads", "mlp": "d_ff (the MLP width)",
                        "kv_heads": "num_key_value_heads"}.get(logical, logical)
                raise ValueError(
                    f"parameter {jax.tree_util.keystr(path)} has {what}={size} on dimension "
                    f"{dim}, not divisible by the {'x'.join(names)} axis of size {n}; choose a "
                    f"{'x'.join(names)} size that divides {size} or change the model"
                )
