"""Timelines of a schedule: the event-driven simulation, the lockstep tick table the SPMD
runtime executes, and the stash slots that size its buffers."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from fiddlejax.pipeline.schedules.ir import DEFAULT_COSTS, OPS, Action, ScheduleLike
from fiddlejax.pipeline.schedules.validation import Position, _dependency_positions, _raise_deadlock


class Span(NamedTuple):
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """Event-driven timeline: each action starts when its stage is free and its inputs arrived.

    ``bubble_fraction`` = 1 - total busy time / (stages * makespan). ``spans[s][i]`` is the
    (start, end) of ``schedule.actions[s][i]``.
    """

    makespan: float
    bubble_fraction: float
    busy: tuple[float, ...]
    held_peak: tuple[int, ...]
    spans: tuple[tuple[Span, ...], ...]
    costs: Mapping[str, float]
    latency: float


def _costs(costs: Mapping[str, float] | None) -> dict[str, float]:
    merged = dict(DEFAULT_COSTS)
    for op, value in (costs or {}).items():
        if op not in OPS:
            raise ValueError(f"costs has op {op!r}; ops are {', '.join(OPS)}")
        if not isinstance(value, int | float) or value < 0:
            raise ValueError(f"costs[{op!r}]={value!r} must be a number >= 0")
        merged[op] = float(value)
    return merged


def simulate(
    schedule: ScheduleLike, costs: Mapping[str, float] | None = None, latency: float = 0.0
) -> Simulation:
    """Timeline of ``schedule`` with per-op ``costs`` (overrides of F=1, B=2, I=1, W=1).

    ``latency`` is added whenever a dependency crosses stages (point-to-point transfer).
    Validates first, so a broken schedule raises ``ScheduleError`` rather than hanging.
    """
    cost = _costs(costs)
    if latency < 0:
        raise ValueError(f"latency={latency} must be >= 0")
    deps = _dependency_positions(schedule)
    end: list[list[float]] = [[0.0] * len(row) for row in schedule.actions]
    spans: list[list[Span]] = [[Span(0.0, 0.0)] * len(row) for row in schedule.actions]
    ptr = [0] * schedule.stages
    progress = True
    # Sweep stages, running each as far as its inputs allow; start times do not depend on the
    # sweep order, and a sweep without progress is exactly a deadlock.
    while progress:
        progress = False
        for st, row in enumerate(schedule.actions):
            i = ptr[st]
            while i < len(row) and all(j < ptr[t] or (t == st and j < i) for t, j in deps[st][i]):
                ready = end[st][i - 1] if i else 0.0
                for t, j in deps[st][i]:
                    ready = max(ready, end[t][j] + (latency if t != st else 0.0))
                end[st][i] = ready + cost[row[i].op]
                spans[st][i] = Span(ready, end[st][i])
                i += 1
            progress |= i != ptr[st]
            ptr[st] = i
    _raise_deadlock(schedule, deps, ptr)
    makespan = max((row[-1] for row in end if row), default=0.0)
    busy = tuple(sum(cost[a.op] for a in row) for row in schedule.actions)
    bubble = 1.0 - sum(busy) / (schedule.stages * makespan) if makespan else 0.0
    return Simulation(
        makespan=makespan,
        bubble_fraction=bubble,
        busy=busy,
        held_peak=schedule.held_peak,
        spans=tuple(tuple(r) for r in spans),
        costs=cost,
        latency=latency,
    )


@dataclass(frozen=True)
class TickTable:
    """The lockstep table: ``ticks[t][s]`` is what stage s runs at tick t (None = idle).

    Every action takes one tick; a result made at tick t is usable from tick t+1, on the same
    stage or another. ``tick_of[s][i]`` is the tick of ``schedule.actions[s][i]``.

    Two bubbles, both for this lockstep execution:
      ``bubble_fraction``           idle slots / all slots (every op weighs one tick).
      ``weighted_bubble_fraction``  with op costs, each tick lasting as long as its slowest
                                    action (stages synchronise every tick), i.e.
                                    1 - total cost / (stages * ``weighted_makespan``).

    ``inbox_peak[s]`` = (activations, gradients): the most inputs stage s has received (sent
    at an earlier tick, from another stage or from its own previous chunk) but not yet
    consumed, counting one from the tick after it was made through the tick that uses it.
    A runtime that receives every tick sizes its inbox buffers by it.
    """

    ticks: tuple[tuple[Action | None, ...], ...]
    tick_of: tuple[tuple[int, ...], ...]
    bubble_fraction: float
    weighted_makespan: float
    weighted_bubble_fraction: float
    inbox_peak: tuple[tuple[int, int], ...] = ()
    costs: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_COSTS))

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def stages(self) -> int:
        return len(self.ticks[0]) if self.ticks else 0


def tick_table(schedule: ScheduleLike, costs: Mapping[str, float] | None = None) -> TickTable:
    """Assign every action a tick, greedily and deterministically (see ``TickTable``).

    At each tick every stage runs its next action if all its inputs were made at an earlier
    tick, else idles. For a schedule that validates this always finishes; ``costs`` only feed
    the weighted bubble.
    """
    cost = _costs(costs)
    deps = _dependency_positions(schedule)
    never = 1 << 62
    tick_of = [[never] * len(row) for row in schedule.actions]
    ptr = [0] * schedule.stages
    ticks: list[tuple[Action | None, ...]] = []
    remaining = schedule.num_actions
    t = 0
    while remaining:
        slot: list[Action | None] = [None] * schedule.stages
        for st, row in enumerate(schedule.actions):
            i = ptr[st]
            if i < len(row) and all(tick_of[d][j] < t for d, j in deps[st][i]):
                tick_of[st][i] = t
                slot[st] = row[i]
                ptr[st] = i + 1
                remaining -= 1
        if not any(a is not None for a in slot):
            # Nothing could run although work remains: every stage waits on undone work.
            _raise_deadlock(schedule, deps, ptr)
        ticks.append(tuple(slot))
        t += 1
    slots = len(ticks) * schedule.stages
    busy = sum(1 for row in ticks for a in row if a is not None)
    inbox = _inbox_peak(schedule, deps, tick_of, len(ticks))
    weighted = sum(max((cost[a.op] for a in row if a is not None), default=0.0) for row in ticks)
    work = sum(cost[a.op] for row in schedule.actions for a in row)
    return TickTable(
        ticks=tuple(ticks),
        tick_of=tuple(tuple(r) for r in tick_of),
        bubble_fraction=1.0 - busy / slots if slots else 0.0,
        weighted_makespan=weighted,
        weighted_bubble_fraction=1.0 - work / (schedule.stages * weighted) if weighted else 0.0,
        inbox_peak=inbox,
        costs=cost,
    )


def _inbox_peak(
    s: ScheduleLike, deps: list[list[list[Position]]], tick_of: list[list[int]], num_ticks: int
) -> tuple[tuple[int, int], ...]:
    """Peak count of received-but-unused activations and gradients per stage (see TickTable)."""
    peaks = []
    for st, row in enumerate(s.actions):
        # Difference arrays over ticks, one for activations (kind 0) and one for gradients.
        delta = [[0] * (num_ticks + 2) for _ in range(2)]
        for i, a in enumerate(row):
            if a.op == "W":
                continue
            for t, j in deps[st][i]:
                if s.actions[t][j].chunk != a.chunk:  # a message, not this chunk's own stash
                    kind = 0 if a.op == "F" else 1
                    delta[kind][tick_of[t][j] + 1] += 1
                    delta[kind][tick_of[st][i] + 1] -= 1
        peak = []
        for d in delta:
            level = best = 0
            for x in d:
                level += x
                best = max(best, level)
            peak.append(best)
        peaks.append((peak[0], peak[1]))
    return tuple(peaks)


def stash_slots(schedule: ScheduleLike) -> tuple[dict[tuple[int, int], int], ...]:
    """Per stage, a stash slot for each (microbatch, chunk), reused once released.

    Slots are taken lowest-free-first at F and freed at B/W, so stage s needs exactly
    ``held_peak[s]`` slots; a runtime can size fixed buffers by it.
    """
    result = []
    for row in schedule.actions:
        free: list[int] = []  # a heap: the lowest free slot first keeps assignments stable
        used = 0
        slots: dict[tuple[int, int], int] = {}
        live: dict[tuple[int, int], int] = {}
        for a in row:
            key = (a.microbatch, a.chunk)
            if a.op == "F":
                if free:
                    slot = heapq.heappop(free)
                else:
                    slot, used = used, used + 1
                slots[key] = live[key] = slot
            elif a.op in "BW" and key in live:
                heapq.heappush(free, live.pop(key))
        result.append(slots)
    return tuple(result)

