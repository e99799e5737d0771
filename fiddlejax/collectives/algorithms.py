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

The ring family lives in `ring.py`, the tree schedules in `tree_allreduce.py`, the typing that
makes a schedule's result invariant like psum's in `invariant.py`; this module checks the
arguments, dispatches, gives the schedules psum's gradient, and buckets pytrees.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fiddlejax.collectives import cost
from fiddlejax.collectives import trees as tr
from fiddlejax.collectives.invariant import AxisName, mark_invariant
from fiddlejax.collectives.invariant import axes_of as _axes  # compression.py imports these two
from fiddlejax.collectives.invariant import make_varying as _make_varying
from fiddlejax.collectives.ring import (
    bidirectional_ring_allreduce,
    hierarchical_allreduce,
    pad_to,
    rhd_allreduce,
    ring_all_gather,
    ring_allreduce,
    ring_reduce_scatter,
)
from fiddlejax.collectives.topology import Topology, switch
from fiddlejax.collectives.tree_allreduce import broadcast, tree_allreduce

ALGORITHMS = cost.ALGORITHMS + ("auto",)

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
        out = ring_allreduce(flat, axes, p, idx)
    elif algorithm == "bidirectional-ring":
        out = bidirectional_ring_allreduce(flat, axes, p, idx)
    elif algorithm == "recursive-halving-doubling":
        out = rhd_allreduce(flat, axes, p, idx)
    elif algorithm == "hierarchical":
        out = hierarchical_allreduce(flat, axes)
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
        out = tree_allreduce(flat, axes, idx, tree_list, weights, chunks)
    return mark_invariant(out[:n].reshape(shape), axes)


def reduce_scatter(x: jax.Array, axis_name: AxisName, algorithm: str = "ring") -> jax.Array:
    """This device's 1/p share of the sum of flattened x (zero-padded to a multiple of p):
    == psum_scatter(pad(x.ravel()), tiled=True). Algorithms "ring" or "xla"."""
    axes = _axes(axis_name)
    p = lax.axis_size(axes)
    flat = pad_to(_make_varying(x, axes).reshape(-1), p)
    if algorithm == "xla":
        return lax.psum_scatter(flat, axes, scatter_dimension=0, tiled=True)
    if algorithm != "ring":
        raise ValueError(f"reduce_scatter algorithm {algorithm!r} unknown; valid: ['ring', 'xla']")
    if p == 1:
        return flat
    return ring_reduce_scatter(flat.reshape(p, -1), axes, p, lax.axis_index(axes))


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
    out = ring_all_gather(flat, axes, p, lax.axis_index(axes))
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
