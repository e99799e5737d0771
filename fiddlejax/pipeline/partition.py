"""Layers -> pipeline chunks: how many consecutive layers each chunk (virtual stage) runs.

A pipeline runs at the pace of its slowest stage, so the goal is the smallest maximum chunk
cost. Chunk 0 also runs the prologue (embedding) and the last chunk the epilogue (final norm,
head, loss), so those two carry extra cost.

- ``uniform``: counts as even as possible; surplus layers go to the middle chunks first, then
  the first chunk, and the last chunk (which runs the head) last.
- ``params`` / ``cost``: PipeDream's dynamic program over per-layer costs (parameter counts, or
  measured times), minimising the maximum chunk cost including ``first_extra`` / ``last_extra``.
  Where a stage holds several chunks (interleaved schedules: ``placement``), a stage runs at
  the pace of its chunks' sum, and the split is refined to the smallest maximum stage load.

Pure Python: no JAX, so the planner and tests can call it anywhere.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

METHODS = ("uniform", "params", "cost")


def partition(
    num_layers: int,
    num_chunks: int,
    method: str = "uniform",
    *,
    layer_costs: Sequence[float] | None = None,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    layer_memory: Sequence[float] | None = None,
    memory_budget: float | None = None,
    placement: Sequence[int] | None = None,
) -> list[int]:
    """Layer counts per chunk, in model order: ``len == num_chunks``, each >= 1, sum == layers.

    ``layer_costs`` (one per layer) defaults to equal costs; it is used by ``params``/``cost``,
    as are ``layer_memory``, ``memory_budget`` and ``placement`` (:func:`balanced`).
    """
    _check(num_layers, num_chunks, method)
    if method == "uniform":
        return uniform(num_layers, num_chunks)
    costs = [1.0] * num_layers if layer_costs is None else [float(c) for c in layer_costs]
    if len(costs) != num_layers:
        raise ValueError(f"layer_costs has {len(costs)} entries but num_layers={num_layers}; "
                         "give one cost per layer")
    for name, value in [*((f"layer_costs[{i}]", c) for i, c in enumerate(costs)),
                        ("first_extra", first_extra), ("last_extra", last_extra)]:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value} must be a finite cost >= 0")
    return balanced(costs, num_chunks, first_extra=first_extra, last_extra=last_extra,
                    layer_memory=layer_memory, memory_budget=memory_budget,
                    placement=placement)


def _check(num_layers: int, num_chunks: int, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r} must be one of {', '.join(METHODS)}")
    for name, v in (("num_layers", num_layers), ("num_chunks", num_chunks)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if num_layers < num_chunks:
        raise ValueError(
            f"n_layers={num_layers} is fewer than stages x virtual_stages = {num_chunks}; use at "
            f"most {num_layers} chunks or more layers")


def uniform(num_layers: int, num_chunks: int) -> list[int]:
    """As even as possible; the surplus goes to middle chunks, then the first, then the last."""
    _check(num_layers, num_chunks, "uniform")
    base, extra = divmod(num_layers, num_chunks)
    counts = [base] * num_chunks
    for c in _surplus_order(num_chunks)[:extra]:
        counts[c] += 1
    return counts


def _surplus_order(k: int) -> list[int]:
    """Chunk indices in the order they receive surplus layers: centre-out middles, first, last."""
    centre = (k - 1) / 2
    middles = sorted(range(1, k - 1), key=lambda c: (abs(c - centre), c))
    return middles + [0] + ([k - 1] if k > 1 else [])


def chunk_costs(counts: Sequence[int], layer_costs: Sequence[float], *, first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """The cost of each chunk of a partition, prologue/epilogue extras included."""
    out, start = [], 0
    for c in counts:
        out.append(float(sum(layer_costs[start:start + c])))
        start += c
    out[0] += first_extra
    out[-1] += last_extra
    return out


def stage_loads(counts: Sequence[int], layer_costs: Sequence[float],
                placement: Sequence[int] | None = None) -> list[float]:
    """Each pipeline stage's cost: the sum of its chunks' (``placement``: chunk -> stage, a
    schedule's; ``None``: one chunk a stage)."""
    chunks = chunk_costs(counts, layer_costs)
    if placement is None:
        return chunks
    out = [0.0] * (max(placement) + 1)
    for stage, c in zip(placement, chunks, strict=True):
        out[stage] += c
    return out


def balanced(layer_costs: Sequence[float], num_chunks: int, *, first_extra: float = 0.0,
             last_extra: float = 0.0, layer_memory: Sequence[float] | None = None,
             memory_budget: float | None = None,
             placement: Sequence[int] | None = None) -> list[int]:
    """The contiguous split minimising the maximum chunk cost (PipeDream's dynamic program).

    Among the optimal splits it takes the one with the smallest sum of squared chunk costs (the
    most even), then the one closest to :func:`uniform`, so equal costs give uniform's answer.
    ``layer_memory`` and ``memory_budget``: only chunks whose layers' memory sums to at most
    the budget are allowed (PipeDream's memory constraint); a ValueError names the smallest
    budget any split meets when none meets this one.
    ``placement`` (chunk -> pipeline stage, a schedule's): where a stage holds several chunks,
    the split is then refined by :func:`_stage_balanced`.
    """
    n, k = len(layer_costs), num_chunks
    _check(n, k, "cost")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    fits = _memory_fits(layer_memory, memory_budget, n, k)

    def cost(j: int, a: int, b: int) -> float:  # chunk j holds layers a..b-1
        return (prefix[b] - prefix[a] + (first_extra if j == 0 else 0.0)
                + (last_extra if j == k - 1 else 0.0))

    # Pass 1: best[j][i] = smallest possible max cost of layers 0..i-1 in chunks 0..j.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(k)]
    for i in range(1, n - k + 2):
        best[0][i] = cost(0, 0, i) if fits(0, i) else inf
    for j in range(1, k):
        for i in range(j + 1, n - (k - 1 - j) + 1):
            best[j][i] = min((max(best[j - 1][a], cost(j, a, i)) for a in range(j, i)
                              if fits(a, i)), default=inf)
    bound = best[k - 1][n]
    bound += 1e-9 * max(1.0, abs(bound))  # float slack: sums in another order may differ

    # Pass 2: among splits whose every chunk is within the bound, lexicographically minimise
    # (sum of squared costs, distance to the uniform counts); both add up chunk by chunk.
    target = uniform(n, k)
    score: list[list[tuple[float, int] | None]] = [[None] * (n + 1) for _ in range(k)]
    back = [[0] * (n + 1) for _ in range(k)]
    for i in range(1, n - k + 2):
        if cost(0, 0, i) <= bound and fits(0, i):
            score[0][i] = (cost(0, 0, i) ** 2, abs(i - target[0]))
    for j in range(1, k):
        for i in range(j + 1, n - (k - 1 - j) + 1):
            for a in range(j, i):
                prev, c = score[j - 1][a], cost(j, a, i)
                if prev is None or c > bound or not fits(a, i):
                    continue
                cand = (prev[0] + c * c, prev[1] + abs(i - a - target[j]))
                if score[j][i] is None or cand < score[j][i]:
                    score[j][i], back[j][i] = cand, a
    counts, i = [], n
    for j in range(k - 1, 0, -1):
        a = back[j][i]
        counts.append(i - a)
        i = a
    counts.append(i)
    counts = counts[::-1]
    if placement is None or len(set(placement)) == len(placement):
        return counts
    if len(placement) != k:
        raise ValueError(f"placement has {len(placement)} entries for {k} chunks; give each "
                         "chunk's stage (a schedule's placement)")
    return _stage_balanced(counts, placement, lambda j, a, b: cost(j, a, b), fits)


def _stage_balanced(counts: list[int], placement: Sequence[int], cost, fits,
                    budget: int = 200_000) -> list[int]:
    """``counts`` refined to the smallest maximum *stage* load, a stage's load being the sum of
    its chunks' costs: a stage of an interleaved schedule runs all its chunks for every
    microbatch, so the sum sets the pace, and uneven chunks can pair up into even stages.

    No dynamic program covers sums over non-contiguous chunks, so this is a depth-first branch
    and bound over the chunk boundaries, in model order, seeded with the chunk-balanced split
    and cutting every branch whose stage already exceeds the best maximum; ties go to the
    smaller sum of squared stage loads. Exact when it finishes within ``budget`` visited
    boundaries (always for tens of blocks), else the best split found, never worse than the
    seed."""
    k, n, stages = len(counts), sum(counts), max(placement) + 1

    def score(bounds: list[int]) -> tuple[float, float]:
        load = [0.0] * stages
        for j in range(k):
            load[placement[j]] += cost(j, bounds[j], bounds[j + 1])
        return (round(max(load), 9), round(sum(x * x for x in load), 9))

    seed = [0, *itertools.accumulate(counts)]
    best = {"bounds": seed, "score": score(seed), "left": budget}

    def visit(j: int, a: int, bounds: list[int], load: list[float]) -> None:
        ends = [n] if j == k - 1 else range(a + 1, n - (k - 1 - j) + 1)
        for e in ends:
            best["left"] -= 1
            if best["left"] < 0:
                return
            stage_load = load[placement[j]] + cost(j, a, e)
            if round(stage_load, 9) > best["score"][0]:
                return  # costs are >= 0: a later end only adds
            if not fits(a, e):
                continue
            load[placement[j]] = stage_load
            if j == k - 1:
                s = score([*bounds, e])
                if s < best["score"]:
                    best["bounds"], best["score"] = [*bounds, e], s
            else:
                visit(j + 1, e, [*bounds, e], load)
            load[placement[j]] -= cost(j, a, e)

    visit(0, 0, [0], [0.0] * stages)
    b = best["bounds"]
    return [y - x for x, y in zip(b, b[1:])]


def _memory_fits(memory: Sequence[float] | None, budget: float | None, n: int, k: int):
    """``fits(a, b)``: whether layers a..b-1 fit ``budget`` together (always, without one);
    a ValueError naming the smallest budget a split of n layers into k chunks meets, if this
    one is below it."""
    if budget is None:
        return lambda a, b: True
    if memory is None or len(memory) != n:
        raise ValueError(f"memory_budget needs layer_memory, one entry per layer ({n}); got "
                         f"{None if memory is None else len(memory)}")
    for i, m in enumerate(memory):
        if not math.isfinite(m) or m < 0:
            raise ValueError(f"layer_memory[{i}]={m} must be finite bytes >= 0")
    prefix = [0.0]
    for m in memory:
        prefix.append(prefix[-1] + m)
    need = max(chunk_costs(balanced(list(memory), k), memory))
    if need > budget * (1 + 1e-12):
        raise ValueError(f"no split of {n} layers into {k} chunks keeps each within "
                         f"memory_budget={budget:.6g}: the most even by memory needs {need:.6g} "
                         "in its largest chunk; raise the budget or use more chunks")
    return lambda a, b: prefix[b] - prefix[a] <= budget * (1 + 1e-12)
