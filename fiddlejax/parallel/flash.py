"""One attention block, tiled: queries against keys in ``TILE`` x ``TILE`` tiles, flash-style.

A context shard's block of queries against a block of keys is ``n x n`` scores per head
(``n = T / 2C``: 8192 for a 128k-token sequence on ``context=8``, 8 GiB of float32 scores for
32 heads). :func:`attend` never holds more than one ``TILE x TILE`` tile of them: a loop over
query tiles, in each a loop over key tiles merging the softmax online (running max and sum per
query, in float32), as FlashAttention-2 does. Its backward is written by hand
(``jax.custom_vjp``): it keeps only the inputs, the normalized output and the log-sum-exp per
query, and recomputes each tile's probabilities from them (``dS = P * (dP - D)``), so neither
pass keeps a score matrix.

A block returns ``(out, lse)``; blocks over different keys merge exactly with :func:`merge`
(plain JAX, differentiated by autodiff), which is how the ring joins its steps. The mask of a
tile is built from each token's place in the whole sequence (causal, and a sliding window) and
its segment id (packed documents), never stored. The model options of :class:`Mode` (window,
Gemma 2's soft-capped scores, a custom query scale) are static, like ``causal``; the backward
recomputes the capped scores and applies the cap's derivative ``1 - tanh^2``.

Layouts (the leading ``C`` axis is the context shards, pinned by the caller's ``keep``):
``q[C, B, nq, KV, G, Dh]`` (grouped-query heads: ``G`` query heads per KV head),
``k, v[C, B, nk, KV, Dh]``, ``qpos[C, nq]``, ``kpos[C, nk]``, ``qseg[C, B, nq]``,
``kseg[C, B, nk]``; ``out[C, B, nq, KV, G, Dh]`` and ``lse[C, B, KV, G, nq]`` in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32
TILE = 1024  # tokens per query and key tile; a block shorter than this is one tile


def tile_size(n: int, tile: int | None = None) -> int:
    """The largest divisor of ``n`` not above ``tile`` (``TILE``): tiles cover a block evenly."""
    tile = TILE if tile is None else tile
    if n <= tile:
        return n
    return max(d for d in range(1, tile + 1) if n % d == 0)


def empty(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of attending to no keys: zeros and ``-inf``."""
    o = jnp.zeros_like(q, F32)  # zeros_like keeps q's varying manual axes
    return o, _per_query(o) - jnp.inf


def merge(a: tuple, b: tuple) -> tuple:
    """``(out, lse)`` of attending to the keys of ``a`` and of ``b`` together (exact)."""
    (oa, la), (ob, lb) = a, b
    m = jax.lax.stop_gradient(jnp.maximum(la, lb))  # the result does not depend on m
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(la - m), jnp.exp(lb - m)
    s = wa + wb
    seen = s > 0
    safe = jnp.where(seen, s, 1.0)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    o = (oa * _rows(wa / safe) + ob * _rows(wb / safe))
    return o, lse


def _per_query(x: jax.Array) -> jax.Array:
    """Zeros ``[C, B, KV, G, n]``, one per query of ``x[C, B, n, KV, G, Dh]``."""
    return jnp.moveaxis(jnp.zeros_like(x[..., 0], F32), 2, -1)


def _rows(x: jax.Array) -> jax.Array:
    """A per-query ``[C, B, KV, G, n]`` array broadcast against ``[C, B, n, KV, G, Dh]``."""
    return jnp.moveaxis(x, -1, 2)[..., None]


class Mode(NamedTuple):
    """The static options of a block: ``causal``; ``window`` (a query at place ``p`` sees keys
    at ``p - window + 1 .. p``, Hugging Face's ``sliding_window``); ``softcap`` (scores become
    ``softcap * tanh(scores / softcap)``, Gemma 2); ``scale`` (None: ``Dh ** -0.5``)."""

    causal: bool
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None


def attend(q, k, v, qpos, kpos, qseg, kseg, *, causal: bool, keep: Callable = lambda x: x,
           tile: int | None = None, window: int | None = None, softcap: float | None = None,
           scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of queries ``q`` over keys ``k, v`` (see the module docstring and
    :class:`Mode` for the options), differentiable (the backward is :func:`backward`)."""
    tq, tk = tile_size(q.shape[2], tile), tile_size(k.shape[2], tile)
    mode = Mode(causal, window, softcap, scale)
    return _attend(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg)


def forward(q, k, v, qpos, kpos, qseg, kseg, *, causal: bool, keep: Callable = lambda x: x,
            tile: int | None = None, window: int | None = None, softcap: float | None = None,
            scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`attend` without its custom gradient: for a caller with a backward of its own."""
    tq, tk = tile_size(q.shape[2], tile), tile_size(k.shape[2], tile)
    mode = Mode(causal, window, softcap, scale)
    return _forward(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg)


def backward(q, k, v, qpos, kpos, qseg, kseg, out, lse, dout, dlse=None, *, causal: bool,
             keep: Callable = lambda x: x, tile: int | None = None, window: int | None = None,
             softcap: float | None = None, scale: float | None = None) -> tuple:
    """``(dq, dk, dv)`` in float32 of one block, given the output ``out`` and log-sum-exp
    ``lse`` of the queries over *all* their keys (this block's and others'; the ring passes
    the merged ones) and their cotangents (``dlse`` ``None``: zero)."""
    tq, tk = tile_size(q.shape[2], tile), tile_size(k.shape[2], tile)
    dlse = jnp.zeros_like(lse) if dlse is None else dlse
    mode = Mode(causal, window, softcap, scale)
    return _grads(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg, out, lse, dout, dlse)


def _split(x: jax.Array, axis: int, t: int) -> jax.Array:
    """Axis ``axis`` of length ``n`` cut into ``n / t`` tiles, the tile index moved first."""
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // t, t, *shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _join(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of :func:`_split`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def _mask(mode, qpos, kpos, qseg, kseg):
    """``[C, B, 1, 1, tq, tk]``: which query may see which key."""
    mask = qseg[..., :, None] == kseg[..., None, :]
    ahead = qpos[:, None, :, None] - kpos[:, None, None, :]  # the query's place minus the key's
    if mode.causal:
        mask = mask & (ahead >= 0)
    if mode.window is not None:
        mask = mask & (ahead < mode.window)
    return mask[:, :, None, None]


def _scale(mode, d: int) -> float:
    return d ** -0.5 if mode.scale is None else mode.scale


def _scores(q, k):
    return jnp.einsum("cbqkgd,cbskd->cbkgqs", q, k.astype(F32))


def _capped(mode, s):
    """``(scores, tanh)``: the soft-capped scores of the scaled scores ``s`` and
    ``tanh(s / softcap)`` (None without a cap), which the backward's chain rule needs."""
    if mode.softcap is None:
        return s, None
    t = jnp.tanh(s / mode.softcap)
    return mode.softcap * t, t


def _key_tiles(k, v, kpos, kseg, tk):
    return _split(k, 2, tk), _split(v, 2, tk), _split(kpos, 1, tk), _split(kseg, 2, tk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attend(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg):
    return _forward(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg)


def _forward(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg):
    scale = _scale(mode, q.shape[-1])
    keys = _key_tiles(k, v, kpos, kseg, tk)

    def one_query_tile(_, xs):
        qt, qp, qs = xs
        qt = keep(qt.astype(F32) * scale)
        row = _per_query(qt)
        init = (row - jnp.inf, row, jnp.zeros_like(qt))

        def one_key_tile(acc, ys):
            kt, vt, kp, ks = ys
            m, s_, o = acc
            mask = _mask(mode, qp, kp, qs, ks)
            scores = _capped(mode, _scores(qt, keep(kt)))[0]
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(scores - safe[..., None]), 0.0)
            alpha = jnp.exp(m - safe)
            o = o * _rows(alpha) + jnp.einsum("cbkgqs,cbskd->cbqkgd", p, keep(vt).astype(F32))
            return (m_new, s_ * alpha + p.sum(-1), keep(o)), None

        m, s_, o = jax.lax.scan(one_key_tile, init, keys)[0]
        seen = s_ > 0
        safe = jnp.where(seen, s_, 1.0)
        return None, (keep(o / _rows(safe)), jnp.where(seen, m + jnp.log(safe), -jnp.inf))

    queries = (_split(q, 2, tq), _split(qpos, 1, tq), _split(qseg, 2, tq))
    o, lse = jax.lax.scan(one_query_tile, None, queries)[1]
    return keep(_join(o, 2)), keep(_join(lse, 4))


def _attend_fwd(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg):
    out = _forward(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg)
    return out, (q, k, v, qpos, kpos, qseg, kseg, *out)


def _attend_bwd(mode, keep, tq, tk, res, cotangents):
    q, k, v, qpos, kpos, qseg, kseg, out, lse = res
    dq, dk, dv = _grads(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg, out, lse,
                        *cotangents)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


def _grads(mode, keep, tq, tk, q, k, v, qpos, kpos, qseg, kseg, out, lse, dout, dlse):
    scale = _scale(mode, q.shape[-1])
    # D_i = dO_i . O_i - dlse_i: dL/ds_ij = P_ij (dP_ij - D_i), dP_ij = dO_i . V_j
    dout = dout.astype(F32)
    delta = jnp.moveaxis(jnp.sum(dout * out, -1), 2, -1) - dlse
    keys = _key_tiles(k, v, kpos, kseg, tk)

    def one_query_tile(dkv, xs):
        qt, qp, qs, dot, lt, dt = xs
        qt, dot = keep(qt.astype(F32) * scale), keep(dot)
        lt = jnp.where(jnp.isfinite(lt), lt, 0.0)

        def one_key_tile(dq, ys):
            kt, vt, kp, ks = ys
            kt, vt = keep(kt).astype(F32), keep(vt).astype(F32)
            mask = _mask(mode, qp, kp, qs, ks)
            capped, t = _capped(mode, _scores(qt, kt))
            p = jnp.where(mask, jnp.exp(capped - lt[..., None]), 0.0)
            dp = jnp.einsum("cbqkgd,cbskd->cbkgqs", dot, vt)
            ds = p * (dp - dt[..., None])  # by the capped scores
            if t is not None:  # d(c tanh(s / c)) / ds = 1 - tanh^2
                ds = ds * (1.0 - t * t)
            dq = dq + jnp.einsum("cbkgqs,cbskd->cbqkgd", ds, kt) * scale
            dk = jnp.einsum("cbkgqs,cbqkgd->cbskd", ds, qt)  # qt carries the scale
            dv = jnp.einsum("cbkgqs,cbqkgd->cbskd", p, dot)
            return keep(dq), (keep(dk), keep(dv))

        dq, (dk, dv) = jax.lax.scan(one_key_tile, jnp.zeros_like(qt), keys)
        dk_all, dv_all = dkv
        return (keep(dk_all + _join(dk, 2)), keep(dv_all + _join(dv, 2))), dq

    queries = (_split(q, 2, tq), _split(qpos, 1, tq), _split(qseg, 2, tq),
               _split(dout, 2, tq), _split(lse, 4, tq), _split(delta, 4, tq))
    zeros = (jnp.zeros_like(k, F32), jnp.zeros_like(v, F32))
    (dk, dv), dq = jax.lax.scan(one_query_tile, zeros, queries)
    return keep(_join(dq, 2)), keep(dk), keep(dv)


_attend.defvjp(_attend_fwd, _attend_bwd)

__all__ = ["TILE", "Mode", "attend", "backward", "empty", "forward", "merge", "tile_size"]
