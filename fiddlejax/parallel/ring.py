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
  transfer overlaps them). Each block is :func:`fiddlejax.parallel.flash.attend` (tiled,
  with its own backward: no n x n score matrix is ever held) and the blocks' softmaxes merge
  exactly by their log-sum-exp (:func:`~fiddlejax.parallel.flash.merge`), in float32. Only
  visible n x n blocks are computed: step 0
  three (the two diagonal blocks masked, the late queries over the early keys whole), every
  later step two (the late queries over the early keys whole, and either the early queries
  over the early keys, when the keys' shard precedes this one, or the late queries over the
  late keys, when it follows), so every shard computes ``3 + 2 (C - 1)`` blocks. With a
  sliding window a block whose keys lie a window or more before its queries on every shard
  is skipped (:func:`_in_window`; the K/V still travel every step).
- :func:`gathered_attention`: K/V all-gathered over ``context``, each shard's queries over the
  whole sequence in one tiled block (``4 C`` blocks' worth of scores, one collective).

Attention sinks (GPT-OSS: a logit per head in the softmax's denominator, in no block) join
once, after either kernel, from its log-sum-exp per query (:func:`with_sinks`).

Writing the ring with the partitioner's collectives rather than a nested ``shard_map`` keeps
it composable with the step's own manual axes (``data``, ``pipe``): jax 0.10 cannot
differentiate a ``shard_map`` nested in a manual region inside a layer scan (its hoisted
residuals are typed over the outer axes, which Shardy refuses).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fiddlejax.parallel import flash


def _pick(flag, a, b):
    return jax.tree.map(lambda x, y: jnp.where(flag.reshape(-1, *[1] * (x.ndim - 1)), x, y),
                        a, b)


def _grouped(q: jax.Array, kv: int) -> jax.Array:
    """``q[..., H, Dh]`` as ``[..., KV, H / KV, Dh]`` (grouped-query heads)."""
    return q.reshape(*q.shape[:-2], kv, q.shape[-2] // kv, q.shape[-1])


def _blocks(c: int, step: int, causal: bool, shard: jax.Array) -> list[tuple]:
    """The visible blocks of one ring step, as (query chunk, key chunk) pairs: 0 the early
    chunk, 1 the late one, or a per-shard flag (True: early)."""
    if not causal:
        return [(0, 0), (0, 1), (1, 0), (1, 1)]
    if step == 0:  # own chunks: the diagonal blocks masked, late over early whole
        return [(0, 0), (1, 0), (1, 1)]
    # keys of shard j = i - step: its early chunk j precedes our late chunk always;
    # j < i: it precedes our early chunk too (early queries, early keys);
    # j > i: its late chunk 2C-1-j precedes our late one (late queries, late keys).
    early = (shard - step) % c < shard
    return [(1, 0), (early, early)]


def _in_window(c: int, n: int, step: int, qi, ki, window: int | None) -> bool:
    """Whether some shard's block (``qi``, ``ki``) at ``step`` has a query within ``window`` of
    a key: a block whose keys all lie a window or more before its queries on every shard is
    fully masked, and skipped (statically: which chunks a shard holds is known)."""
    if window is None:
        return True

    def chunk(which, shard):  # the chunk each shard's early (0, flag True) or late half holds
        early = which == 0 if isinstance(which, int) else np.asarray(which)
        return np.where(early, shard, 2 * c - 1 - shard)

    i = np.arange(c)
    qc, kc = chunk(qi, i), chunk(ki, (i - step) % c)
    nearest = (qc - kc - 1) * n + 1  # the first query's place minus the last key's
    return bool((nearest < window).any())


def _sel(which, pair):
    return pair[which] if isinstance(which, int) else _pick(which, *pair)


def _add(pair: list, which, x) -> None:
    """Add ``x`` into the early or late entry of ``pair`` (per shard, for a flag)."""
    if isinstance(which, int):
        pair[which] = pair[which] + x
        return
    zero = jnp.zeros_like(x)
    pair[0], pair[1] = pair[0] + _pick(which, x, zero), pair[1] + _pick(which, zero, x)


def _halves(x: jax.Array) -> tuple:
    return x[:, :, 0], x[:, :, 1]


def _key_places(c: int, n: int, step: int, keep: Callable) -> tuple:
    """The places in the sequence of the keys each shard holds at ``step`` (shard i - step's)."""
    j = (jnp.arange(c) - step) % c
    return (keep(j[:, None] * n + jnp.arange(n)),
            keep((2 * c - 1 - j)[:, None] * n + jnp.arange(n)))


def _roll(tree, keep: Callable, shift: int = 1):
    """Each shard's arrays passed ``shift`` shards on (one collective-permute each)."""
    return jax.tree.map(lambda x: keep(jnp.roll(x, shift, axis=0)), tree)


def _steps(c: int, n: int, mode: flash.Mode) -> list[tuple[int, list]]:
    """The ring steps that have a visible block, each with its blocks: a step whose blocks a
    sliding window masks wholly on every shard is skipped with its transfer (the keys then
    travel the skipped shards' distance in one collective-permute)."""
    shard = np.arange(c)
    steps = [(step, [(qi, ki) for qi, ki in _blocks(c, step, mode.causal, shard)
                     if _in_window(c, n, step, qi, ki, mode.window)]) for step in range(c)]
    return [(step, blocks) for step, blocks in steps if blocks]


def ring_attention(q, k, v, seg, causal: bool, keep: Callable, *, window: int | None = None,
                   softcap: float | None = None, scale: float | None = None,
                   sinks: jax.Array | None = None) -> jax.Array:
    """Ring attention (see the module docstring); ``keep`` pins an array's leading axis to
    ``context``; ``window``, ``softcap`` and ``scale`` as :class:`flash.Mode` says; ``sinks[H]``
    as :func:`with_sinks`. Its backward (a ring of its own) keeps only the inputs, the output
    and the log-sum-exp per query: nothing per block or per step."""
    out, lse = _ring(flash.Mode(causal, window, softcap, scale), keep, q, k, v, seg)
    return out if sinks is None else with_sinks(out, lse, sinks)


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """``out [..., H, Dh]`` of a softmax over the keys alone (log-sum-exp ``lse [..., H]``) as
    if each head's sink logit ``sinks[H]`` had joined its denominator once (GPT-OSS):
    ``sum_j e^s_j v_j / (e^lse + e^sink) = out * sigmoid(lse - sink)``. Applied after the
    ring's last step (the sink is in no block), differentiable through ``lse``; a query that
    sees no key (``lse = -inf``) gets zeros, as the single-device softmax gives it."""
    keep = jax.nn.sigmoid(lse - sinks.astype(jnp.float32))[..., None]
    return (out.astype(jnp.float32) * keep).astype(out.dtype)


def _heads_last(lse: jax.Array) -> jax.Array:
    """A block's log-sum-exp ``[C, B, KV, G, n]`` as ``[C, B, n, KV * G]`` (q's head order)."""
    lse = jnp.moveaxis(lse, -1, 2)
    return lse.reshape(*lse.shape[:3], -1)


def _heads_grouped(x: jax.Array, kv: int) -> jax.Array:
    """The inverse of :func:`_heads_last`."""
    return jnp.moveaxis(x.reshape(*x.shape[:3], kv, -1), 2, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(mode, keep, q, k, v, seg):
    return _ring_fwd(mode, keep, q, k, v, seg)[0]


def _ring_fwd(mode, keep, q, k, v, seg):
    c, n = q.shape[0], q.shape[3]
    qs, ss = _halves(_grouped(q, k.shape[4])), _halves(seg)
    places = keep(global_index(c, n))
    ps = (places[:, :n], places[:, n:])
    accs = [flash.empty(qs[0]), flash.empty(qs[1])]
    held, steps = (k, v, seg), _steps(c, n, mode)
    for at, (step, blocks) in enumerate(steps):
        # the next step's keys, sent while this step's blocks compute
        nxt = _roll(held, keep, steps[at + 1][0] - step) if at + 1 < len(steps) else None
        ks, vs, ts = (_halves(x) for x in held)
        kps = _key_places(c, n, step, keep)
        for qi, ki in blocks:
            out = flash.forward(_sel(qi, qs), _sel(ki, ks), _sel(ki, vs), _sel(qi, ps),
                                _sel(ki, kps), _sel(qi, ss), _sel(ki, ts), keep=keep,
                                **mode._asdict())
            if isinstance(qi, int):
                accs[qi] = flash.merge(accs[qi], out)
            else:
                merged = flash.merge(_pick(qi, *accs), out)
                accs = [_pick(qi, merged, accs[0]), _pick(qi, accs[1], merged)]
        accs = [jax.tree.map(keep, a) for a in accs]
        held = nxt
    out = jnp.stack([accs[0][0], accs[1][0]], axis=2).reshape(q.shape).astype(q.dtype)
    lse = jnp.stack([_heads_last(accs[0][1]), _heads_last(accs[1][1])], axis=2)
    return (out, lse), (q, k, v, seg, *accs)


def _ring_bwd(mode, keep, res, cotangents):
    """The same blocks again; each shard's queries gather their gradient in place, while the
    gradients of the keys and values travel around the ring with them and arrive home after
    one more pass. The log-sum-exp's cotangent (sinks) joins each block's as flash's ``dlse``."""
    q, k, v, seg, acc0, acc1 = res
    dout, dlse = cotangents
    c, n = q.shape[0], q.shape[3]
    qs, ss = _halves(_grouped(q, k.shape[4])), _halves(seg)
    dos = _halves(_grouped(dout, k.shape[4]).astype(jnp.float32))
    dls = tuple(_heads_grouped(x, k.shape[4]) for x in _halves(dlse.astype(jnp.float32)))
    outs, lses = (acc0[0], acc1[0]), (acc0[1], acc1[1])
    places = keep(global_index(c, n))
    ps = (places[:, :n], places[:, n:])
    dq = [jnp.zeros_like(x, jnp.float32) for x in qs]
    held, steps = (k, v, seg), _steps(c, n, mode)
    dheld = (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
    for at, (step, blocks) in enumerate(steps):
        # to the next step's shard, or (after the last) home: c shards on in all
        shift = (steps[at + 1][0] if at + 1 < len(steps) else c) - step
        nxt = _roll(held, keep, shift) if at + 1 < len(steps) else None
        ks, vs, ts = (_halves(x) for x in held)
        kps = _key_places(c, n, step, keep)
        dk, dv = list(_halves(dheld[0])), list(_halves(dheld[1]))
        for qi, ki in blocks:
            g_q, g_k, g_v = flash.backward(
                _sel(qi, qs), _sel(ki, ks), _sel(ki, vs), _sel(qi, ps), _sel(ki, kps),
                _sel(qi, ss), _sel(ki, ts), _sel(qi, outs), _sel(qi, lses), _sel(qi, dos),
                _sel(qi, dls), keep=keep, **mode._asdict())
            _add(dq, qi, g_q)
            _add(dk, ki, g_k)
            _add(dv, ki, g_v)
        # the sums travel with the keys: after the last step one more pass brings them home
        dheld = _roll((jnp.stack(dk, axis=2), jnp.stack(dv, axis=2)), keep, shift)
        held = nxt
    dq = jnp.stack(dq, axis=2).reshape(q.shape).astype(q.dtype)
    return dq, dheld[0].astype(k.dtype), dheld[1].astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def global_index(c: int, n: int) -> jax.Array:
    """``[C, 2n]``: each shard's tokens' places in the whole sequence."""
    ar = jnp.arange(n)
    shard = jnp.arange(c)[:, None]
    return jnp.concatenate([shard * n + ar, (2 * c - 1 - shard) * n + ar], axis=1)


def gathered_attention(q, k, v, seg, causal: bool, keep: Callable, whole: Callable, *,
                       window: int | None = None, softcap: float | None = None,
                       scale: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """All-gathered K/V attention (see the module docstring); ``whole`` replicates an array
    over ``context`` (the all-gather); the options as for :func:`ring_attention`."""
    c, b, _, n = q.shape[:4]
    kw, vw, sw = (whole(x) for x in (k, v, seg))
    # [C, B, 2, n, ...] -> [B, C * 2n, ...] (shard-major, as global_index orders them), then
    # one copy per shard
    kw, vw, sw = (keep(jnp.broadcast_to(
        jnp.moveaxis(x, 1, 0).reshape(b, c * 2 * n, *x.shape[4:])[None],
        (c, b, c * 2 * n, *x.shape[4:]))) for x in (kw, vw, sw))
    places = global_index(c, n)
    kpos = keep(jnp.broadcast_to(places.reshape(1, -1), (c, c * 2 * n)))
    ql = _grouped(q.reshape(c, b, 2 * n, *q.shape[4:]), k.shape[4])
    out, lse = flash.attend(ql, kw, vw, keep(places), kpos, seg.reshape(c, b, 2 * n), sw,
                            causal=causal, keep=keep, window=window, softcap=softcap,
                            scale=scale)
    out = out.reshape(q.shape).astype(q.dtype)
    return out if sinks is None else with_sinks(out, _heads_last(lse).reshape(
        *q.shape[:-1]), sinks)
