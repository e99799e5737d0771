"""FSDP with the gathers one layer ahead: the stack's collectives overlap its matmuls.

Gathered when it runs (:meth:`fiddlejax.compute.ParamView.layer`), a layer's weights arrive
just before its matmuls, which wait for them. Here the scan over the stack carries the next
layer's gathered weights: step ``i`` issues the all-gather of layer ``i+1`` and runs layer ``i``
on the weights the step before gathered, so the gather and the matmuls depend on nothing of
each other and a latency-hiding scheduler runs them at once. The backward (a reverse scan in a
``custom_vjp``) does the same with layer ``i-1``'s gather, and scatters layer ``i+1``'s
gradient (carried from the step before) while layer ``i`` computes its own.

Held: one more layer of gathered weights (forward and backward) and one of unscattered
gradient (backward). The forward saves each layer's residuals as its remat policy says, minus
its weights (never saved whole: the backward gathers them again, one step ahead), so the stash
is what ``fsdp_gather="layer"`` without prefetch keeps. Cost: the last step of each loop
prefetches a layer nobody uses (the forward's feeds the backward's first layer) and the
backward's first scatter sends zeros: 1/(2n) more gathers and 1/n more reduce-scatters for
``n`` layers. ``Plan(fsdp_prefetch=False)`` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fiddlejax import message
from fiddlejax.memory.storage import from_storage, to_storage


def _take(stacked: Any, i) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stacked)


def _put(stacked: Any, i, one: Any) -> Any:
    return jax.tree.map(
        lambda a, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), i, 0),
        stacked, one)


def _source(leaf, w) -> tuple[str, Any]:
    """Where the backward finds a residual leaf: ``("weight", index)`` into the layer's gathered
    weights (gathered again, never saved), ``("const", value)`` for a constant the layer closes
    over (a mask or rotary table: saved once, not per layer), else ``("saved", dtype)``."""
    k = next((k for k, c in enumerate(jax.tree.leaves(w)) if leaf is c), None)
    if k is not None:
        return "weight", k
    return ("saved", leaf.dtype) if isinstance(leaf, jax.core.Tracer) else ("const", leaf)


def stack(apply: Callable, gather: Callable, scatter: Callable, policy: Callable,
          unroll: bool = False) -> Callable[[Any, Any], Any]:
    """``run(stacked, x)``: ``x`` through every layer of ``stacked`` (FSDP shards with a
    leading layer axis) as ``scan(apply(gather(shard_i), h))`` computes it, with each
    ``gather`` one layer ahead and each ``scatter`` (of a layer's gradient onto its shard)
    one layer behind. ``apply`` runs under ``jax.checkpoint(policy=policy)``;
    ``unroll``: both scans unrolled (``Plan.unroll_layers``)."""
    ckpt = jax.checkpoint(apply, policy=policy)
    # per input shapes: the residuals' treedef and each leaf's _source (found by the forward's
    # trace, read by the backward's)
    layouts: dict = {}

    def length(stacked) -> int:
        return jax.tree.leaves(stacked)[0].shape[0]

    def key(stacked, x):  # shapes only: a cotangent's integer leaves are float0
        return jax.tree.structure((stacked, x)), tuple(
            a.shape for a in jax.tree.leaves((stacked, x)))

    def forward(stacked, x, save: bool):
        n, shapes = length(stacked), key(stacked, x)

        def body(carry, i):
            h, w = carry
            nxt = gather(_take(stacked, jnp.minimum(i + 1, n - 1)))  # issued before the layer
            if not save:
                return (apply(w, h), nxt), None
            h, vjp = jax.vjp(ckpt, w, h)
            leaves, treedef = jax.tree.flatten(vjp)
            layouts[shapes] = (treedef, [_source(leaf, w) for leaf in leaves],
                               jax.tree.map(lambda a: a.dtype, x))
            # kept 16-bit floats as their bits (what a GPU holds; XLA's CPU would widen them)
            return (h, nxt), [to_storage(r) for r, (kind, _) in
                              zip(leaves, layouts[shapes][1], strict=True) if kind == "saved"]

        (h, last), res = jax.lax.scan(body, (x, gather(_take(stacked, 0))), jnp.arange(n),
                                      unroll=unroll)
        return h, last, res

    @jax.custom_vjp
    def run(stacked, x):
        return forward(stacked, x, save=False)[0]

    def run_fwd(stacked, x):
        h, last, res = forward(stacked, x, save=True)
        return h, (stacked, last, res)  # last: layer n-1 gathered, the backward's first

    def run_bwd(saved, ct):
        stacked, last, res = saved
        n = length(stacked)
        treedef, src, dtypes = layouts[key(stacked, ct)]
        ct = message.held(ct, dtypes)  # a message's integer leaves: zeros, not float0

        def body(carry, xs):
            i, r = xs
            dh, w, pending, grads = carry
            prev = gather(_take(stacked, jnp.maximum(i - 1, 0)))  # issued before the layer
            w_leaves, it = jax.tree.leaves(w), iter(r)
            vjp = jax.tree.unflatten(treedef, [
                from_storage(next(it), v) if kind == "saved" else
                w_leaves[v] if kind == "weight" else v for kind, v in src])
            dw, dh_new = vjp(message.to_vjp(dh))
            dh = message.from_vjp(dh_new, dh)
            # layer i+1's gradient, scattered while layer i's backward computes
            grads = _put(grads, jnp.minimum(i + 1, n - 1), scatter(pending))
            return (dh, prev, dw, grads), None

        init = (ct, last, jax.tree.map(jnp.zeros_like, last),
                jax.tree.map(jnp.zeros_like, stacked))
        (dx, _, dw0, grads), _ = jax.lax.scan(body, init, (jnp.arange(n), res), reverse=True,
                                              unroll=unroll)
        return _put(grads, 0, scatter(dw0)), message.to_vjp(dx)

    run.defvjp(run_fwd, run_bwd)
    return run


__all__ = ["stack"]
