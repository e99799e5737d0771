"""The ring family of all-reduce schedules, written as ``ppermute`` steps over chunk buffers.

- ring: reduce-scatter then all-gather around the ring, 2(p-1) ``ppermute``s of n/p;
- bidirectional ring: half the data each way round the ring, two ``ppermute``s per step;
- recursive halving-doubling (Rabenseifner), 2 log2 p steps; not a power of two: the first
  2*rem odd ranks fold into their even neighbours first and get the result back last;
- hierarchical over ``(outer, inner)``: ring reduce-scatter inside, ring all-reduce of the
  1/inner share across, ring all-gather inside.

Each takes the flattened input and returns the flattened (padded) sum; the public entry points
in :mod:`fiddlejax.collectives.algorithms` reshape it and type it invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fiddlejax.collectives import cost


def pad_to(v: jax.Array, multiple: int) -> jax.Array:
    """``v`` (1-D) zero-padded to a multiple of ``multiple`` elements."""
    pad = (-v.shape[0]) % multiple
    return jnp.pad(v, (0, pad)) if pad else v


def take(buf: jax.Array, i: jax.Array) -> jax.Array:
    """Row ``i`` (traced) of a chunk buffer."""
    return lax.dynamic_index_in_dim(buf, i, axis=0, keepdims=False)


def put(buf: jax.Array, row: jax.Array, i: jax.Array) -> jax.Array:
    """The chunk buffer with row ``i`` (traced) replaced."""
    return lax.dynamic_update_index_in_dim(buf, row, i, axis=0)


def _ring_perm(p: int, direction: int) -> list[tuple[int, int]]:
    return [(r, (r + direction) % p) for r in range(p)]


def ring_reduce_scatter(chunks, axes, p, idx, direction=1):
    """Device r ends with the sum of chunk r; p-1 steps, one chunk sent per step."""
    perm = _ring_perm(p, direction)
    acc = take(chunks, (idx - direction) % p)
    for s in range(p - 1):
        acc = lax.ppermute(acc, axes, perm) + take(chunks, (idx - direction * (s + 2)) % p)
    return acc


def ring_all_gather(own, axes, p, idx, direction=1):
    """Every device ends with all p chunks (device r contributed chunk r)."""
    perm = _ring_perm(p, direction)
    out = put(jnp.zeros((p,) + own.shape, own.dtype), own, idx)
    cur = own
    for s in range(p - 1):
        cur = lax.ppermute(cur, axes, perm)
        out = put(out, cur, (idx - direction * (s + 1)) % p)
    return out


def ring_allreduce(flat, axes, p, idx):
    """Reduce-scatter then all-gather around one ring."""
    chunks = pad_to(flat, p).reshape(p, -1)
    own = ring_reduce_scatter(chunks, axes, p, idx)
    return ring_all_gather(own, axes, p, idx).reshape(-1)


def bidirectional_ring_allreduce(flat, axes, p, idx):
    """Half the data clockwise, half counter-clockwise: both directions of every link busy."""
    halves = pad_to(flat, 2 * p).reshape(2, p, -1)
    own_cw = ring_reduce_scatter(halves[0], axes, p, idx, +1)
    own_ccw = ring_reduce_scatter(halves[1], axes, p, idx, -1)
    cw = ring_all_gather(own_cw, axes, p, idx, +1)
    ccw = ring_all_gather(own_ccw, axes, p, idx, -1)
    return jnp.concatenate([cw.reshape(-1), ccw.reshape(-1)])


def rhd_allreduce(flat, axes, p, idx):
    """Rabenseifner's recursive halving (reduce-scatter) then doubling (all-gather)."""
    p2, rem, real = cost.rhd_ranks(p)
    v = pad_to(flat, p2)
    if rem:  # fold the odd ranks among the first 2*rem into their even neighbours
        recv = lax.ppermute(v, axes, [(2 * i + 1, 2 * i) for i in range(rem)])
        v = jnp.where((idx < 2 * rem) & (idx % 2 == 0), v + recv, v)
    vrank = jnp.where(idx < 2 * rem, idx // 2, idx - rem)
    dists = [p2 >> (s + 1) for s in range(p2.bit_length() - 1)]
    seg = v.reshape(p2, -1)
    for d in dists:  # recursive halving: keep the half holding my chunk, send the other
        upper = (vrank & d) != 0
        lo, hi = seg[:d], seg[d:]
        keep, send = jnp.where(upper, hi, lo), jnp.where(upper, lo, hi)
        seg = keep + lax.ppermute(send, axes, [(real[u], real[u ^ d]) for u in range(p2)])
    for d in reversed(dists):  # recursive doubling: swap halves back
        upper = (vrank & d) != 0
        recv = lax.ppermute(seg, axes, [(real[u], real[u ^ d]) for u in range(p2)])
        seg = jnp.where(upper, jnp.concatenate([recv, seg]), jnp.concatenate([seg, recv]))
    out = seg.reshape(-1)
    if rem:  # hand the result back to the folded ranks
        recv = lax.ppermute(out, axes, [(2 * i, 2 * i + 1) for i in range(rem)])
        out = jnp.where((idx < 2 * rem) & (idx % 2 == 1), recv, out)
    return out


def hierarchical_allreduce(flat, axes):
    """Rings inside each ``inner`` group around a ring across ``outer`` on 1/inner of the data."""
    outer, inner = axes
    po, pi = lax.axis_size(outer), lax.axis_size(inner)
    io, ii = lax.axis_index(outer), lax.axis_index(inner)
    chunks = pad_to(flat, pi * po).reshape(pi, -1)
    own = ring_reduce_scatter(chunks, inner, pi, ii)  # my 1/inner share, summed inside
    if po > 1:
        own = ring_allreduce(own, outer, po, io)  # only the share crosses the outer axis
    return ring_all_gather(own, inner, pi, ii).reshape(-1)
