"""Zero-bubble schedules: backwards split into I (input gradient) and W (weight gradient), the
deferred Ws filling bubbles. ZB-H1, ZB-V, interleaved ZB and the list scheduler behind the
last two."""

from __future__ import annotations

from collections.abc import Callable

from fiddlejax.pipeline.schedules.generators import _schedule
from fiddlejax.pipeline.schedules.ir import Action, ScheduleError
from fiddlejax.pipeline.schedules.schedule import Schedule


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


def join_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every I run as a whole backward B in its place and its W dropped: the
    inverse of ``split_backward``. Dependencies are the I's; each stage holds at most what it
    held (a B releases at the I's place, before the W's). Where a bubble costs nothing (a CPU
    whose cores the simulated devices share), this runs a zero-bubble order in fewer ticks,
    each backward one VJP: ZB-V at p=4, m=16 in 70 ticks instead of 99."""
    rows = [[Action("B", *a[1:]) if a.op == "I" else a for a in row if a.op != "W"]
            for row in schedule.actions]
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

