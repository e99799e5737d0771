"""Attention over sequences split across ``context`` shards, written for the GSPMD partitioner.

The rows of a split batch (:mod:`fiddlejax.parallel.context`) are ``[C, B, 2, n]``: shard ``i``
(the leading axis, sharded over ``context``) holds, for ``B`` sequences, chunk ``i`` (its early
half) and chunk ``2C-1-i`` (its late half). Queries ``q[C, B, 2, n, H, Dh]``; keys and values
``[C, B, 2, n, KV, Dh]`` with ``KV`` dividing ``H`` (grouped-query attention: query head ``h``
reads KV head ``h // (H / KV)``); ``seg[C, B, 2, n]`` every token's segment id (attention never
crosses documents). Every array keeps its leading axis on ``context``, so each device computes
its own shard's blocks; the only communication is what the kernel asks for:

- :func:`ring_attention`: ``C`` steps; at step ``s`` shard ``i`` holds the K/V of shard
  ``i - s`` and passes them on (``jnp.roll`` by one shard along the sharded axis, which the
  partitioner lowers to one collective-permute, issued before the step's blocks so the
  transfer overlaps them). The softmax is merged online in float32 (running max, sum and
  output per query, as flash attention does). Only visible n x n blocks are computed: step 0
  three (the two diagonal blocks masked, the late queries over the early keys whole), every
  later step two (the late queries over the early keys whole, and either the early queries
  over the early keys, when the keys' shard precedes this one, or the late queries over the
  late keys, when it follows), so every shard computes ``3 + 2 (C - 1)`` blocks.
- :func:`gathered_attention`: K/V all-gathered over ``context``, one masked softmax of each
  shard's queries over the whole sequence (``4 C`` blocks' worth of scores, one collective).

Writing the ring with the partitioner's collectives rather than a nested ``shard_map`` keeps
it composable with the step's own manual axes (``data``, ``pipe``): jax 0.10 cannot
differentiate a ``shard_map`` nested in a manual region inside a layer scan (its hoisted
residuals are typed over the outer axes, which Shardy refuses).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _init(qh: jax.Array, kv: int) -> tuple:
    c, b, n, h, d = qh.shape
    g = h // kv
    return (jnp.full((c, b, kv, g, n), -jnp.inf, F32), jnp.zeros((c, b, kv, g, n), F32),
            jnp.zeros((c, b, n, kv, g, d), F32))


@jax.checkpoint
def _block(acc: tuple, qh, kh, vh, mask) -> tuple:
    """Merge one block of keys into the running (max, sum, output) of queries ``qh``.
    ``mask[C, B, nq, nk]``: which query may see which key. Rematerialized: the backward
    recomputes a block's scores rather than keeping every block's (the memory of flash
    attention: one n x n block live at a time, for one more pass over the blocks)."""
    m, s_, o = acc
    c, b, nq, h, d = qh.shape
    kv = kh.shape[3]
    q6 = qh.reshape(c, b, nq, kv, h // kv, d).astype(F32) * (d ** -0.5)
    scores = jnp.einsum("cbqkgd,cbskd->cbkgqs", q6, kh.astype(F32))
    mask = mask[:, :, None, None]
    blk = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, blk))  # softmax is shift-invariant
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.where(mask, jnp.exp(jnp.where(mask, scores, safe[..., None]) - safe[..., None]), 0.0)
    alpha = jnp.exp(m - safe)
    o = o * jnp.moveaxis(alpha, -1, 2)[..., None] + jnp.einsum(
        "cbkgqs,cbskd->cbqkgd", p, vh.astype(F32))
    return m_new, s_ * alpha + p.sum(-1), o


def _finish(acc: tuple, dtype) -> jax.Array:
    _, s_, o = acc
    out = o / jnp.moveaxis(s_, -1, 2)[..., None]
    c, b, n, kv, g, d = out.shape
    return out.reshape(c, b, n, kv * g, d).astype(dtype)


def _same(sq, sk):
    return sq[..., :, None] == sk[..., None, :]


def _pick(flag, a, b):
    return jax.tree.map(lambda x, y: jnp.where(flag.reshape(-1, *[1] * (x.ndim - 1)), x, y),
                        a, b)


def ring_attention(q, k, v, seg, causal: bool, keep: Callable) -> jax.Array:
    """Ring attention (see the module docstring); ``keep`` pins an array's leading axis to
    ``context``."""
    c, n = q.shape[0], q.shape[3]
    q0, q1 = q[:, :, 0], q[:, :, 1]
    s0, s1 = seg[:, :, 0], seg[:, :, 1]
    kv = k.shape[4]
    acc0, acc1 = _init(q0, kv), _init(q1, kv)
    diag = jnp.tril(jnp.ones((n, n), bool))
    shard = jnp.arange(c)
    held = (k, v, seg)
    for step in range(c):
        nxt = (jax.tree.map(lambda x: keep(jnp.roll(x, 1, axis=0)), held)
               if step < c - 1 else None)
        k0, k1 = held[0][:, :, 0], held[0][:, :, 1]
        v0, v1 = held[1][:, :, 0], held[1][:, :, 1]
        t0, t1 = held[2][:, :, 0], held[2][:, :, 1]
        if not causal:
            acc0 = _block(_block(acc0, q0, k0, v0, _same(s0, t0)), q0, k1, v1, _same(s0, t1))
            acc1 = _block(_block(acc1, q1, k0, v0, _same(s1, t0)), q1, k1, v1, _same(s1, t1))
        elif step == 0:  # own chunks: the diagonal blocks masked, late over early whole
            acc0 = _block(acc0, q0, k0, v0, diag & _same(s0, t0))
            acc1 = _block(acc1, q1, k0, v0, _same(s1, t0))
            acc1 = _block(acc1, q1, k1, v1, diag & _same(s1, t1))
        else:
            # keys of shard j = i - step: its early chunk j precedes our late chunk always;
            # j < i: it precedes our early chunk too (early queries, early keys);
            # j > i: its late chunk 2C-1-j precedes our late one (late queries, late keys).
            early = (shard - step) % c < shard
            acc1 = _block(acc1, q1, k0, v0, _same(s1, t0))
            merged = _block(_pick(early, acc0, acc1), _pick(early, q0, q1),
                            _pick(early, k0, k1), _pick(early, v0, v1),
                            _same(_pick(early, s0, s1), _pick(early, t0, t1)))
            acc0, acc1 = _pick(early, merged, acc0), _pick(early, acc1, merged)
        acc0, acc1 = jax.tree.map(keep, acc0), jax.tree.map(keep, acc1)
        if nxt is not None:
            held = nxt
    return jnp.stack([_finish(acc0, q.dtype), _finish(acc1, q.dtype)], axis=2)


def global_index(c: int, n: int) -> jax.Array:
    """``[C, 2n]``: each shard's tokens' places in the whole sequence."""
    ar = jnp.arange(n)
    shard = jnp.arange(c)[:, None]
    return jnp.concatenate([shard * n + ar, (2 * c - 1 - shard) * n + ar], axis=1)


def gathered_attention(q, k, v, seg, causal: bool, keep: Callable,
                       whole: Callable) -> jax.Array:
    """All-gathered K/V attention (see the module docstring); ``whole`` replicates an array
    over ``context`` (the all-gather)."""
    c, b, _, n = q.shape[:4]
    kw, vw, sw = (whole(x) for x in (k, v, seg))
    # [C, B, 2, n, ...] -> [B, C * 2n, ...] (shard-major, as global_index orders them)
    kw, vw, sw = (jnp.moveaxis(x, 1, 0).reshape(b, c * 2 * n, *x.shape[4:]) for x in (kw, vw, sw))
    ql = q.reshape(c * b, 2 * n, *q.shape[4:])
    sl = seg.reshape(c, b, 2 * n)
    mask = sl[..., :, None] == sw[None, :, None, :]  # [C, B, 2n, C 2n]
    if causal:
        g = global_index(c, n)
        mask = mask & (g[:, None, :, None] >= g.reshape(-1)[None, None, None, :])
    bcast = [keep(jnp.broadcast_to(x[None], (c, *x.shape))).reshape(c * b, *x.shape[1:])
             for x in (kw, vw)]
    out = jax.nn.dot_product_attention(ql, *bcast, mask=keep(mask).reshape(c * b, 1, 2 * n, -1))
    return out.reshape(q.shape)
