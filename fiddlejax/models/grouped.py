"""The blocked grouped matmul: rows sorted by expert, run in blocks of one expert's rows.

What ``jax.lax.ragged_dot`` does on a GPU or TPU, written for any backend (XLA's CPU lowers
``ragged_dot`` to a dense masked matmul over every expert). Each expert's rows start a new
block of ``block`` rows, so a block multiplies one expert's weights alone. The loop runs only
the blocks that hold rows (a trip count read from the group sizes), forward and backward: rows
past the groups (an all-to-all buffer's padding) cost nothing, and an expert's padding is at
most ``block - 1`` rows. The buffers are sized for the most blocks the rows can fill (shapes
are static); what runs is what the routing sent.

The loop is a ``custom_vjp`` (a loop of unknown length has no reverse mode): the forward keeps
each block's residuals as ``jax.vjp`` of the block function leaves them, less the block's
weights and rows, which the backward slices again. The block keeps its matmuls' outputs and
recomputes its activation; behind expert parallelism's all-to-all (``most`` given) it keeps
nothing, since a stash is sized for every block the buffer could fill: S times the rows run.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fiddlejax.message import align_varying

BLOCK = 128  # rows per block


def _take(ws: tuple, e) -> tuple:
    return tuple(jax.lax.dynamic_index_in_dim(w, e, keepdims=False) for w in ws)


class _Residuals:
    """Which of a block's ``jax.vjp`` residual leaves are its inputs (sliced again in the
    backward) and the shapes of the others (stored per block), from one traced example."""

    def __init__(self, one: Callable, xb, w):  # traced on one block: dead code when run
        out, back = jax.vjp(one, xb, w)
        leaves, self.treedef = jax.tree.flatten(back)
        inputs = [xb, *w]
        self.src = [next((k for k, c in enumerate(inputs) if leaf is c), None)
                    for leaf in leaves]
        self.stored = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r, k in
                       zip(leaves, self.src, strict=True) if k is None]
        self.out = jax.ShapeDtypeStruct(out.shape, out.dtype)

    def split(self, back) -> list:
        return [r for r, k in zip(jax.tree.leaves(back), self.src, strict=True) if k is None]

    def vjp(self, stored: list, xb, w) -> Callable:
        inputs, it = [xb, *w], iter(stored)
        return jax.tree.unflatten(self.treedef, [next(it) if k is None else inputs[k]
                                                 for k in self.src])


def _loop(one: Callable, xb: jax.Array, which: jax.Array, used: jax.Array, ws: tuple):
    """``one(xb[i], ws sliced at which[i])`` for the first ``used`` of ``xb [blocks, block,
    d]`` (zeros after them), differentiable in ``xb`` and ``ws``."""
    blocks = xb.shape[0]
    res = _Residuals(one, xb[0], _take(ws, which[0]))
    out = res.out

    def forward(xb, ws, which, used, save: bool):
        def body(i, c):
            yb, stored = c
            w = _take(ws, which[i])
            if not save:
                return yb.at[i].set(one(xb[i], w)), stored
            y, back = jax.vjp(one, xb[i], w)
            return yb.at[i].set(y), [s.at[i].set(r) for s, r in
                                     zip(stored, res.split(back), strict=True)]

        init = (jnp.zeros((blocks, *out.shape), out.dtype),
                [jnp.zeros((blocks, *r.shape), r.dtype) for r in res.stored] if save else [])
        return jax.lax.fori_loop(0, used, body, align_varying(init, xb, ws, which))

    @jax.custom_vjp
    def run(xb, ws, which, used):
        return forward(xb, ws, which, used, save=False)[0]

    def run_fwd(xb, ws, which, used):
        yb, stored = forward(xb, ws, which, used, save=True)
        return yb, (xb, ws, which, used, stored)

    def run_bwd(saved, ct):
        xb, ws, which, used, stored = saved

        def body(i, c):
            dxb, dws = c
            w = _take(ws, which[i])
            dx, dw = res.vjp([s[i] for s in stored], xb[i], w)(ct[i])
            return dxb.at[i].set(dx), tuple(d.at[which[i]].add(g) for d, g in zip(dws, dw))

        init = (jnp.zeros_like(xb), tuple(jnp.zeros_like(w) for w in ws))
        dxb, dws = jax.lax.fori_loop(0, used, body, align_varying(init, xb, ws, which, ct))
        return dxb, dws, None, None

    run.defvjp(run_fwd, run_bwd)
    return run(xb, ws, which, used)


def blocked(xs: jax.Array, sizes: jax.Array, ws: tuple, one: Callable,
            block: int = BLOCK, most: jax.Array | None = None) -> jax.Array:
    """``one(rows [block, d], w)`` on rows ``xs [m, d]`` sorted by expert, ``sizes[e]`` rows
    each (rows past ``sizes.sum()`` are padding: their outputs are zeros), ``w`` expert
    ``e``'s slices of the stacked weights ``ws`` (``[E, ...]`` each). FLOPs: the rows' own,
    plus at most ``block - 1`` padding rows per expert. ``most``: group sizes no row set of a
    ``vmap`` over this call exceeds, the same for all (their blocks are the loop's length:
    one loop for the whole batch); ``None``: ``sizes``."""
    m, e = xs.shape[0], ws[0].shape[0]
    blocks = -(-(m + e * (block - 1)) // block)  # the most blocks the rows can fill
    padded = -(-sizes // block) * block
    ends = jnp.cumsum(padded)
    owner = jnp.repeat(jnp.arange(e, dtype=jnp.int32), sizes, total_repeat_length=m)
    shift = (ends - padded) - (jnp.cumsum(sizes) - sizes)  # a group's padded start - start
    dest = jnp.arange(m, dtype=jnp.int32) + shift[owner]
    # A block's expert: groups ending at or before its first row (not jnp.searchsorted, whose
    # hijax primitive fails inside a shard_map on jax 0.10).
    starts = jnp.arange(blocks, dtype=jnp.int32)[:, None] * block
    which = jnp.minimum(jnp.sum(ends[None, :] <= starts, axis=1), e - 1).astype(jnp.int32)
    xb = jnp.zeros((blocks * block, xs.shape[1]), xs.dtype).at[dest].set(xs)
    # A block keeps its matmuls' outputs and recomputes its activation; with ``most`` (an
    # all-to-all buffer, sized for every row a shard could send: S times the real ones) it
    # keeps nothing and recomputes its matmuls, instead of a stash S times the rows it runs.
    policies = jax.checkpoint_policies
    one = jax.checkpoint(one, policy=policies.nothing_saveable if most is not None
                         else policies.dots_with_no_batch_dims_saveable)
    used = jnp.minimum(jnp.sum(-(-(sizes if most is None else most) // block)), blocks)
    yb = _loop(one, xb.reshape(blocks, block, -1), which, used, ws)
    real = jnp.arange(m) < jnp.sum(sizes)  # padding in the last expert's block: not kept
    return jnp.where(real[:, None], yb.reshape(blocks * block, -1)[dest], 0)


__all__ = ["BLOCK", "blocked"]
