"""Generators of the classic schedules: GPipe, 1F1B, interleaved 1F1B and PipeDream-2BW
(with the check that two weight versions suffice)."""

from __future__ import annotations

from collections.abc import Mapping

from fiddlejax.pipeline.schedules.ir import Action, ScheduleError
from fiddlejax.pipeline.schedules.schedule import Schedule
from fiddlejax.pipeline.schedules.timeline import tick_table


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

