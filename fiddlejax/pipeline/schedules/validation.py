"""Validation: whether a schedule can run as written, with a message naming the first fault.

Also the dependency positions and deadlock report that the timeline simulators reuse.
"""

from __future__ import annotations

from typing import TypeVar

from fiddlejax.pipeline.schedules.ir import (
    OPS,
    Action,
    ScheduleError,
    ScheduleLike,
    _count,
    _is_int,
)

_S = TypeVar("_S", bound=ScheduleLike)  # validate returns what it was given


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


def _check_structure(s: ScheduleLike) -> dict[tuple[str, int, int], Position]:
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


def _dependency_positions(s: ScheduleLike) -> list[list[list[Position]]]:
    produced = _check_structure(s)
    return [[[produced[k] for k in _needs(a, s.num_chunks)] for a in row] for row in s.actions]


def _blocker(deps: list[list[list[Position]]], st: int, ptr: list[int]) -> Position:
    """The first input of stage ``st``'s next action that has not run; same-stage ones first."""
    waits = [(t, j) for t, j in deps[st][ptr[st]] if j >= ptr[t]]
    return min(waits, key=lambda d: d[0] != st)


def _describe_wait(
    s: ScheduleLike, deps: list[list[list[Position]]], st: int, ptr: list[int]
) -> str:
    i = ptr[st]
    t, j = _blocker(deps, st, ptr)
    head = f"stage {st} action {i} {s.actions[st][i]} needs {s.actions[t][j]}"
    if t == st:
        return f"{head}, which comes later on the same stage (action {j})"
    return f"{head} (stage {t} action {j}), which never runs before it (deadlock)"


def _advance_all(s: ScheduleLike, deps: list[list[list[Position]]]) -> list[int]:
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


def _raise_deadlock(s: ScheduleLike, deps: list[list[list[Position]]], ptr: list[int]) -> None:
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


def validate(schedule: _S) -> _S:
    """Check that ``schedule`` can run as written; raise ``ScheduleError`` naming the first fault.

    Checks, in order: counts and placement; each action's op, microbatch, chunk and stage
    (the stage must hold the chunk); duplicates; B mixed with I/W for one pair; missing F or
    backward; finally executes every stage in order and reports the first stage whose next
    action waits forever. Returns the schedule so calls can be chained.
    """
    deps = _dependency_positions(schedule)
    _raise_deadlock(schedule, deps, _advance_all(schedule, deps))
    return schedule
