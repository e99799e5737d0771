"""All-reduce schedules built from JAX collectives, so XLA lowers them on any backend.

Use inside `jax.shard_map` (manual over the reduced axes):

    y = fj.collectives.allreduce(x, "data", algorithm="ring")   # == jax.lax.psum(x, "data")

Every algorithm returns what `jax.lax.psum` returns: same shape, dtype and value (integers bit for
bit; floats up to summation order, |y - psum| <= (p - 1) * eps(dtype) * sum_i |x_i|), the same on
every device, and typed invariant over the reduced axes (so an out_spec may omit them).

How each one moves data (p devices, n elements; details in `cost.py`, which replays the same
schedules on a topology):
- "xla": `psum`; XLA/NCCL choose.
- "ring": reduce-scatter then all-gather around the ring, 2(p-1) `ppermute`s of n/p.
- "bidirectional-ring": half the data each way round the ring, two `ppermute`s per step.
- "recursive-halving-doubling": Rabenseifner, 2 log2 p steps. Not a power of two: the first
  2*rem odd ranks fold into their even neighbours first and get the result back last.
- "tree": binomial tree reduce to device 0, then broadcast, pipelined in `chunks`.
- "hierarchical": axis_name=(outer, inner): ring reduce-scatter inside, ring all-reduce of the
  1/inner share across, ring all-gather inside.
- "packed-trees": Blink: spanning trees packed over `topology` (trees.py), data split by weight.
- "auto": the fastest by `cost.predict` on `topology` (a uniform switch when None).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from fiddlejax.collectives import cost
from fiddlejax.collectives import trees as tr
from fiddlejax.collectives.topology import Topology, switch

ALGORITHMS = cost.ALGORITHMS + ("auto",)
AxisName = Any  # str or tuple of str

# ----------------------------------------------------------------------------- vma typing
# psum is typed Varying -> Invariant; a schedule of ppermutes stays Varying even though every
# device ends with the same bits. This no-op primitive records that fact (the same role as
# jax's own pvary in the other direction). Only values that really are equal on every device
# of the axes go through it: the results of complete all-reduce / broadcast schedules.

_invariant_p = Primitive("fj_assert_invariant")
_invariant_p.def_impl(lambda x, *, axes: x)


def _invariant_abstract_eval(aval, *, axes):
    mat = aval.mat
    return aval.update(
        manual_axis_type=mat.update(varying=frozenset(a for a in mat.varying if a not in axes))
    )


_invariant_p.def_abstract_eval(_invariant_abstract_eval)
mlir.register_lowering(_invariant_p, lambda ctx, x, *, axes: [x])
batching.primitive_batchers[_invariant_p] = lambda args, dims, *, axes: (
    _invariant_p.bind(args[0], axes=axes),
    dims[0],
)


def _axes(axis_name: AxisName) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _varying(x: jax.Array) -> frozenset:
    return jax.typeof(x).mat.varying


def mark_invariant(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Type `x` as invariant over `axis_name` (no data moves). Only for values that are equal on
    every device of the axes."""
    axes = tuple(a for a in _axes(axis_name) if a in _varying(x))
    return _invariant_p.bind(x, axes=axes) if axes else x


def _make_varying(x: jax.Array, axes: tuple) -> jax.Array:
    missing = tuple(a for a in axes if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x


# ----------------------------------------------------------------------------- public API


def allreduce(
    x: jax.Array,
    axis_name: AxisName,
    algorithm: str = "xla",
    *,
    topology: Topology | None = None,
    chunks: int | None = None,
) -> jax.Array:
    """Sum `x` over the mesh axis (or axes) `axis_name` with the chosen schedule; == psum.

    `topology` (one device per axis index) is required by "packed-trees" and guides "auto";
    `chunks` fixes the pipelining depth of "tree" / "packed-trees" (default: cost model)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; valid: {list(ALGORITHMS)}")
    axes = _axes(axis_name)
    if algorithm == "hierarchical" and len(axes) != 2:
        raise ValueError(
            f"algorithm='hierarchical' needs axis_name=(outer, inner), a pair of mesh axes; got "
            f"{axis_name!r}. Use e.g. axis_name=('node', 'gpu') over a 2-D mesh."
        )
    if algorithm == "xla":
        return lax.psum(x, axis_name)
    p = lax.axis_size(axes)
    if topology is not None and topology.size != p:
        raise ValueError(
            f"topology {topology.name!r} has {topology.size} devices but axis {axis_name!r} has "
            f"{p}; pass one device per axis index (topology.subset(...) picks some)"
        )
    if algorithm == "packed-trees" and topology is None:
        raise ValueError(
            "algorithm='packed-trees' needs topology= (e.g. fj.collectives.dgx1_v100()), "
            "the link graph the trees are packed over"
        )
    if p == 1:
        return lax.psum(x, axis_name)
    nbytes = x.size * x.dtype.itemsize
    inner = lax.axis_size(axes[1]) if len(axes) == 2 else None
    if algorithm == "auto":
        algorithm = choose_algorithm(p, nbytes, topology=topology, inner=inner)
        if algorithm == "xla":
            return lax.psum(x, axis_name)
    x = _make_varying(x, axes)
    return _allreduce_vjp(x, axes, algorithm, topology, chunks)


def choose_algorithm(
    p: int, nbytes: int, *, topology: Topology | None = None, inner: int | None = None
) -> str:
    """What "auto" runs: the lowest `cost.predict` on `topology` (default: a uniform switch)."""
    topo = topology if topology is not None else switch(p)
    cands = ["ring", "bidirectional-ring", "recursive-halving-doubling", "tree"]
    if inner is not None and 1 < inner < p:
        cands.append("hierarchical")
    if topology is not None:
        cands.append("packed-trees")
    return cost.choose(topo, nbytes, inner=inner, candidates=cands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _allreduce_vjp(x, axes, algorithm, topology, chunks):
    return _allreduce_impl(x, axes, algorithm, topology, chunks)


def _allreduce_fwd(x, axes, algorithm, topology, chunks):
    return _allreduce_impl(x, axes, algorithm, topology, chunks), None


def _allreduce_bwd(axes, algorithm, topology, chunks, _, ct):
    # Same transpose as psum: every device's input gets the whole output cotangent.
    return (_make_varying(ct, axes),)


_allreduce_vjp.defvjp(_allreduce_fwd, _allreduce_bwd)


def _allreduce_impl(x, axes, algorithm, topology, chunks):
    shape, n = x.shape, x.size
    flat = x.reshape(-1)
    p = lax.axis_size(axes)
    idx = lax.axis_index(axes)
    if algorithm == "ring":
        out = _ring_allreduce(flat, axes, p, idx)
    elif algorithm == "bidirectional-ring":
        out = _bidirectional_ring_allreduce(flat, axes, p, idx)
    elif algorithm == "recursive-halving-doubling":
        out = _rhd_allreduce(flat, axes, p, idx)
    elif algorithm == "hierarchical":
        out = _hierarchical_allreduce(flat, axes)
    else:
        topo = topology if topology is not None else switch(p)
        if algorithm == "tree":
            tree_list, weights = [tr.binomial_tree(p)], [1.0]
        else:
            pk = tr.pack_trees(topo)
            tree_list, weights = list(pk.trees), list(pk.weights)
        if chunks is None:
            nbytes = n * x.dtype.itemsize
            chunks = cost.best_chunks(topo, tree_list, weights, nbytes)
        out = _tree_allreduce(flat, axes, idx, tree_list, weights, chunks)
    return mark_invariant(out[:n].reshape(shape), axes)


# ----------------------------------------------------------------------------- helpers


def _pad_to(v: jax.Array, multiple: int) -> jax.Array:
    pad = (-v.shape[0]) % multiple
    return jnp.pad(v, (0, pad)) if pad else v


def _take(buf: jax.Array, i: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(buf, i, axis=0, keepdims=False)


def _put(buf: jax.Array, row: jax.Array, i: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(buf, row, i, axis=0)


def _ring_perm(p: int, direction: int) -> list[tuple[int, int]]:
    return [(r, (r + direction) % p) for r in range(p)]


def _ring_reduce_scatter(chunks, axes, p, idx, direction=1):
    """Device r ends with the sum of chunk r; p-1 steps, one chunk sent per step."""
    perm = _ring_perm(p, direction)
    acc = _take(chunks, (idx - direction) % p)
    for s in range(p - 1):
        acc = lax.ppermute(acc, axes, perm) + _take(chunks, (idx - direction * (s + 2)) % p)
    return acc


def _ring_all_gather(own, axes, p, idx, direction=1):
    """Every device ends with all p chunks (device r contributed chunk r)."""
    perm = _ring_perm(p, direction)
    out = _put(jnp.zeros((p,) + own.shape, own.dtype), own, idx)
    cur = own
    for s in range(p - 1):
        cur = lax.ppermute(cur, axes, perm)
        out = _put(out, cur, (idx - direction * (s + 1)) % p)
    return out


def _ring_allreduce(flat, axes, p, idx):
    chunks = _pad_to(flat, p).reshape(p, -1)
    own = _ring_reduce_scatter(chunks, axes, p, idx)
    return _ring_all_gather(own, axes, p, idx).reshape(-1)


def _bidirectional_ring_allreduce(flat, axes, p, idx):
    halves = _pad_to(flat, 2 * p).reshape(2, p, -1)
    own_cw = _ring_reduce_scatter(halves[0], axes, p, idx, +1)
    own_ccw = _ring_reduce_scatter(halves[1], axes, p, idx, -1)
    cw = _ring_all_gather(own_cw, axes, p, idx, +1)
    ccw = _ring_all_gather(own_ccw, axes, p, idx, -1)
    return jnp.concatenate([cw.reshape(-1), ccw.reshape(-1)])


def _rhd_allreduce(flat, axes, p, idx):
    p2, rem, real = cost.rhd_ranks(p)
    v = _pad_to(flat, p2)
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


def _hierarchical_allreduce(flat, axes):
    outer, inner = axes
    po, pi = lax.axis_size(outer), lax.axis_size(inner)
    io, ii = lax.axis_index(outer), lax.axis_index(inner)
    chunks = _pad_to(flat, pi * po).reshape(pi, -1)
    own = _ring_reduce_scatter(chunks, inner, pi, ii)  # my 1/inner share, summed inside
    if po > 1:
        own = _ring_allreduce(own, outer, po, io)  # only the share crosses the outer axis
    return _ring_all_gather(own, inner, pi, ii).reshape(-1)


# ----------------------------------------------------------------------------- tree executor


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


def _run_phase(
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
                send = _take(bufs[ti], jnp.clip(t - level[idx], 0, k - 1))
                recv = lax.ppermute(send, axes, group)
                j = jnp.clip(t - src_level_j, 0, k - 1)
                row = _take(bufs[ti], j)
                row = jnp.where(src_level_j >= 0, combine(row, recv), row)
                bufs[ti] = _put(bufs[ti], row, j)
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


def _tree_allreduce(flat, axes, idx, trees: list[tr.Parents], weights, chunks: int):
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
        bufs.append(_pad_to(flat[offset : offset + s], k).reshape(k, -1))
        offset += s
    for k in sorted({b.shape[0] for b in bufs}):
        members = [i for i, b in enumerate(bufs) if b.shape[0] == k]
        sub = [trees[i] for i in members]
        sub_bufs = [bufs[i] for i in members]
        sub_bufs = _run_phase(
            sub_bufs, tr.reduce_steps(sub, k), [tr.heights(t) for t in sub], axes, idx,
            lambda row, recv: row + recv,
        )  # fmt: skip
        sub_bufs = _run_phase(
            sub_bufs, tr.broadcast_steps(sub, k), [tr.depths(t) for t in sub], axes, idx,
            lambda row, recv: recv,
        )  # fmt: skip
        for i, b in zip(members, sub_bufs, strict=True):
            bufs[i] = b
    return jnp.concatenate([b.reshape(-1)[:s] for b, s in zip(bufs, sizes, strict=True)])


def broadcast(x: jax.Array, axis_name: AxisName, root: int = 0, chunks: int = 1) -> jax.Array:
    """Every device gets `root`'s x (binomial tree of ppermutes); typed invariant over the axes."""
    axes = _axes(axis_name)
    p = lax.axis_size(axes)
    if not 0 <= root < p:
        raise ValueError(f"root={root} must be in [0, {p}) for axis {axis_name!r}")
    if p == 1:
        return x
    x = _make_varying(x, axes)
    flat = x.reshape(-1)
    k = max(1, min(chunks, flat.shape[0]))
    buf = _pad_to(flat, k).reshape(k, -1)
    tree = tr.binomial_tree(p, root)
    (buf,) = _run_phase(
        [buf], tr.broadcast_steps([tree], k), [tr.depths(tree)], axes, lax.axis_index(axes),
        lambda row, recv: recv,
    )  # fmt: skip
    return mark_invariant(buf.reshape(-1)[: x.size].reshape(x.shape), axes)


def reduce_scatter(x: jax.Array, axis_name: AxisName, algorithm: str = "ring") -> jax.Array:
    """This device's 1/p share of the sum of flattened x (zero-padded to a multiple of p):
    == psum_scatter(pad(x.ravel()), tiled=True). Algorithms "ring" or "xla"."""
    axes = _axes(axis_name)
    p = lax.axis_size(axes)
    flat = _pad_to(_make_varying(x, axes).reshape(-1), p)
    if algorithm == "xla":
        return lax.psum_scatter(flat, axes, scatter_dimension=0, tiled=True)
    if algorithm != "ring":
        raise ValueError(f"reduce_scatter algorithm {algorithm!r} unknown; valid: ['ring', 'xla']")
    if p == 1:
        return flat
    return _ring_reduce_scatter(flat.reshape(p, -1), axes, p, lax.axis_index(axes))


def all_gather(x: jax.Array, axis_name: AxisName, algorithm: str = "ring") -> jax.Array:
    """Stack every device's x along a new leading axis: == lax.all_gather(x, axes,
    to='invarying'). Algorithms "ring" or "xla"."""
    axes = _axes(axis_name)
    if algorithm == "xla":
        return lax.all_gather(x, axes, to="invarying")
    if algorithm != "ring":
        raise ValueError(f"all_gather algorithm {algorithm!r} unknown; valid: ['ring', 'xla']")
    p = lax.axis_size(axes)
    x = _make_varying(x, axes)
    if p == 1:
        return mark_invariant(x[None], axes)
    flat = x.reshape(-1)
    out = _ring_all_gather(flat, axes, p, lax.axis_index(axes))
    return mark_invariant(out.reshape((p,) + x.shape), axes)


# ----------------------------------------------------------------------------- pytrees

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket size


def allreduce_tree(
    tree: Any,
    axis_name: AxisName,
    algorithm: str = "xla",
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    topology: Topology | None = None,
    chunks: int | None = None,
) -> Any:
    """All-reduce every leaf of a pytree (e.g. gradients), few large messages instead of many
    small ones: leaves of one dtype are flattened and concatenated, in order, into buckets of at
    most `bucket_bytes` (a larger leaf is a bucket of its own); one `allreduce` per bucket.
    `bucket_bytes=0` reduces leaf by leaf, keeping shapes (and any auto-sharded layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    if bucket_bytes <= 0:
        out = [allreduce(v, axis_name, algorithm, topology=topology, chunks=chunks)
               for v in leaves]  # fmt: skip
        return jax.tree.unflatten(treedef, out)
    out: list[jax.Array | None] = [None] * len(leaves)
    for bucket in _buckets(leaves, bucket_bytes):
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in bucket])
        summed = allreduce(flat, axis_name, algorithm, topology=topology, chunks=chunks)
        offset = 0
        for i in bucket:
            size = leaves[i].size
            out[i] = summed[offset : offset + size].reshape(leaves[i].shape)
            offset += size
    return jax.tree.unflatten(treedef, out)


def _buckets(leaves: Sequence[jax.Array], bucket_bytes: int) -> list[list[int]]:
    """Leaf indices grouped by dtype, then greedily into buckets of <= bucket_bytes."""
    by_dtype: dict[Any, list[int]] = {}
    for i, v in enumerate(leaves):
        by_dtype.setdefault(jnp.dtype(v.dtype), []).append(i)
    buckets = []
    for idxs in by_dtype.values():
        cur, cur_bytes = [], 0
        for i in idxs:
            nb = leaves[i].size * leaves[i].dtype.itemsize
            if cur and cur_bytes + nb > bucket_bytes:
                buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            cur_bytes += nb
        if cur:
            buckets.append(cur)
    return buckets


def bucket_plan(tree: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[int]:
    """Bytes of each bucket `allreduce_tree` would send for `tree` (for reports)."""
    leaves = jax.tree.leaves(tree)
    return [
        sum(leaves[i].size * jnp.dtype(leaves[i].dtype).itemsize for i in b)
        for b in _buckets(leaves, bucket_bytes)
    ]


__all__ = [
    "ALGORITHMS",
    "all_gather",
    "allreduce",
    "allreduce_tree",
    "broadcast",
    "bucket_plan",
    "choose_algorithm",
    "mark_invariant",
    "reduce_scatter",
]
