"""Alpha-beta cost model of every all-reduce algorithm on a topology, and HLO byte counting.

The model replays each algorithm's actual communication schedule (the same rounds of
point-to-point messages that `algorithms.py` lowers to `ppermute`) on the topology's routes:

    time(step) = max latency of the step's routes            (alpha)
               + max over links of bytes crossing it / bandwidth   (beta, with sharing)

and an algorithm's time is the sum over its steps. Messages of one step run concurrently and
share every link their routes have in common, which is how a PCIe hop, a shared NIC or a busy
root shows up. The steps are lockstep (a step ends when its slowest message lands), as in NCCL's
ring and tree kernels. `"auto"` picks the fastest prediction, which is also how NCCL chooses
between ring and tree (its tuning model predicts latency + size / bus bandwidth per algorithm).

`"xla"` (psum) is modelled as NCCL would run it on GPUs: the faster of a ring in device order and
a pipelined binomial tree. NCCL's search for NVLink ring orders and its multiple channels are not
modelled.

`hlo_collectives` / `bytes_sent_per_device` count the collectives that XLA actually compiled.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fiddlejax.collectives import trees as tr
from fiddlejax.collectives.topology import Topology, hierarchy_shape

ALGORITHMS = (
    "xla",
    "ring",
    "bidirectional-ring",
    "recursive-halving-doubling",
    "tree",
    "hierarchical",
    "packed-trees",
)
MAX_CHUNKS = 256  # pipelining depth cap (the steady state is one loop, so HLO size is flat)

Message = tuple[int, int, float]  # (src device, dst device, bytes)


# ----------------------------------------------------------------------------- schedules


def ring_schedule(p: int, nbytes: float) -> list[list[Message]]:
    """Reduce-scatter then all-gather around the ring 0 -> 1 -> ... -> p-1 -> 0."""
    step = [(r, (r + 1) % p, nbytes / p) for r in range(p)]
    return [step] * (2 * (p - 1))


def bidirectional_ring_schedule(p: int, nbytes: float) -> list[list[Message]]:
    """Half the data around each direction of the ring, both at once."""
    step = [(r, (r + 1) % p, nbytes / (2 * p)) for r in range(p)]
    step += [(r, (r - 1) % p, nbytes / (2 * p)) for r in range(p)]
    return [step] * (2 * (p - 1))


def rhd_ranks(p: int) -> tuple[int, int, list[int]]:
    """(p2, rem, real rank of each virtual rank) for recursive halving-doubling.

    p2 is the largest power of two <= p; the first 2*rem ranks pair up (odd into even) so that
    p2 ranks remain."""
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
    return p2, rem, [2 * v if v < rem else v + rem for v in range(p2)]


def rhd_schedule(p: int, nbytes: float) -> list[list[Message]]:
    """Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive doubling.

    Non-powers of two: the odd ranks among the first 2*rem send everything to their even
    neighbour first and get the result back last (two extra full-size steps)."""
    p2, rem, real = rhd_ranks(p)
    steps: list[list[Message]] = []
    if rem:
        steps.append([(2 * i + 1, 2 * i, nbytes) for i in range(rem)])
    dists = [p2 >> (s + 1) for s in range(p2.bit_length() - 1)]
    for d in dists:
        steps.append([(real[v], real[v ^ d], nbytes * d / p2) for v in range(p2)])
    for d in reversed(dists):
        steps.append([(real[v], real[v ^ d], nbytes * d / p2) for v in range(p2)])
    if rem:
        steps.append([(2 * i, 2 * i + 1, nbytes) for i in range(rem)])
    return steps


def hierarchical_schedule(outer: int, inner: int, nbytes: float) -> list[list[Message]]:
    """Ring reduce-scatter inside each group, ring all-reduce of the 1/inner share across groups,
    ring all-gather inside. Device index = o * inner + i."""
    inside = [(o * inner + i, o * inner + (i + 1) % inner, nbytes / inner)
              for o in range(outer) for i in range(inner)]  # fmt: skip
    across = [(o * inner + i, ((o + 1) % outer) * inner + i, nbytes / (inner * outer))
              for o in range(outer) for i in range(inner)]  # fmt: skip
    return [inside] * (inner - 1) + [across] * (2 * (outer - 1)) + [inside] * (inner - 1)


def tree_schedule(
    trees: Sequence[tr.Parents], weights: Sequence[float], chunks: int, nbytes: float
) -> list[list[Message]]:
    """Pipelined reduce up every tree, then pipelined broadcast down (see `trees.py`)."""
    size = [nbytes * w / chunks for w in weights]
    steps = tr.reduce_steps(trees, chunks) + tr.broadcast_steps(trees, chunks)
    return [[(m.src, m.dst, size[m.tree]) for m in step] for step in steps]


# ----------------------------------------------------------------------------- simulation


def _route_matrix(topo: Topology) -> tuple[np.ndarray, np.ndarray]:
    p = topo.size
    use = np.zeros((p, p, len(topo.links)))
    lat = np.zeros((p, p))
    for (u, v), path in topo.routes.items():
        for k in path:
            use[u, v, k] += 1
        lat[u, v] = topo.route_latency(u, v)
    return use, lat


_ROUTES: dict[Topology, tuple[np.ndarray, np.ndarray]] = {}


def schedule_time(topo: Topology, steps: Sequence[Sequence[Message]]) -> float:
    """Seconds to run `steps` on `topo`: per step, max route latency + max link load/bandwidth."""
    if topo not in _ROUTES:
        _ROUTES[topo] = _route_matrix(topo)
    use, lat = _ROUTES[topo]
    inv_bw = 1.0 / np.array([lk.bandwidth for lk in topo.links])
    total = 0.0
    cache: dict[tuple, float] = {}
    for step in steps:
        key = tuple(step)
        if key not in cache:
            if not step:
                cache[key] = 0.0
            else:
                src, dst, size = (np.array(c) for c in zip(*step, strict=True))
                load = (size[:, None] * use[src, dst]).sum(axis=0)
                cache[key] = float(lat[src, dst].max() + (load * inv_bw).max())
        total += cache[key]
    return total


def _tree_time(topo: Topology, trees, weights, nbytes: float, chunks: int) -> float:
    """`schedule_time` of `tree_schedule`, without listing every chunk: the set of busy edges
    only changes where some node's level (height or depth) + 0 or + chunks is crossed."""
    size = [nbytes * w / chunks for w in weights]
    total = 0.0
    for levels, upward in (([tr.heights(t) for t in trees], True),
                           ([tr.depths(t) for t in trees], False)):  # fmt: skip
        edges = [(ti, v, u, lv[v] if upward else lv[u])
                 for ti, (t, lv) in enumerate(zip(trees, levels, strict=True))
                 for v, u in enumerate(t) if u >= 0]  # fmt: skip
        cuts = sorted({c for *_, lv in edges for c in (lv, lv + chunks)})
        for a, b in zip(cuts, cuts[1:], strict=False):
            step = [((v, u) if upward else (u, v)) + (size[ti],)
                    for ti, v, u, lv in edges if 0 <= a - lv < chunks]  # fmt: skip
            total += (b - a) * schedule_time(topo, [step])
    return total


def best_chunks(topo: Topology, trees, weights, nbytes: float, max_chunks: int = MAX_CHUNKS) -> int:
    """Pipelining depth with the lowest predicted time (powers of two up to `max_chunks`)."""
    return _best_chunks(topo, tuple(trees), tuple(weights), float(nbytes), max_chunks)


@functools.lru_cache(maxsize=4096)
def _best_chunks(topo: Topology, trees, weights, nbytes: float, max_chunks: int) -> int:
    cands = [1 << i for i in range(max(max_chunks, 1).bit_length()) if 1 << i <= max_chunks]
    return min(cands, key=lambda k: (_tree_time(topo, trees, weights, nbytes, k), k))


def _check_size(topo: Topology, p: int | None) -> int:
    if p is not None and p != topo.size:
        raise ValueError(
            f"topology {topo.name!r} has {topo.size} devices but the axis has {p}; "
            "pass a topology with one device per axis index (topology.subset(...) selects some)"
        )
    return topo.size


def predict(
    algorithm: str,
    topo: Topology,
    nbytes: float,
    *,
    inner: int | None = None,
    chunks: int | None = None,
) -> float:
    """Predicted seconds for an all-reduce of `nbytes` bytes per device with `algorithm`.

    `inner` is the inner group size for "hierarchical" (default: the topology's nodes)."""
    p = topo.size
    if p == 1 or nbytes == 0:
        return 0.0
    if algorithm == "xla":
        return min(predict("ring", topo, nbytes), predict("tree", topo, nbytes))
    if algorithm == "ring":
        return schedule_time(topo, ring_schedule(p, nbytes))
    if algorithm == "bidirectional-ring":
        return schedule_time(topo, bidirectional_ring_schedule(p, nbytes))
    if algorithm == "recursive-halving-doubling":
        return schedule_time(topo, rhd_schedule(p, nbytes))
    if algorithm == "hierarchical":
        if inner is None:
            shape = hierarchy_shape(topo)
            if shape is None:
                raise ValueError(
                    f"hierarchical needs inner= (group size) for topology {topo.name!r}"
                )
            inner = shape[1]
        if p % inner:
            raise ValueError(f"inner={inner} must divide the {p} devices of {topo.name!r}")
        return schedule_time(topo, hierarchical_schedule(p // inner, inner, nbytes))
    if algorithm in ("tree", "packed-trees"):
        if algorithm == "tree":
            trees, weights = [tr.binomial_tree(p)], [1.0]
        else:
            pk = tr.pack_trees(topo)
            trees, weights = list(pk.trees), list(pk.weights)
        k = chunks or best_chunks(topo, trees, weights, nbytes)
        return _tree_time(topo, trees, weights, nbytes, k)
    raise ValueError(f"unknown algorithm {algorithm!r}; valid: {list(ALGORITHMS)}")


def predict_all(topo: Topology, nbytes: float, *, inner: int | None = None) -> dict[str, float]:
    """Predictions for every algorithm that applies to `topo` (hierarchical needs groups)."""
    out = {}
    for name in ALGORITHMS:
        if name == "hierarchical" and inner is None and hierarchy_shape(topo) is None:
            continue
        out[name] = predict(name, topo, nbytes, inner=inner)
    return out


def choose(
    topo: Topology,
    nbytes: float,
    *,
    inner: int | None = None,
    candidates: Sequence[str] | None = None,
) -> str:
    """The algorithm with the lowest predicted time ("xla" is not a candidate by default:
    it is modelled as the better of ring and tree, so it would only ever tie)."""
    if candidates is None:
        candidates = [a for a in ALGORITHMS if a != "xla"]
        if inner is None and hierarchy_shape(topo) is None:
            candidates.remove("hierarchical")
    return min(candidates, key=lambda a: predict(a, topo, nbytes, inner=inner))


def best_ring_order(topo: Topology) -> tuple[int, ...]:
    """The device order whose ring is fastest on `topo` (bottleneck route bandwidth, then
    latency), by exhaustive search over rings through device 0 (p <= 9). Build the mesh in this
    order (or `subset(topo, order)`) so that "ring" follows NVLink, as NCCL's ring search does."""
    p = topo.size
    if p > 9:
        raise ValueError(f"best_ring_order searches p! orders; p={p} is too many (max 9)")
    if p <= 2:
        return tuple(range(p))

    def key(order):
        hops = list(zip(order, order[1:] + order[:1], strict=True))
        return (-min(topo.route_bandwidth(u, v) for u, v in hops),
                max(topo.route_latency(u, v) for u, v in hops))  # fmt: skip

    return min(((0, *rest) for rest in itertools.permutations(range(1, p))), key=key)


def busbw(nbytes: float, p: int, seconds: float) -> float:
    """NCCL's bus bandwidth of an all-reduce: algorithm bandwidth times 2(p-1)/p."""
    return 0.0 if seconds == 0 else nbytes / seconds * 2 * (p - 1) / p


# ----------------------------------------------------------------------------- HLO counting

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_KINDS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_OP_RE = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>" + "|".join(_KINDS) + r")(?P<start>-start)?\("
)
_ARRAY_RE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/")  # XLA writes /*index=5*/ inside long tuple types


@dataclass(frozen=True)
class CollectiveOp:
    """One collective in compiled HLO: its kind, result bytes and who talks to whom."""

    kind: str
    nbytes: int
    groups: tuple[tuple[int, ...], ...] | None = None  # replica groups (None: all devices)
    pairs: tuple[tuple[int, int], ...] | None = None  # collective-permute source->target

    def sent(self, num_devices: int) -> dict[int, float]:
        """Bytes each device sends (XLA's own collectives counted at their bandwidth-optimal
        ring volume: all-reduce 2(g-1)/g n, all-gather and all-to-all (g-1)/g n, reduce-scatter
        (g-1) n, for result size n and group size g)."""
        if self.kind == "collective-permute":
            out: dict[int, float] = {}
            for s, _ in self.pairs or ():
                out[s] = out.get(s, 0.0) + self.nbytes
            return out
        groups = self.groups or (tuple(range(num_devices)),)
        out = {}
        for g in groups:
            n = len(g)
            per = {
                "all-reduce": 2 * (n - 1) / n * self.nbytes,
                "all-gather": (n - 1) / n * self.nbytes,
                "all-to-all": (n - 1) / n * self.nbytes,
                "reduce-scatter": (n - 1) * self.nbytes,
            }[self.kind]
            for d in g:
                out[d] = out.get(d, 0.0) + per
        return out


def _array_bytes(text: str) -> list[int]:
    sizes = []
    for dtype, dims in _ARRAY_RE.findall(text):
        if dtype in _ITEMSIZE:
            sizes.append(_ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return sizes


def _parse_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        dims = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))
    m = re.search(r"replica_groups=\{(.*?)\}\s*(?:,|$)", line)
    if m and m.group(1).strip():
        return tuple(
            tuple(int(i) for i in g.split(",") if i.strip())
            for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1))
        )
    return None


def hlo_collectives(hlo_text: str) -> list[CollectiveOp]:
    """Every collective in compiled HLO text (`jax.jit(f).lower(...).compile().as_text()`).

    Ops inside a while loop (scan) appear once, whatever the trip count."""
    ops = []
    for line in hlo_text.splitlines():
        line = _COMMENT_RE.sub("", line)
        m = _OP_RE.search(line)
        if not m:
            continue
        kind = m.group("kind")
        sizes = _array_bytes(m.group("type"))
        if m.group("start"):
            # async forms carry (operands..., results..., contexts...): take the result.
            nbytes = sizes[1] if kind in ("collective-permute", "all-gather") else sizes[0]
        else:
            nbytes = sum(sizes)
        pairs = None
        if kind == "collective-permute":
            pm = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
            body = pm.group(1) + "}" if pm else ""
            pairs = tuple(
                (int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body)
            )
        ops.append(CollectiveOp(kind, nbytes, _parse_groups(line), pairs))
    return ops


def num_partitions(hlo_text: str) -> int:
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    return int(m.group(1)) if m else 1


def bytes_sent_per_device(hlo_text: str) -> dict[int, float]:
    """Total bytes each device sends in all collectives of the compiled HLO."""
    n = num_partitions(hlo_text)
    total = {d: 0.0 for d in range(n)}
    for op in hlo_collectives(hlo_text):
        for d, b in op.sent(n).items():
            total[d] = total.get(d, 0.0) + b
    return total
