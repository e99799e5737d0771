"""Tree schedules executed with ``ppermute``: binomial-tree and packed-tree (Blink) all-reduce,
and the binomial-tree broadcast.

The trees come from :mod:`fiddlejax.collectives.trees` (pure Python: which device sends which
chunk to whom at which step); here those steps run on device, pipelined in ``chunks`` pieces:
reduce up every tree (edges reversed), then broadcast down, tree i carrying its weight's share
of the data. Runs of identical steps become one ``fori_loop``, so the HLO does not grow with
the number of chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fiddlejax.collectives import trees as tr
from fiddlejax.collectives.invariant import AxisName, axes_of, make_varying, mark_invariant
from fiddlejax.collectives.ring import pad_to, put, take


def _color(msgs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Split messages into ppermute groups: each device sends and receives at most once each."""
    groups: list[list[tuple[int, int]]] = []
    for s, d in msgs:
        for g in groups:
            if all(s != a and d != b for a, b in g):
                g.append((s, d))
                break
        else:
            groups.append([(s, d)])
    return groups


def run_phase(
    bufs: list[jax.Array],
    steps: list[list[tr.Transfer]],
    levels: list[list[int]],
    axes: tuple,
    idx: jax.Array,
    combine: Callable[[jax.Array, jax.Array], jax.Array],
) -> list[jax.Array]:
    """Execute pipelined tree steps. A message of step t carries chunk t - level[src]; runs of
    identical steps (the pipeline's steady state) become one fori_loop, so the HLO does not grow
    with the number of chunks."""
    k_of = [b.shape[0] for b in bufs]
    patterns = [tuple(sorted({(m.tree, m.src, m.dst) for m in step})) for step in steps]
    runs: list[tuple[int, int]] = []
    for t, pat in enumerate(patterns):
        if runs and patterns[runs[-1][0]] == pat:
            runs[-1] = (runs[-1][0], t + 1)
        else:
            runs.append((t, t + 1))

    def step_fn(t, bufs, pattern):
        bufs = list(bufs)
        for ti in sorted({m[0] for m in pattern}):
            level = jnp.asarray(np.array(levels[ti], dtype=np.int32))
            k = k_of[ti]
            for group in _color([(s, d) for tj, s, d in pattern if tj == ti]):
                src_level = np.full(len(levels[ti]), -1, dtype=np.int32)
                for s, d in group:
                    src_level[d] = levels[ti][s]
                src_level_j = jnp.asarray(src_level)[idx]
                send = take(bufs[ti], jnp.clip(t - level[idx], 0, k - 1))
                recv = lax.ppermute(send, axes, group)
                j = jnp.clip(t - src_level_j, 0, k - 1)
                row = take(bufs[ti], j)
                row = jnp.where(src_level_j >= 0, combine(row, recv), row)
                bufs[ti] = put(bufs[ti], row, j)
        return bufs

    for start, stop in runs:
        pattern = patterns[start]
        if not pattern:
            continue
        if stop - start == 1:
            bufs = step_fn(start, bufs, pattern)
        else:
            body = functools.partial(lambda pat, t, b: tuple(step_fn(t, b, pat)), pattern)
            bufs = list(lax.fori_loop(start, stop, body, tuple(bufs)))
    return bufs


def tree_allreduce(flat, axes, idx, trees: list[tr.Parents], weights, chunks: int):
    """Reduce up every tree (edges reversed), then broadcast down; tree i carries its weight's
    share of the data, pipelined in `chunks` pieces."""
    n = flat.shape[0]
    sizes = tr.split_sizes(n, weights)
    keep = [i for i, s in enumerate(sizes) if s > 0]
    trees = [trees[i] for i in keep]
    sizes = [sizes[i] for i in keep]
    bufs, offset = [], 0
    for s in sizes:
        k = max(1, min(chunks, s))  # a share smaller than `chunks` elements uses fewer chunks
        bufs.append(pad_to(flat[offset : offset + s], k).reshape(k, -1))
        offset += s
    for k in sorted({b.shape[0] for b in bufs}):
        members = [i for i, b in enumerate(bufs) if b.shape[0] == k]
        sub = [trees[i] for i in members]
        sub_bufs = [bufs[i] for i in members]
        sub_bufs = run_phase(
            sub_bufs, tr.reduce_steps(sub, k), [tr.heights(t) for t in sub], axes, idx,
            lambda row, recv: row + recv,
        )  # fmt: skip
        sub_bufs = run_phase(
            sub_bufs, tr.broadcast_steps(sub, k), [tr.depths(t) for t in sub], axes, idx,
            lambda row, recv: recv,
        )  # fmt: skip
        for i, b in zip(members, sub_bufs, strict=True):
            bufs[i] = b
    return jnp.concatenate([b.reshape(-1)[:s] for b, s in zip(bufs, sizes, strict=True)])


def broadcast(x: jax.Array, axis_name: AxisName, root: int = 0, chunks: int = 1) -> jax.Array:
    """Every device gets `root`'s x (binomial tree of ppermutes); typed invariant over the axes."""
    axes = axes_of(axis_name)
    p = lax.axis_size(axes)
    if not 0 <= root < p:
        raise ValueError(f"root={root} must be in [0, {p}) for axis {axis_name!r}")
    if p == 1:
        return x
    x = make_varying(x, axes)
    flat = x.reshape(-1)
    k = max(1, min(chunks, flat.shape[0]))
    buf = pad_to(flat, k).reshape(k, -1)
    tree = tr.binomial_tree(p, root)
    (buf,) = run_phase(
        [buf], tr.broadcast_steps([tree], k), [tr.depths(tree)], axes, lax.axis_index(axes),
        lambda row, recv: recv,
    )  # fmt: skip
    return mark_invariant(buf.reshape(-1)[: x.size].reshape(x.shape), axes)
