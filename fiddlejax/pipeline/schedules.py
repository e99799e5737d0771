"""Pipeline schedules as data: an IR, generators, a validator and timeline simulators.

A schedule is one ordered list of actions per pipeline stage. A separate runtime executes it,
so schedules can be generated, written by hand, checked, simulated and drawn without JAX (this
module imports none). The design follows DeepSpeed's instruction schedules and PyTorch's
pipelining action lists.

Vocabulary:
  chunk   a global virtual stage, 0 .. stages*virtual_stages-1 in model order; ``placement[c]``
          is the stage that holds chunk c.
  F       forward of (microbatch, chunk).
  B       whole backward of (microbatch, chunk).
  I, W    a split backward: I computes the input gradient (what the previous chunk waits for),
          W the weight gradient (nobody waits for it, so it can fill bubbles).
  held    the activations of (microbatch, chunk) are held from its F until its B (or its W).

Dependencies: F(m, c) needs F(m, c-1); B(m, c) and I(m, c) need F(m, c) and the input-gradient
op (B or I) of (m, c+1); W(m, c) needs I(m, c). Each stage runs its own list strictly in order.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "OPS",
    "DEFAULT_COSTS",
    "Action",
    "Schedule",
    "ScheduleError",
    "Span",
    "Simulation",
    "TickTable",
    "build",
    "register",
    "kinds",
    "interleaves",
    "load",
    "dump",
    "validate",
    "simulate",
    "tick_table",
    "stash_slots",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_v",
    "interleaved_zb",
    "split_backward",
    "two_bw",
    "weight_updates",
]

OPS = ("F", "B", "I", "W")
DEFAULT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class ScheduleError(ValueError):
    """A schedule that cannot run as written; the message names the first violation."""


class Action(NamedTuple):
    """One unit of work on a stage: ``op`` of ``microbatch`` through ``chunk``."""

    op: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.op}(m={self.microbatch}, chunk={self.chunk})"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "microbatch": self.microbatch, "chunk": self.chunk}


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered action lists plus the chunk placement they run against.

    Construction does not validate (so broken hand-written schedules can be inspected and
    reported); ``build`` and ``load`` do. Derived figures are computed on first use.
    """

    kind: str
    stages: int
    microbatches: int
    virtual_stages: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    steps: int = 1  # optimizer steps the actions span (PipeDream-2BW runs several unflushed)

    def __post_init__(self) -> None:
        # Accept lists (hand-written code, JSON) but store tuples so the schedule is hashable.
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(
            self, "actions", tuple(tuple(_action(a) for a in row) for row in self.actions)
        )

    @property
    def num_chunks(self) -> int:
        return len(self.placement)

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """Chunks held by ``stage``, in model order."""
        return tuple(c for c, s in enumerate(self.placement) if s == stage)

    @property
    def total_microbatches(self) -> int:
        """Microbatch indices run over 0 .. steps x microbatches - 1."""
        return self.steps * self.microbatches

    def step_of(self, a: Action) -> int:
        """The optimizer step (batch) an action belongs to: its weight version's tag.

        In a ``2bw`` schedule the microbatches of step k run on the weights of version k-1
        (one step stale), so this is the version each action uses, offset by one.
        """
        return a.microbatch // self.microbatches

    @property
    def num_actions(self) -> int:
        return sum(len(row) for row in self.actions)

    @property
    def split_backward(self) -> bool:
        """True when the schedule uses I/W (zero-bubble style) anywhere."""
        return any(a.op in "IW" for row in self.actions for a in row)

    @cached_property
    def held_peak(self) -> tuple[int, ...]:
        """Per stage, the most (microbatch, chunk) activations held at once.

        Depends only on each stage's order (F adds one, B or W releases one), not on timing,
        so it is also the stash size the runtime needs on that stage.
        """
        peaks = []
        for row in self.actions:
            held = peak = 0
            for a in row:
                if a.op == "F":
                    held += 1
                    peak = max(peak, held)
                elif a.op in "BW":
                    held -= 1
            peaks.append(peak)
        return tuple(peaks)

    @property
    def max_held(self) -> int:
        return max(self.held_peak, default=0)

    @cached_property
    def simulation(self) -> Simulation:
        """Timeline with the default unit costs F=1, B=2, I=1, W=1 and no latency."""
        return simulate(self)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of stage-time in the default-cost timeline (see ``simulate``)."""
        return self.simulation.bubble_fraction

    @cached_property
    def ticks(self) -> TickTable:
        """The lockstep tick table the SPMD runtime executes (see ``tick_table``)."""
        return tick_table(self)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of docs/pipeline.md (plain lists and dicts)."""
        return {
            "kind": self.kind,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "placement": list(self.placement),
            "actions": [[self._action_dict(a) for a in row] for row in self.actions],
            **({"steps": self.steps} if self.steps > 1 else {}),
        }

    def _action_dict(self, a: Action) -> dict[str, Any]:
        return a.to_dict() | ({"step": self.step_of(a)} if self.steps > 1 else {})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check: bool = True) -> Schedule:
        """Parse the JSON form; with ``check`` (default) also ``validate`` it."""
        schedule = _parse(data)
        if check:
            validate(schedule)
        return schedule

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        head = (
            f"{self.kind}: stages={self.stages} microbatches={self.microbatches} "
            f"virtual_stages={self.virtual_stages}"
        )
        rows = [f"  stage {s}: " + " ".join(map(_short, row)) for s, row in enumerate(self.actions)]
        return "\n".join([head, *rows])


def _action(a: Action | Mapping[str, Any] | tuple) -> Action:
    if isinstance(a, Mapping):
        return Action(a["op"], a["microbatch"], a["chunk"])
    return Action(*a)


def _short(a: Action) -> str:
    return f"{a.op}{a.microbatch}.{a.chunk}"


# ---------------------------------------------------------------------------------------------
# JSON


def _parse(data: Mapping[str, Any]) -> Schedule:
    if not isinstance(data, Mapping):
        raise ScheduleError(f"a schedule must be a JSON object, got {type(data).__name__}")
    missing = [k for k in ("stages", "microbatches", "placement", "actions") if k not in data]
    if missing:
        raise ScheduleError(f"schedule JSON lacks {', '.join(map(repr, missing))}")
    stages = _count(data["stages"], "stages")
    microbatches = _count(data["microbatches"], "microbatches")
    placement = data["placement"]
    if not isinstance(placement, list) or not all(_is_int(x) for x in placement):
        raise ScheduleError(f"placement={placement!r} must be a list of stage indices")
    virtual_stages = data.get("virtual_stages")
    if virtual_stages is None:
        virtual_stages = max(1, len(placement) // stages)
    virtual_stages = _count(virtual_stages, "virtual_stages")
    rows = data["actions"]
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ScheduleError("actions must be a list with one list of actions per stage")
    actions = []
    for s, row in enumerate(rows):
        parsed = []
        for i, a in enumerate(row):
            where = f"actions[{s}][{i}]"
            if not isinstance(a, Mapping) or not {"op", "microbatch", "chunk"} <= set(a):
                raise ScheduleError(f"{where}={a!r} must be {{'op', 'microbatch', 'chunk'}}")
            if a["op"] not in OPS:
                raise ScheduleError(f"{where}.op={a['op']!r} is not one of {', '.join(OPS)}")
            if not _is_int(a["microbatch"]) or not _is_int(a["chunk"]):
                raise ScheduleError(f"{where}={a!r}: microbatch and chunk must be integers")
            parsed.append(Action(a["op"], a["microbatch"], a["chunk"]))
        actions.append(parsed)
    return Schedule(
        kind=str(data.get("kind", "custom")),
        stages=stages,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        placement=placement,
        actions=actions,
        steps=_count(data.get("steps", 1), "steps"),
    )


def load(source: str | os.PathLike[str] | Mapping[str, Any], *, check: bool = True) -> Schedule:
    """Load a schedule from a JSON string, a path to a JSON file, or an already-parsed dict."""
    if isinstance(source, Mapping):
        return Schedule.from_dict(source, check=check)
    text = str(source)
    if not text.lstrip().startswith("{"):
        text = Path(source).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ScheduleError(f"schedule is not valid JSON: {err}") from err
    return Schedule.from_dict(data, check=check)


def dump(schedule: Schedule, path: str | os.PathLike[str] | None = None) -> str:
    """The schedule as JSON, one stage's action list per line (easy to read and edit by hand).

    Also written to ``path`` when given. ``load`` reads it back.
    """
    d = schedule.to_dict()
    head = [f" {json.dumps(k)}: {json.dumps(d[k])}," for k in d if k != "actions"]
    rows = ",\n".join("  " + json.dumps(row) for row in d["actions"])
    text = "{\n" + "\n".join(head) + '\n "actions": [\n' + rows + "\n ]\n}"
    if path is not None:
        Path(path).write_text(text + "\n")
    return text


# ---------------------------------------------------------------------------------------------
# Validation


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _count(value: object, name: str, minimum: int = 1) -> int:
    if not _is_int(value):
        hint = minimum
        if isinstance(value, float) and value.is_integer() and value >= minimum:
            hint = int(value)
        raise ScheduleError(f"{name}={value!r} must be an integer, e.g. {name}={hint}")
    if value < minimum:
        raise ScheduleError(f"{name}={value} must be at least {minimum}, e.g. {name}={minimum}")
    return value


def _producer_key(a: Action) -> tuple[str, int, int]:
    """What an action makes available: activations ("F"), input gradient ("G") or done ("W")."""
    return ("F" if a.op == "F" else "G" if a.op in "BI" else "W", a.microbatch, a.chunk)


def _needs(a: Action, num_chunks: int) -> list[tuple[str, int, int]]:
    m, c = a.microbatch, a.chunk
    if a.op == "F":
        return [("F", m, c - 1)] if c > 0 else []
    if a.op == "W":
        return [("G", m, c)]
    deps = [("F", m, c)]
    if c < num_chunks - 1:
        deps.append(("G", m, c + 1))
    return deps


Position = tuple[int, int]  # (stage, index in that stage's list)


def _check_structure(s: Schedule) -> dict[tuple[str, int, int], Position]:
    """Everything but ordering; returns where each activation / gradient is produced."""
    _count(s.stages, "stages")
    _count(s.microbatches, "microbatches")
    _count(s.virtual_stages, "virtual_stages")
    if len(s.placement) != s.stages * s.virtual_stages:
        raise ScheduleError(
            f"placement has {len(s.placement)} chunks; stages={s.stages} x "
            f"virtual_stages={s.virtual_stages} needs {s.stages * s.virtual_stages}"
        )
    for c, st in enumerate(s.placement):
        if not _is_int(st) or not 0 <= st < s.stages:
            raise ScheduleError(f"placement[{c}]={st!r} is not a stage in 0..{s.stages - 1}")
    for st in range(s.stages):
        held = s.chunks_of(st)
        if len(held) != s.virtual_stages:
            raise ScheduleError(
                f"stage {st} holds chunks {list(held)} but every stage must hold "
                f"virtual_stages={s.virtual_stages} chunks"
            )
    if len(s.actions) != s.stages:
        raise ScheduleError(f"actions has {len(s.actions)} lists; need one per stage ({s.stages})")
    seen: dict[Action, Position] = {}
    produced: dict[tuple[str, int, int], Position] = {}
    for st, row in enumerate(s.actions):
        for i, a in enumerate(row):
            where = f"stage {st} action {i} {a}"
            if a.op not in OPS:
                raise ScheduleError(f"{where}: op {a.op!r} is not one of {', '.join(OPS)}")
            if not _is_int(a.microbatch) or not 0 <= a.microbatch < s.total_microbatches:
                raise ScheduleError(
                    f"{where}: microbatch is not in 0..{s.total_microbatches - 1}")
            if not _is_int(a.chunk) or not 0 <= a.chunk < s.num_chunks:
                raise ScheduleError(f"{where}: chunk is not in 0..{s.num_chunks - 1}")
            home = s.placement[a.chunk]
            if home != st:
                raise ScheduleError(
                    f"{where} is on the wrong stage: chunk {a.chunk} is placed on stage {home}"
                )
            if a in seen:
                raise ScheduleError(f"{where} duplicates stage {seen[a][0]} action {seen[a][1]}")
            other = {"B": ("I", "W"), "I": ("B",), "W": ("B",)}.get(a.op, ())
            for op in other:
                twin = Action(op, a.microbatch, a.chunk)
                if twin in seen:
                    raise ScheduleError(
                        f"{where} mixes whole and split backward: {twin} is at "
                        f"stage {seen[twin][0]} action {seen[twin][1]}"
                    )
            seen[a] = (st, i)
            produced[_producer_key(a)] = (st, i)
    for m in range(s.total_microbatches):
        for c in range(s.num_chunks):
            home = s.placement[c]
            if Action("F", m, c) not in seen:
                raise ScheduleError(f"F(m={m}, chunk={c}) is missing; add it on stage {home}")
            has_i, has_w = Action("I", m, c) in seen, Action("W", m, c) in seen
            if Action("B", m, c) not in seen and not (has_i or has_w):
                raise ScheduleError(
                    f"the backward of (m={m}, chunk={c}) is missing; add B(m={m}, chunk={c}) "
                    f"(or I and W) on stage {home}"
                )
            if has_i != has_w:
                lone, lacking = ("I", "W") if has_i else ("W", "I")
                raise ScheduleError(
                    f"{lone}(m={m}, chunk={c}) has no matching {lacking}(m={m}, chunk={c}); "
                    f"add it on stage {home}"
                )
    return produced


def _dependency_positions(s: Schedule) -> list[list[list[Position]]]:
    produced = _check_structure(s)
    return [[[produced[k] for k in _needs(a, s.num_chunks)] for a in row] for row in s.actions]


def _blocker(deps: list[list[list[Position]]], st: int, ptr: list[int]) -> Position:
    """The first input of stage ``st``'s next action that has not run; same-stage ones first."""
    waits = [(t, j) for t, j in deps[st][ptr[st]] if j >= ptr[t]]
    return min(waits, key=lambda d: d[0] != st)


def _describe_wait(s: Schedule, deps: list[list[list[Position]]], st: int, ptr: list[int]) -> str:
    i = ptr[st]
    t, j = _blocker(deps, st, ptr)
    head = f"stage {st} action {i} {s.actions[st][i]} needs {s.actions[t][j]}"
    if t == st:
        return f"{head}, which comes later on the same stage (action {j})"
    return f"{head} (stage {t} action {j}), which never runs before it (deadlock)"


def _advance_all(s: Schedule, deps: list[list[list[Position]]]) -> list[int]:
    """Run every stage in order as far as dependencies allow; returns how far each got."""
    ptr = [0] * s.stages
    progress = True
    while progress:
        progress = False
        for st, row in enumerate(s.actions):
            i = ptr[st]
            while i < len(row) and all(j < ptr[t] or (t == st and j < i) for t, j in deps[st][i]):
                i += 1
            if i != ptr[st]:
                ptr[st] = i
                progress = True
    return ptr


def _raise_deadlock(s: Schedule, deps: list[list[list[Position]]], ptr: list[int]) -> None:
    """Raise if some stage is stuck at ``ptr`` (a state where no stage can make progress)."""
    stuck = [st for st in range(s.stages) if ptr[st] < len(s.actions[st])]
    if not stuck:
        return
    # An action waiting on something later in its own list is the root cause; report it first.
    for st in stuck:
        if _blocker(deps, st, ptr)[0] == st:
            raise ScheduleError(_describe_wait(s, deps, st, ptr))
    # Otherwise stages wait on each other in a cycle: follow the waits until a stage repeats.
    st, chain = stuck[0], []
    while st not in chain:
        chain.append(st)
        st = _blocker(deps, st, ptr)[0]
    cycle = chain[chain.index(st) :] + [st]
    raise ScheduleError(
        f"{_describe_wait(s, deps, st, ptr)}; cycle: {' -> '.join(f'stage {x}' for x in cycle)}"
    )


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` can run as written; raise ``ScheduleError`` naming the first fault.

    Checks, in order: counts and placement; each action's op, microbatch, chunk and stage
    (the stage must hold the chunk); duplicates; B mixed with I/W for one pair; missing F or
    backward; finally executes every stage in order and reports the first stage whose next
    action waits forever. Returns the schedule so calls can be chained.
    """
    deps = _dependency_positions(schedule)
    _raise_deadlock(schedule, deps, _advance_all(schedule, deps))
    return schedule


# ---------------------------------------------------------------------------------------------
# Timelines


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
    schedule: Schedule, costs: Mapping[str, float] | None = None, latency: float = 0.0
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


def tick_table(schedule: Schedule, costs: Mapping[str, float] | None = None) -> TickTable:
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
    s: Schedule, deps: list[list[list[Position]]], tick_of: list[list[int]], num_ticks: int
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


def stash_slots(schedule: Schedule) -> tuple[dict[tuple[int, int], int], ...]:
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


# ---------------------------------------------------------------------------------------------
# Generators and registry

Generator = Callable[[int, int, int], Schedule]


MinMicrobatches = Callable[[int, int], int]


@dataclass(frozen=True)
class _Entry:
    generator: Generator
    virtual: bool
    min_microbatches: MinMicrobatches | None
    multistep: bool = False  # the generator takes steps= (runs several optimizer steps)


_REGISTRY: dict[str, _Entry] = {}


def _normal(kind: str) -> str:
    return kind.strip().lower().replace("_", "-")


def register(
    kind: str,
    generator: Generator,
    *,
    virtual: bool = False,
    min_microbatches: MinMicrobatches | None = None,
    multistep: bool = False,
) -> None:
    """Make ``build(kind, ...)`` call ``generator(stages, microbatches, virtual_stages)``.

    ``virtual`` says whether the kind uses ``virtual_stages`` > 1 (kinds that do not accept
    only 1). ``min_microbatches(stages, virtual_stages)``, if given, is the fewest microbatches
    the kind can schedule; ``build`` reports anything lower. The generator returns a
    ``Schedule`` with any placement it likes; ``build`` validates it, and the runtime only
    reads the schedule, so a new kind needs no runtime change.
    """
    if not isinstance(kind, str) or not kind.strip():
        raise ValueError(f"kind={kind!r} must be a non-empty string")
    _REGISTRY[_normal(kind)] = _Entry(generator, virtual, min_microbatches, multistep)


def interleaves(kind: str) -> bool:
    """Whether ``kind`` places several chunks per stage (takes ``virtual_stages``)."""
    entry = _REGISTRY.get(_normal(kind)) if isinstance(kind, str) else None
    return bool(entry and entry.virtual)


def kinds() -> list[str]:
    """Registered schedule kinds, in registration order."""
    return list(_REGISTRY)


def build(kind: str, stages: int, microbatches: int, virtual_stages: int | None = None,
          steps: int = 1) -> Schedule:
    """Generate and validate a schedule of a registered ``kind``.

    ``virtual_stages`` defaults to 1, or to 2 for kinds that interleave. ``steps`` > 1 (optimizer
    steps without a flush between them) is for multi-step kinds (``2bw``).
    """
    if not isinstance(kind, str) or _normal(kind) not in _REGISTRY:
        raise ValueError(f"unknown schedule kind {kind!r}; known kinds: {', '.join(_REGISTRY)}")
    kind = _normal(kind)
    entry = _REGISTRY[kind]
    stages = _count(stages, "stages")
    microbatches = _count(microbatches, "microbatches")
    if virtual_stages is None:
        virtual_stages = 2 if entry.virtual else 1
    virtual_stages = _count(virtual_stages, "virtual_stages")
    if virtual_stages != 1 and not entry.virtual:
        _unused("virtual_stages", virtual_stages, kind, "virtual", "")
    steps = _count(steps, "steps")
    if steps != 1 and not entry.multistep:
        _unused("steps", steps, kind, "multistep", " (it flushes every step)")
    if entry.min_microbatches is not None:
        need = entry.min_microbatches(stages, virtual_stages)
        if microbatches < need:
            raise ValueError(
                f"microbatches={microbatches} is too few for {kind} with stages={stages} and "
                f"virtual_stages={virtual_stages}; use at least {need}"
            )
    if entry.multistep:
        schedule = validate(entry.generator(stages, microbatches, virtual_stages, steps=steps))
        weight_updates(schedule)  # two weight versions must be enough
        return schedule
    return validate(entry.generator(stages, microbatches, virtual_stages))


def _unused(name: str, value: int, kind: str, flag: str, why: str) -> None:
    """Raise for an option ``kind`` ignores, naming the kinds that take it."""
    users = [k for k, e in _REGISTRY.items() if getattr(e, flag)]
    raise ValueError(f"{name}={value} is not used by {kind!r}{why}; leave it at 1 or use one "
                     f"of: {', '.join(users)}")


def _schedule(kind: str, p: int, m: int, v: int, rows: list[list[Action]]) -> Schedule:
    return Schedule(kind, p, m, v, tuple(c % p for c in range(p * v)), rows)


def gpipe(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """All forwards, then all backwards, both in microbatch order 0..m-1 (as PyTorch's GPipe).

    Simple and latency-tolerant but holds every microbatch's activations (peak m per stage).
    """
    p, m = stages, microbatches
    rows = [
        [Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in range(m)]
        for s in range(p)
    ]
    return _schedule("gpipe", p, m, 1, rows)


def _one_f_one_b_row(p: int, m: int, s: int) -> list[Action]:
    warmup = min(p - s - 1, m)
    row = [Action("F", j, s) for j in range(warmup)]
    for j in range(m - warmup):
        row += [Action("F", warmup + j, s), Action("B", j, s)]
    row += [Action("B", j, s) for j in range(m - warmup, m)]
    return row


def one_f_one_b(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """PipeDream-Flush: p-s-1 warm-up forwards on stage s, then F/B pairs, then cool-down Bs.

    Same bubble as GPipe, but stage s holds at most min(p-s, m) microbatches.
    """
    p, m = stages, microbatches
    return _schedule("1f1b", p, m, 1, [_one_f_one_b_row(p, m, s) for s in range(p)])


def _interleaved_groups(p: int, m: int) -> list[int]:
    """Sizes of the microbatch groups each chunk processes before moving to the next chunk.

    Megatron uses groups of exactly p, which needs m to be a multiple of p. Like PyTorch we
    take r = max(1, m // p) rounds; unlike PyTorch (which then needs r to divide m) we let the
    first m mod r groups be one larger, so every m works: for m >= p all groups lie in
    [p, 2p) and the bubble stays (p-1)/(v*m+p-1); for m < p one group of m runs, valid but
    with a larger bubble.
    """
    rounds = max(1, m // p)
    base, extra = divmod(m, rounds)
    return [base + 1] * extra + [base] * (rounds - extra)


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: chunk c on stage c mod p, v chunks per stage.

    Each stage walks its chunks group by group (forwards in chunk order, backwards in
    reverse), with (v-1)*g + 2*(p-s-1) warm-up forwards (g = size of the first group), then
    F/B pairs, then cool-down backwards. Shrinks the bubble about v-fold for more held
    activations. With virtual_stages=1 it is exactly 1F1B.
    """
    p, m, v = stages, microbatches, virtual_stages
    if v == 1:
        return _schedule("interleaved-1f1b", p, m, 1, [_one_f_one_b_row(p, m, s) for s in range(p)])
    groups = _interleaved_groups(p, m)
    starts = [sum(groups[:g]) for g in range(len(groups))]
    rows = []
    for s in range(p):
        fwd = [
            Action("F", start + j, k * p + s)
            for start, size in zip(starts, groups, strict=True)
            for k in range(v)
            for j in range(size)
        ]
        bwd = [
            Action("B", start + j, k * p + s)
            for start, size in zip(starts, groups, strict=True)
            for k in reversed(range(v))
            for j in range(size)
        ]
        total = v * m
        warmup = min((v - 1) * groups[0] + 2 * (p - s - 1), total)
        row = fwd[:warmup]
        for j in range(total - warmup):
            row += [fwd[warmup + j], bwd[j]]
        row += bwd[total - warmup :]
        rows.append(row)
    return _schedule("interleaved-1f1b", p, m, v, rows)


def zb_h1(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Zero-bubble H1 (Qi et al. 2023): backward split into I and W, memory of 1F1B.

    Stage s runs 1F1B's warm-up and F/I pairs but defers each W by s microbatches; the
    deferred Ws fill the cool-down bubbles. Every stage then holds at most min(p, m)
    activations (1F1B's peak, reached on stage 0) and the bubble drops to about a third of
    1F1B's with F=I=W=1.
    """
    p, m = stages, microbatches
    rows = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        row = [Action("F", j, s) for j in range(warmup)]
        steady = [[Action("F", warmup + j, s), Action("I", j, s)] for j in range(m - warmup)]
        cooldown = [[Action("I", j, s)] for j in range(m - warmup, m)]
        done_w = 0
        for j, pair in enumerate(steady + cooldown):
            row += pair
            # W(k) may run once I(k + s) has (steady) or right after its I (cool-down).
            if done_w <= (j - s if j < len(steady) else j):
                row.append(Action("W", done_w, s))
                done_w += 1
        row += [Action("W", k, s) for k in range(done_w, m)]
        rows.append(row)
    return _schedule("zb-h1", p, m, 1, rows)


def split_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every whole backward B run as I then W, back to back.

    In lockstep every tick lasts as long as its slowest action, so a B (cost 2) beside an F
    (cost 1) idles the F's stage for a unit; split, every action costs one unit and the
    lockstep bubble falls to the timeline's. Held activations are the same (W follows I at
    once); the cotangents at each layer's output are kept for one tick.
    """
    rows = [[x for a in row for x in ((Action("I", *a[1:]), Action("W", *a[1:])) if a.op == "B"
                                      else (a,))] for row in schedule.actions]
    return Schedule(schedule.kind, schedule.stages, schedule.microbatches,
                    schedule.virtual_stages, schedule.placement, rows, steps=schedule.steps)


def _greedy_zero_bubble(kind: str, p: int, m: int, v: int, placement: tuple[int, ...],
                        caps: tuple[float, ...],
                        rank: Callable[[Action, int], tuple[int, ...]]) -> Schedule:
    """A zero-bubble order found by lockstep list scheduling with unit-cost F, I and W.

    Each tick every stage runs its candidate of smallest ``rank(action, k)`` (k: the chunk's
    position on its stage, 0 = the stage's first chunk in model order), or idles. Candidates
    are each chunk's next I once its inputs are ready, the oldest deferred W, and each chunk's
    next ready F while the stage holds fewer than ``caps[k]`` activations, which bounds memory.
    Deferred Ws fill the gaps that 1F1B leaves idle, as in the ZB papers and torch's zero-bubble
    schedules. Raises ``ScheduleError`` if the caps starve every stage.
    """
    n = p * v
    chunks = [tuple(c for c in range(n) if placement[c] == st) for st in range(p)]
    f_done: dict[tuple[int, int], int] = {}
    i_done: dict[tuple[int, int], int] = {}
    next_f, next_i = [0] * n, [0] * n
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held = [0] * p
    rows: list[list[Action]] = [[] for _ in range(p)]
    left, t = 3 * n * m, 0
    while left:
        chosen: list[Action | None] = [None] * p
        for st in range(p):
            ranked = []
            if pending[st]:  # only the oldest deferred W is a candidate
                w = Action("W", *pending[st][0])
                ranked.append((rank(w, chunks[st].index(w.chunk)), w))
            for k, c in enumerate(chunks[st]):
                j = next_i[c]
                if (j < m and f_done.get((j, c), t) < t
                        and (c == n - 1 or i_done.get((j, c + 1), t) < t)):
                    ranked.append((rank(Action("I", j, c), k), Action("I", j, c)))
                j = next_f[c]
                if (j < m and held[st] < caps[k]
                        and (c == 0 or f_done.get((j, c - 1), t) < t)):
                    ranked.append((rank(Action("F", j, c), k), Action("F", j, c)))
            if ranked:
                chosen[st] = min(ranked)[1]
        if not any(chosen):
            raise ScheduleError(f"{kind}: list scheduling stalled at tick {t} (caps={caps})")
        for st, a in enumerate(chosen):  # results become visible from the next tick
            if a is None:
                continue
            rows[st].append(a)
            left -= 1
            key = (a.microbatch, a.chunk)
            if a.op == "F":
                f_done[key], next_f[a.chunk], held[st] = t, next_f[a.chunk] + 1, held[st] + 1
            elif a.op == "I":
                i_done[key], next_i[a.chunk] = t, next_i[a.chunk] + 1
                pending[st].append(key)
            else:
                pending[st].pop(0)
                held[st] -= 1
        t += 1
    return Schedule(kind, p, m, v, placement, rows)


def _zb_v_row(p: int, m: int, s: int) -> list[Action]:
    """Stage s's list in the ZB-V paper's hand-made pattern: with unit costs no stage idles
    after its first tick once m is about 1.5p or more.

    a = s is the stage's chunk on the way down the V, b = 2p-1-s the one on the way up.
    Warm-up: 2(p-s)-1 forwards of a, s (F b, F a) pairs, p-s (F b, I b, W b) triples; steady
    state: (F a, I a, W a, F b, I b, W b) while forwards remain; cool-down: s (I a, I b) pairs,
    p-s (I a, W a) pairs, then the deferred Ws. The peak is 2p activations after the warm-up.
    The pattern needs 2p-1 microbatches to form, so it is laid out for that many and the
    missing ones are dropped (valid, but with more bubble for m < 2p-1).
    """
    n, a, b = max(m, 2 * p - 1), s, 2 * p - 1 - s
    nxt: dict[tuple[str, int], int] = {}
    row: list[Action] = []

    def put(*steps: tuple[str, int]) -> None:
        for op, c in steps:
            j = nxt.get((op, c), 0)
            nxt[op, c] = j + 1
            if j < m:
                row.append(Action(op, j, c))

    put(*[("F", a)] * (2 * (p - s) - 1))
    for _ in range(s):
        put(("F", b), ("F", a))
    for _ in range(p - s):
        put(("F", b), ("I", b), ("W", b))
    for k in range(n - p):  # the first n-(2p-s-1) rounds still have a forward of a left
        put(*[("F", a)] * (k < n - (2 * p - s - 1)), ("I", a), ("W", a),
            ("F", b), ("I", b), ("W", b))
    for _ in range(s):
        put(("I", a), ("I", b))
    for _ in range(p - s):
        put(("I", a), ("W", a))
    put(*[("W", b)] * s, *[("W", a)] * s)
    return row


def _v_rank(order: str) -> Callable[[Action, int], tuple[int, ...]]:
    """Rank by place in ``order`` (op and the chunk's leg of the V: "F1 F0 I0 I1"); W last."""
    tokens = order.split()
    return lambda a, k: (tokens.index(f"{a.op}{k}") if a.op != "W" else len(tokens),)


# Priority rules for zb-v's list scheduler, for the m where the paper's pattern has not formed:
# (order, reserve), ``reserve`` keeping that many activation slots free for the V's second leg.
# No single rule is best for every (p, m); with the pattern they reach the (p-1)/(6m+p-1) bound
# for every p <= 8 and m >= p but p=7 m=9 and p=8 m=10 (one and two ticks over).
_ZB_V_RULES = (("F1 F0 I0 I1", 0), ("I0 I1 F1 F0", 0), ("F1 I0 F0 I1", 1))


def zb_v(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024): two chunks per stage in a V, split backwards, near-zero bubble.

    Chunk c sits on stage c for the first half and on stage 2p-1-c for the second, so stage 0
    holds both the first and the last chunk and the V's turn is a local hand-off on stage p-1.
    Every stage holds at most 2p half-size chunk activations (1F1B's memory). The order is the
    paper's pattern (``_zb_v_row``), whose only bubble is the p-1 warm-up ticks once m is
    about 1.5p or more; for fewer microbatches, the shortest of it and list-scheduled orders
    under the same memory cap (``_ZB_V_RULES``).
    """
    p, m = stages, microbatches
    if virtual_stages != 2:
        raise ScheduleError(f"zb-v places exactly 2 chunks per stage; got virtual_stages="
                            f"{virtual_stages}: use virtual_stages=2")
    placement = tuple(list(range(p)) + list(reversed(range(p))))
    pattern = Schedule("zb-v", p, m, 2, placement, [_zb_v_row(p, m, s) for s in range(p)])
    # Stage p-1 cannot start before tick p-1 and has 6m unit actions: nothing beats that.
    if pattern.simulation.makespan <= 6 * m + p - 1:
        return pattern
    found = [pattern]
    for order, reserve in _ZB_V_RULES:
        try:
            found.append(_greedy_zero_bubble("zb-v", p, m, 2, placement,
                                             (2 * p - reserve, 2 * p), _v_rank(order)))
        except ScheduleError:  # a rule whose caps starve the pipeline; the others remain
            continue
    return min(found, key=lambda s: (s.simulation.makespan, max(s.held_peak)))


def interleaved_zb(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved zero bubble: Megatron's cyclic placement (chunk c on stage c mod p) with
    split backwards and deferred Ws filling the gaps (torch's ScheduleInterleavedZeroBubble).
    Activation memory is capped near interleaved 1F1B's: the stage's first chunk starts a
    forward only while the stage holds fewer than p*v activations."""
    p, m, v = stages, microbatches, virtual_stages
    placement = tuple(c % p for c in range(p * v))
    caps = (p * v,) + (float("inf"),) * (v - 1)
    return _greedy_zero_bubble("interleaved-zb", p, m, v, placement, caps, _unblock_first)


def _unblock_first(a: Action, k: int) -> tuple[int, ...]:
    """interleaved-zb's priority: a ready I (it unblocks the stage before; oldest microbatch,
    deepest chunk), then an F (deepest chunk, oldest microbatch), then a deferred W."""
    if a.op == "I":
        return (0, a.microbatch, -a.chunk)
    if a.op == "F":
        return (1, -a.chunk, a.microbatch)
    return (2,)


def two_bw(stages: int, microbatches: int, virtual_stages: int = 1, steps: int = 1) -> Schedule:
    """PipeDream-2BW: 1F1B across ``steps`` optimizer steps with no flush between them.

    The microbatches of step k (indices k*m .. k*m+m-1) run on weight version k-1, one step
    stale, so the forwards of step k+1 can start while step k's backwards drain; each stage
    keeps two versions. The weight update of step k happens once every stage has finished
    step k's backwards and before any starts step k+2 (``weight_updates``); the pipeline
    fills and drains once per call, so the bubble shrinks as (p-1)/(steps*m + p-1).
    """
    p, m = stages, microbatches
    rows = [_one_f_one_b_row(p, steps * m, s) for s in range(p)]
    return Schedule("2bw", p, m, 1, tuple(range(p)), rows, steps=steps)


def weight_updates(schedule: Schedule, costs: Mapping[str, float] | None = None) -> list[int]:
    """Per optimizer step k, the lockstep tick before which its weight update is applied.

    That is the tick after the last backward of step k on any stage; it must come no later
    than the first forward of step k+2 on any stage (which reads the new version).
    """
    table = tick_table(schedule, costs)
    last_b = [0] * schedule.steps
    first_f = [table.num_ticks] * schedule.steps
    for t, row in enumerate(table.ticks):
        for a in row:
            if a is None:
                continue
            k = schedule.step_of(a)
            if a.op == "F":
                first_f[k] = min(first_f[k], t)
            elif a.op in ("B", "W"):
                last_b[k] = max(last_b[k], t + 1)
    for k in range(schedule.steps - 2):
        if last_b[k] > first_f[k + 2]:
            raise ScheduleError(
                f"microbatches={schedule.microbatches} per step is too few for "
                f"{schedule.kind} on stages={schedule.stages}: step {k + 2} would start "
                f"(tick {first_f[k + 2]}) before step {k}'s backwards end (tick {last_b[k]}), "
                "needing a third weight version; use at least "
                f"{max(1, schedule.stages - 1)} microbatches per step"
            )
    return last_b


register("gpipe", gpipe)
register("1f1b", one_f_one_b)
register("interleaved-1f1b", interleaved_1f1b, virtual=True)
register("zb-h1", zb_h1)
register("2bw", two_bw, multistep=True)
register("zb-v", zb_v, virtual=True)
register("interleaved-zb", interleaved_zb, virtual=True)
