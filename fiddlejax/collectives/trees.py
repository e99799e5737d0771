"""Blink-style spanning-tree packing, and the pipelined schedule that runs data over the trees.

Why trees: a ring uses each device's one fastest route in one direction; on an irregular or
fragmented interconnect (six GPUs of a DGX-1) the ring is only as fast as its slowest hop, often
PCIe. A *packing* of spanning trees, each carrying its share of the data, can use every link at
once. The best packing rooted at `r` broadcasts at the rate of the minimum cut between `r` and any
device (Edmonds' theorem, the "max-flow bound"); Blink approaches it with multiplicative weights,
we solve the same linear program exactly by column generation:

    maximize  sum_T x_T   subject to   sum_T uses_l(T) x_T <= bandwidth_l   for every link l

where a tree T is an arborescence over the devices and uses_l(T) counts how many of its edges'
routes cross physical link l (a PCIe switch shared by two edges counts twice). The pricing step
is a minimum-cost arborescence (Chu-Liu/Edmonds) under the LP's dual prices.

All-reduce over a packing = reduce toward the root along every tree (edges reversed), then
broadcast back down; the data is split across trees by weight and each tree's share is pipelined
in `chunks` pieces so that every level of the tree works at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fiddlejax.collectives.topology import Topology

Parents = tuple[int, ...]  # parent[d] of every device d, -1 at the root
MAX_ROOTS_TRIED = 8  # pack_trees tries every root up to this many devices, else a spread


@dataclass(frozen=True)
class Packing:
    """Spanning trees rooted at `root` with data shares `weights` (summing to 1)."""

    root: int
    trees: tuple[Parents, ...]
    weights: tuple[float, ...]
    rate: float  # bytes/s the packing broadcasts at (sum of tree rates)
    bound: float  # max-flow bound on broadcast from this root, bytes/s

    @property
    def height(self) -> int:
        return max(tree_height(t) for t in self.trees)


@dataclass(frozen=True)
class Transfer:
    """One message of a pipelined tree schedule: chunk `chunk` of tree `tree` from src to dst."""

    tree: int
    src: int
    dst: int
    chunk: int


# ----------------------------------------------------------------------------- tree helpers


def binomial_tree(p: int, root: int = 0) -> Parents:
    """Binomial tree: relative rank q hangs under q minus its lowest set bit (log2 p levels)."""
    parent = [-1] * p
    for r in range(p):
        q = (r - root) % p
        if q:
            parent[r] = ((q - (q & -q)) + root) % p
    return tuple(parent)


def children(parent: Parents) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parent]
    for v, u in enumerate(parent):
        if u >= 0:
            kids[u].append(v)
    return kids


def heights(parent: Parents) -> list[int]:
    """Longest distance from each node down to a leaf (leaves 0)."""
    kids = children(parent)
    h = [0] * len(parent)

    def visit(v: int) -> int:
        h[v] = max((visit(c) + 1 for c in kids[v]), default=0)
        return h[v]

    visit(parent.index(-1))
    return h


def depths(parent: Parents) -> list[int]:
    """Distance from the root (root 0)."""
    d = [0] * len(parent)
    for v in range(len(parent)):
        u, n = v, 0
        while parent[u] >= 0:
            u, n = parent[u], n + 1
            if n > len(parent):
                raise ValueError(f"parent array {parent} has a cycle")
        d[v] = n
    return d


def tree_height(parent: Parents) -> int:
    return max(depths(parent))


def validate_tree(parent: Sequence[int]) -> None:
    """Raise ValueError unless `parent` is one arborescence over all devices."""
    roots = [v for v, u in enumerate(parent) if u < 0]
    if len(roots) != 1:
        raise ValueError(f"tree {tuple(parent)} must have exactly one root (parent -1)")
    if any(u >= len(parent) for u in parent):
        raise ValueError(f"tree {tuple(parent)} names a parent outside [0, {len(parent)})")
    depths(tuple(parent))


# ----------------------------------------------------------------------------- schedules


def reduce_steps(trees: Sequence[Parents], chunks: int) -> list[list[Transfer]]:
    """Pipelined reduce toward each root: a node of height h sends chunk j at step j + h, once it
    holds all its children's chunk j (children have height <= h - 1)."""
    per_tree = [heights(t) for t in trees]
    n_steps = chunks + max(max(h) for h in per_tree) - 1
    steps: list[list[Transfer]] = [[] for _ in range(n_steps)]
    for ti, (tree, h) in enumerate(zip(trees, per_tree, strict=True)):
        for v, u in enumerate(tree):
            if u >= 0:
                for j in range(chunks):
                    steps[j + h[v]].append(Transfer(ti, v, u, j))
    return steps


def broadcast_steps(trees: Sequence[Parents], chunks: int) -> list[list[Transfer]]:
    """Pipelined broadcast from each root: a node at depth d forwards chunk j at step j + d."""
    per_tree = [depths(t) for t in trees]
    n_steps = chunks + max(max(d) for d in per_tree) - 1
    steps: list[list[Transfer]] = [[] for _ in range(n_steps)]
    for ti, (tree, d) in enumerate(zip(trees, per_tree, strict=True)):
        for v, u in enumerate(tree):
            if u >= 0:
                for j in range(chunks):
                    steps[j + d[u]].append(Transfer(ti, u, v, j))
    return steps


def split_sizes(n: int, weights: Sequence[float]) -> list[int]:
    """Split n elements across trees proportionally to `weights` (largest remainder)."""
    w = np.asarray(weights, dtype=float)
    exact = n * w / w.sum()
    sizes = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - sizes), kind="stable")[: n - int(sizes.sum())]:
        sizes[i] += 1
    return [int(s) for s in sizes]


# ----------------------------------------------------------------------------- max flow


def direct_only(topo: Topology) -> bool:
    """Whether the direct device-to-device links (NVLink) alone connect every device both ways.

    Then trees use only those links, as Blink does: a switch (PCIe, NVSwitch) cannot replicate
    data, so routes through it share bandwidth in ways a max-flow bound does not see."""
    p = topo.size
    reach = np.eye(p, dtype=bool)
    for (u, v), path in topo.routes.items():
        reach[u, v] = _is_direct(topo, path)
    for k in range(p):  # transitive closure
        reach |= reach[:, [k]] & reach[[k], :]
    return p > 1 and bool(reach.all())


def _is_direct(topo: Topology, path: tuple[int, ...]) -> bool:
    return len(path) == 1


def _flow_graph(topo: Topology, direct: bool) -> tuple[list[str], np.ndarray]:
    """Capacity matrix over the nodes a collective may use (unallocated GPUs removed; only
    device-to-device links when `direct`)."""
    allocated = set(topo.devices)
    nodes = sorted(
        allocated
        if direct
        else {n for lk in topo.links for n in (lk.src, lk.dst)}
        - {g for g in topo.gpus if g not in allocated}
    )
    index = {n: i for i, n in enumerate(nodes)}
    cap = np.zeros((len(nodes), len(nodes)))
    for lk in topo.links:
        if lk.src in index and lk.dst in index:
            cap[index[lk.src], index[lk.dst]] += lk.bandwidth
    return nodes, cap


def max_flow(cap: np.ndarray, s: int, t: int) -> float:
    """Edmonds-Karp maximum flow on a dense capacity matrix."""
    residual = cap.astype(float).copy()
    total = 0.0
    eps = 1e-9 * max(float(cap.max()), 1.0)
    while True:
        prev = np.full(len(cap), -1)
        prev[s] = s
        queue = [s]
        for u in queue:
            for v in np.nonzero((residual[u] > eps) & (prev < 0))[0]:
                prev[v] = u
                queue.append(int(v))
            if prev[t] >= 0:
                break
        if prev[t] < 0:
            return total
        v, push = t, math.inf
        while v != s:
            push = min(push, residual[prev[v], v])
            v = prev[v]
        v = t
        while v != s:
            residual[prev[v], v] -= push
            residual[v, prev[v]] += push
            v = prev[v]
        total += push


@functools.cache
def broadcast_bound(topo: Topology, root: int, direct: bool | None = None) -> float:
    """Max-flow bound on broadcast rate from `root`: min over devices of the root->device cut
    (over direct links only when `direct`; default: `direct_only(topo)`, as the packer)."""
    nodes, cap = _flow_graph(topo, direct_only(topo) if direct is None else direct)
    s = nodes.index(topo.devices[root])
    return min(max_flow(cap, s, nodes.index(d)) for i, d in enumerate(topo.devices) if i != root)


@functools.cache
def reduce_bound(topo: Topology, root: int, direct: bool | None = None) -> float:
    """Max-flow bound on reduce rate into `root`: min over devices of the device->root cut."""
    nodes, cap = _flow_graph(topo, direct_only(topo) if direct is None else direct)
    t = nodes.index(topo.devices[root])
    return min(max_flow(cap, nodes.index(d), t) for i, d in enumerate(topo.devices) if i != root)


def allreduce_bound(topo: Topology, nbytes: float, direct: bool | None = None) -> float:
    """Lower bound (seconds) on any reduce-then-broadcast all-reduce through one root.

    Every byte must cross the root's minimum cut twice (in, then out), whatever the trees. It
    is the bound Blink's trees are measured against, not a bound on every algorithm (a ring
    moves only 2(p-1)/p of the data through each device)."""
    if topo.size == 1:
        return 0.0
    return min(
        nbytes / reduce_bound(topo, r, direct) + nbytes / broadcast_bound(topo, r, direct)
        for r in range(topo.size)
    )


# ----------------------------------------------------------------------------- packing


def min_arborescence(cost: np.ndarray, root: int) -> Parents:
    """Minimum-cost spanning arborescence rooted at `root` (Chu-Liu/Edmonds); cost[u, v] is the
    cost of edge u->v, inf where there is none."""
    cost = np.array(cost, dtype=float)
    np.fill_diagonal(cost, np.inf)
    cost[:, root] = np.inf
    return tuple(int(u) for u in _edmonds(cost, root))


def _edmonds(cost: np.ndarray, root: int) -> np.ndarray:
    n = len(cost)
    parent = cost.argmin(axis=0)
    parent[root] = -1
    for v in range(n):
        if v != root and not np.isfinite(cost[parent[v], v]):
            raise ValueError(f"no spanning tree: node {v} cannot be reached")
    cycle = _find_cycle(parent, root)
    if cycle is None:
        return parent
    rest = [v for v in range(n) if v not in set(cycle)]
    c = len(rest)  # index of the contracted cycle node
    new = np.full((c + 1, c + 1), np.inf)
    new[:c, :c] = cost[np.ix_(rest, rest)]
    into = cost[np.ix_(rest, cycle)] - cost[parent[cycle], cycle][None, :]
    enter = into.argmin(axis=1)
    new[:c, c] = into[np.arange(c), enter]
    out_of = cost[np.ix_(cycle, rest)]
    leave = out_of.argmin(axis=0)
    new[c, :c] = out_of[leave, np.arange(c)]
    sub = _edmonds(new, rest.index(root))
    result = parent.copy()
    for i, w in enumerate(rest):
        if w != root:
            result[w] = cycle[leave[i]] if sub[i] == c else rest[sub[i]]
    a = int(sub[c])
    result[cycle[enter[a]]] = rest[a]
    return result


def _find_cycle(parent: np.ndarray, root: int) -> list[int] | None:
    state = [0] * len(parent)  # 0 unseen, 1 on current walk, 2 done
    for start in range(len(parent)):
        walk = []
        v = start
        while v != root and v >= 0 and state[v] == 0:
            state[v] = 1
            walk.append(v)
            v = int(parent[v])
        if v != root and v >= 0 and state[v] == 1:
            return walk[walk.index(v) :]
        for u in walk:
            state[u] = 2
    return None


def _usage(topo: Topology, tree: Parents) -> np.ndarray:
    """How many of the tree's edges (broadcast direction) cross each physical link."""
    use = np.zeros(len(topo.links))
    for v, u in enumerate(tree):
        if u >= 0:
            for k in topo.routes[u, v]:
                use[k] += 1
    return use


def _pack_from(topo: Topology, root: int, direct: bool, max_iters: int = 200) -> Packing:
    from scipy.optimize import linprog  # scipy ships with jax; only the packer needs it

    p = topo.size
    caps = np.array([lk.bandwidth for lk in topo.links])
    scale = caps.max()
    caps_n = caps / scale
    routes = topo.routes
    route_of = np.zeros((p, p, len(caps)))
    allowed = np.zeros((p, p), dtype=bool)
    for (u, v), path in routes.items():
        allowed[u, v] = _is_direct(topo, path) or not direct
        for k in path:
            route_of[u, v, k] += 1

    def arc_cost(prices: np.ndarray) -> np.ndarray:
        return np.where(allowed, route_of @ prices, np.inf)

    # First column: the arborescence of fastest routes.
    pool = [min_arborescence(arc_cost(1.0 / caps_n), root)]
    x = np.ones(1)
    columns = [_usage(topo, t) for t in pool]
    for _ in range(max_iters):
        usage = np.stack(columns, axis=1)
        res = linprog(
            -np.ones(len(pool)), A_ub=usage, b_ub=caps_n, bounds=(0, None), method="highs"
        )
        if res.status != 0:
            raise RuntimeError(f"tree packing LP failed on {topo.name!r}: {res.message}")
        x, duals = res.x, -res.ineqlin.marginals
        cost = arc_cost(duals)
        tree = min_arborescence(cost, root)
        price = sum(cost[u, v] for v, u in enumerate(tree) if u >= 0)
        if price >= 1 - 1e-9 or tree in pool:
            break
        pool.append(tree)
        columns.append(_usage(topo, tree))
    keep = [i for i in range(len(pool)) if x[i] > 1e-9 * x.sum()]
    trees = tuple(pool[i] for i in keep)
    total = float(x[keep].sum())
    return Packing(
        root=root,
        trees=trees,
        weights=tuple(float(x[i]) / total for i in keep),
        rate=total * scale,
        bound=broadcast_bound(topo, root, direct),
    )


@functools.cache
def pack_trees(topo: Topology, root: int | None = None, direct: bool | None = None) -> Packing:
    """The best packing of spanning trees over `topo` (all roots tried when `root` is None).

    `direct`: use only device-to-device links (default `direct_only(topo)`: when they connect
    all devices, as NVLink does on a DGX-1); False also uses routes through switches."""
    if topo.size == 1:
        return Packing(0, ((-1,),), (1.0,), math.inf, math.inf)
    if root is not None and not 0 <= root < topo.size:
        raise ValueError(f"root={root} must be in [0, {topo.size}) for {topo.name!r}")
    if root is not None:
        roots = [root]
    elif topo.size <= MAX_ROOTS_TRIED:
        roots = list(range(topo.size))
    else:  # large topologies: four spread-out roots (the presets are symmetric anyway)
        roots = sorted({i * topo.size // 4 for i in range(4)})
    direct = direct_only(topo) if direct is None else direct
    packs = [_pack_from(topo, r, direct) for r in roots]
    return max(packs, key=lambda pk: (round(pk.rate / 1e6), -pk.height, -pk.root))
