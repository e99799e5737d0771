"""Tick tables: a validated schedule turned into the per-(tick, stage) integers the runtime reads.

The executor scans over ticks; on each device it reads its own :class:`Row` and runs one action.
Every buffer the scan carries is indexed by a slot from this table, so the tables are where
memory is decided:

- **stash**: residuals of (microbatch, chunk) from its F until its B (or W); slots are taken
  lowest-free-first (``schedules.stash_slots``), so a stage needs its schedule's held peak.
- **inbox**: one buffer for everything that arrives from a neighbour or from the stage itself
  (activations for a forward, cotangents for a backward, the loss cotangent the last chunk
  seeds); slots come from interval colouring of [arrival tick, use tick]. Its last slot is a
  trash slot that ticks without a message write into, so no write is ever masked.
- **wdy**: split backwards only: the cotangent at every layer's output, from I until its W.

A message made at tick t is delivered at the end of tick t and is usable from tick t+1. A chunk
hands its output to the stage of the next chunk, which must be the same stage (a V-shaped
placement's turn: a local hand-off), the next stage or the previous one (cyclically).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from fiddlejax.pipeline import schedules
from fiddlejax.pipeline.schedules import Action

# Action kinds (a row's ``branch``): which of a stage's layer loops run this tick.
IDLE, F_MID, F_FIRST, F_LAST, F_ONLY, B_MID, B_FIRST, I_MID, I_FIRST, W = range(10)
NUM_BRANCHES = 10


class Row(NamedTuple):
    """One device's entry for one tick (ints in the tables, traced scalars in the scan)."""

    branch: Any      # which action (IDLE, F_MID, ...)
    microbatch: Any
    chunk: Any       # index among the stage's own chunks
    layers: Any      # layers in that chunk (chunks may be uneven)
    version: Any     # weight version the action uses (0, or step % 2 under 2BW)
    step: Any        # optimizer step the action belongs to (its loss slot)
    read: Any        # inbox slot the action reads (its input activation or cotangent)
    stash: Any       # stash slot the action writes (F) or reads (B, I, W)
    wdy: Any         # wdy slot I writes and W reads
    from_prev: Any   # inbox slot for what the previous stage sends this tick (trash if none)
    from_next: Any   # inbox slot for what the next stage sends this tick
    from_self: Any   # inbox slot for what this stage's own action sends to itself


@dataclasses.dataclass(frozen=True)
class Tables:
    """Static tables ``[ticks, stages]`` per :class:`Row` field, plus buffer sizes."""

    columns: Row                # each field an int array [T, p]
    num_stash: int              # stash slots (the schedule's held peak)
    num_inbox: int              # inbox slots, the trash slot included
    num_wdy: int                # wdy slots (split backwards; 1 otherwise)
    step_ends: tuple[int, ...]  # tick after which each optimizer step's update applies
    split: bool = False         # the schedule splits backwards into I and W

    @property
    def num_ticks(self) -> int:
        return int(self.columns.branch.shape[0])

    @property
    def trash(self) -> int:
        return self.num_inbox - 1

    def stacked(self) -> np.ndarray:
        """``[T, p, len(Row._fields)]`` int32: what the scan walks over."""
        return np.stack(self.columns, axis=-1).astype(np.int32)

    def row(self, tick: int, stage: int) -> Row:
        return Row(*(int(col[tick, stage]) for col in self.columns))

    def edges(self) -> np.ndarray:
        """``[T, len(Edge._fields)]`` int32: per tick, what the prologue and the head do (the
        same on every device, as they run over all of them): see :class:`Edge`."""
        c = self.columns
        out = np.full((self.num_ticks, len(Edge._fields)), -1, np.int64)
        for fields, branches in (((0, 1), (F_FIRST, F_ONLY)), ((2, 3, 4), (F_LAST, F_ONLY)),
                                 ((5, 6), (B_FIRST, I_FIRST))):
            t, st = np.nonzero(np.isin(c.branch, branches))
            if len(np.unique(t)) != len(t):
                raise AssertionError("two stages run the same edge action in one tick")
            for f, col in zip(fields, (c.microbatch, c.version, c.step)):
                out[t, f] = col[t, st]
        return out.astype(np.int32)


class Edge(NamedTuple):
    """One tick's work at the pipeline's two ends, run by every device (-1: none this tick)."""

    embed: Any          # microbatch whose chunk-0 forward runs: the prologue computes its input
    embed_version: Any
    head: Any           # microbatch whose last chunk finished its forward: head and loss run
    head_version: Any
    head_step: Any      # the optimizer step it belongs to (its loss slot)
    embed_grad: Any     # microbatch whose chunk-0 backward ran: the prologue's gradients
    embed_grad_version: Any


def direction(schedule: schedules.Schedule, src: int, dst: int) -> str:
    """How a message goes from stage ``src`` to ``dst``: "self", "next" or "prev"."""
    p = schedule.stages
    if src == dst:
        return "self"
    if dst == (src + 1) % p:  # with p == 2 both neighbours are one: "next"
        return "next"
    if dst == (src - 1) % p:
        return "prev"
    raise ValueError(
        f"{schedule.kind}: a chunk on stage {src} hands its output to stage {dst}; the runtime "
        "passes messages only to the same stage or a neighbouring one (cyclically). Use a "
        "placement where consecutive chunks sit on the same or adjacent stages")


def allocate(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for [write tick, read tick] intervals; a slot read at t is free for writes at t
    (writes land at the end of a tick, after its reads)."""
    ends: list[int] = []
    slots = {}
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for i, e in enumerate(ends):
            if e <= start:
                ends[i] = end
                slots[key] = i
                break
        else:
            slots[key] = len(ends)
            ends.append(end)
    return slots, max(len(ends), 1)


def build_tables(s: schedules.Schedule, counts: list[int]) -> Tables:
    """Turn a validated schedule into the integer tables the executor runs."""
    table = schedules.tick_table(s)
    p, n_chunks, place = s.stages, s.num_chunks, s.placement
    last = n_chunks - 1
    local = {c: s.chunks_of(place[c]).index(c) for c in range(n_chunks)}
    for c in range(last):  # refuse unsupported hand-offs up front
        direction(s, place[c], place[c + 1])
    tick: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(table.ticks):
        for a in row:
            if a is not None:
                tick[(a.op, a.microbatch, a.chunk)] = t
    bwd = "I" if s.split_backward else "B"
    # Messages (arrival tick, use tick, key) per receiving stage; key = (kind, microbatch, chunk).
    inbox_iv: list[list] = [[] for _ in range(p)]
    wdy_iv: list[list] = [[] for _ in range(p)]
    for (op, m, c), t in tick.items():
        st = place[c]
        if op == "F" and c > 0:
            inbox_iv[st].append((tick[("F", m, c - 1)], t, ("x", m, c)))
        if op == bwd:  # its cotangent: from the next chunk's backward, or the loss (own F)
            src = tick[(bwd, m, c + 1)] if c < last else tick[("F", m, c)]
            inbox_iv[st].append((src, t, ("dy", m, c)))
        if op == "I":
            wdy_iv[st].append((t, tick[("W", m, c)], (m, c)))
    inbox = [allocate(iv) for iv in inbox_iv]
    wdy = [allocate(iv) for iv in wdy_iv]
    num_inbox = max(n for _, n in inbox) + 1  # + the trash slot
    num_wdy = max(n for _, n in wdy)
    trash = num_inbox - 1
    stash = schedules.stash_slots(s)
    T = table.num_ticks
    col = {f: np.zeros((T, p), np.int64) for f in Row._fields}
    for f in ("read", "from_prev", "from_next", "from_self"):
        col[f][:] = trash

    def deliver(src_stage: int, dst_stage: int, t: int, key) -> None:
        way = direction(s, src_stage, dst_stage)
        field = {"self": "from_self", "next": "from_prev", "prev": "from_next"}[way]
        col[field][t, dst_stage] = inbox[dst_stage][0][key]

    for (op, m, c), t in tick.items():
        st = place[c]
        col["microbatch"][t, st] = m
        col["chunk"][t, st] = local[c]
        col["layers"][t, st] = counts[c]
        col["stash"][t, st] = stash[st][(m, c)]
        col["step"][t, st] = s.step_of(Action(op, m, c))
        col["version"][t, st] = col["step"][t, st] % 2  # two versions suffice (2BW); else 0
        if op == "F":
            col["branch"][t, st] = (F_ONLY if n_chunks == 1 else F_FIRST if c == 0
                                    else F_LAST if c == last else F_MID)
            if c > 0:
                col["read"][t, st] = inbox[st][0][("x", m, c)]
            if c < last:
                deliver(st, place[c + 1], t, ("x", m, c + 1))
            else:  # the loss cotangent seeds this chunk's own backward
                deliver(st, st, t, ("dy", m, c))
        elif op in ("B", "I"):
            first, mid = (B_FIRST, B_MID) if op == "B" else (I_FIRST, I_MID)
            col["branch"][t, st] = first if c == 0 else mid
            col["read"][t, st] = inbox[st][0][("dy", m, c)]
            if op == "I":
                col["wdy"][t, st] = wdy[st][0][(m, c)]
            if c > 0:
                deliver(st, place[c - 1], t, ("dy", m, c - 1))
        else:  # W
            col["branch"][t, st] = W
            col["wdy"][t, st] = wdy[st][0][(m, c)]
    ends = tuple(schedules.weight_updates(s)) if s.steps > 1 else (T,)
    return Tables(Row(**col), num_stash=max(s.held_peak), num_inbox=num_inbox,
                  num_wdy=num_wdy, step_ends=ends, split=s.split_backward)


__all__ = ["Edge", "Row", "Tables", "allocate", "build_tables", "direction", "IDLE", "F_MID",
           "F_FIRST", "F_LAST", "F_ONLY", "B_MID", "B_FIRST", "I_MID", "I_FIRST", "W",
           "NUM_BRANCHES"]
