"""Blocks stacked with ``nnx.vmap`` and applied with ``nnx.scan`` or ``jax.lax.scan``, as is.

The Flax guides' scan-over-layers pattern keeps one module whose parameters already carry the
layer axis the pipeline needs (``self.blocks = nnx.vmap(make_block)(rngs)``) and applies it with a
scan inside ``__call__``. :func:`fiddlejax.adaptation.adapt.adapt` splits such a forward as it
splits a list of blocks: the stacked module's place is taken by a :class:`ScanStandIn` holding a
``[layers]`` counter (so the model's own scan still finds its length), and while fiddlejax traces
the model's pieces (:func:`unrolled`) the outermost ``jax.lax.scan`` -- the one ``nnx.scan`` calls
-- runs as a Python loop in the caller's trace. The stand-in then sees the activation and side
inputs the model hands its blocks as they are outside the scan, so it can stop the forward at the
first block (the prologue), hand the stack's output on (the epilogue) or run and record the real
blocks (the split's check). Scans nested inside a block, or outside these traces, are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fiddlejax import intercept
from fiddlejax.adaptation.standins import StandIn

_LAX_SCAN = jax.lax.scan


class LayerCount(nnx.Variable):
    """The stand-in's ``[layers]`` counter: gives the model's scan its length."""


class ScanStandIn(nnx.Module):
    """Takes the stacked module's place; each call inside the (unrolled) scan is block ``i``."""

    def __init__(self, n: int):
        self.count = LayerCount(jnp.zeros((n,), jnp.int32))

    def __call__(self, *args, **kwargs):
        calls = intercept.current().scan_calls
        if calls is None:
            raise RuntimeError("a fiddlejax stand-in for stacked blocks ran outside fiddlejax")
        i = calls[0]
        calls[0] += 1
        return StandIn(i)(*args, **kwargs)


def _unrolled_scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
    """``jax.lax.scan`` as a Python loop (the outermost scan while :func:`unrolled` is active)."""
    if not intercept.current().unroll_scan:
        return _LAX_SCAN(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kw)
    leaves = jax.tree.leaves(xs)
    n = length if length is not None else leaves[0].shape[0]
    with intercept.setting(unroll_scan=False):  # scans inside a block stay scans
        carry, ys = init, []
        for i in reversed(range(n)) if reverse else range(n):
            carry, y = f(carry, jax.tree.map(lambda a, i=i: a[i], xs))
            ys.append(y)
    if reverse:
        ys.reverse()
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys else None


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Within this block the outermost ``jax.lax.scan`` runs unrolled and the stand-in counts
    its calls from 0 (see the module docstring)."""
    with intercept.setting(unroll_scan=True, scan_calls=[0]):
        yield


jax.lax.scan = _unrolled_scan  # delegates to JAX's own outside :func:`unrolled`


def per_layer(tree: Any, i: int) -> Any:
    """Layer ``i`` of a stacked tree (arrays or shape structs)."""
    def take(a):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
        return a[i]
    return jax.tree.map(take, tree)


def name_layers(stack: nnx.Module) -> None:
    """Give the stacked parameters' leading axis the ``layers`` name where their names cover
    one layer only (``nnx.vmap`` without ``transform_metadata``), as fiddlejax stacks do."""
    for _, v in nnx.to_flat_state(nnx.state(stack, nnx.Param)):
        names = v.get_metadata().get("out_sharding")
        if names and len(names) == v.ndim - 1:
            v.set_metadata(out_sharding=("layers", *names))


@contextlib.contextmanager
def one_layer_view(stack: nnx.Module) -> Iterator[None]:
    """The stack's parameters hold layer 0 only within this block (name inference reads
    shapes: a stacked kernel would look like an attention one)."""
    held = [(v, v.get_value()) for _, v in nnx.to_flat_state(nnx.state(stack, nnx.Param))]
    for v, value in held:
        v.set_value(value[0])
    try:
        yield
    finally:
        for v, value in held:
            v.set_value(value)


__all__ = ["LayerCount", "ScanStandIn", "name_layers", "one_layer_view",
           "per_layer", "unrolled"]
