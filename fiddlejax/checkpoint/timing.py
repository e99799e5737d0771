"""What checkpointing costs training, measured as it happens: the numbers CheckFreq paces by.

A save blocks for the device-to-host snapshot (the stall); the write then runs in the background
(the persist) and may slow the steps it overlaps (the interference). :class:`SaveTiming` books
each, feeding :class:`~fiddlejax.checkpoint.checkfreq.CheckFreq` when the interval is ``"auto"`` and
:meth:`~fiddlejax.checkpoint.CheckpointManager.stats` always.
"""

from __future__ import annotations

import threading
import time

from fiddlejax.checkpoint.checkfreq import CheckFreq


class SaveTiming:
    """The clock of one CheckpointManager; ``checkfreq`` None books totals only."""

    def __init__(self, checkfreq: CheckFreq | None):
        self.checkfreq = checkfreq
        self.lock = threading.Lock()  # the persist window is closed by Orbax's thread
        self.t0: float | None = None  # first save() call
        self.last_return: float | None = None  # when save() last returned to the training loop
        self.stall = 0.0  # seconds spent blocked in save()
        self.interfered = 0.0  # extra step time while a persist ran (CheckFreq mode)
        self.persist_start: float | None = None
        self.persist_end: float | None = None
        self.window_extra = 0.0
        self.saves = 0

    def persisting(self) -> bool:
        """Whether a background write is running now."""
        with self.lock:
            return self.persist_start is not None and self.persist_end is None

    def persisted(self) -> None:  # Orbax's post-finalization callback (background thread)
        with self.lock:
            self.persist_end = time.perf_counter()

    def step_ended(self, now: float) -> None:
        """Book the time since the last save() returned as one step (CheckFreq mode).

        A step that overlapped a background write books its excess over the median step time,
        at most the overlap, as that write's interference (signed, so noise averages out).
        """
        if self.t0 is None:
            self.t0 = now
        if self.last_return is None or self.checkfreq is None:
            return
        gap, cf = now - self.last_return, self.checkfreq
        with self.lock:
            start, end = self.persist_start, self.persist_end
        overlap = 0.0
        if start is not None:
            overlap = (now if end is None else min(end, now)) - max(start, self.last_return)
        if overlap <= 0:
            cf.steps.append(gap)
        elif (t := cf.step_time()) is not None:
            self.window_extra += min(gap - t, overlap)
        self.book_persist()

    def book_persist(self) -> None:
        """Once a background write is over, book its duration and interference (CheckFreq)."""
        with self.lock:
            start, end = self.persist_start, self.persist_end
            if start is None or end is None:
                return
            self.persist_start = None
        extra = max(0.0, self.window_extra)
        self.window_extra = 0.0
        self.interfered += extra
        if self.checkfreq is not None:
            self.checkfreq.persists.append(max(0.0, end - start))
            self.checkfreq.interference.append(extra)

    def snapshot_begins(self) -> None:
        with self.lock:
            self.persist_start = self.persist_end = None

    def snapshot_ended(self, began: float, async_save: bool) -> float:
        """Book a save's blocking part (since ``began``); returns now, when the write starts."""
        self.saves += 1
        end = time.perf_counter()
        with self.lock:  # the background write runs from here (or is already done)
            self.persist_start = end
            if not async_save:
                self.persist_end = end
        if self.checkfreq is not None and self.saves > 1:  # the first save compiles things
            self.checkfreq.snapshots.append(end - began)
        self.stall += end - began
        return end

    def waited(self) -> None:
        """Time spent waiting for a write is not a training step: restart the step clock."""
        if self.last_return is not None:
            self.last_return = time.perf_counter()

    def stats(self) -> dict:
        """Measured checkpoint costs: overhead share of wall time, interval, last phases."""
        elapsed = (time.perf_counter() - self.t0) if self.t0 is not None else 0.0
        cf = self.checkfreq
        out = {"ckpt_saves": self.saves,
               "ckpt_overhead": (self.stall + self.interfered) / elapsed if elapsed else 0.0,
               "ckpt_stall_s": self.stall, "ckpt_interference_s": self.interfered}
        if cf is not None:
            out["ckpt_every"] = cf.interval() or 0
            if cf.snapshots:
                out["ckpt_snapshot_s"] = cf.snapshots[-1]
            if cf.persists:
                out["ckpt_persist_s"] = cf.persists[-1]
        return out
