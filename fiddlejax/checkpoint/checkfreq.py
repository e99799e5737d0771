"""CheckFreq (Mohan et al., FAST'21): the checkpoint interval from measured costs.

A pure policy over timings the checkpoint manager feeds it; no I/O, no JAX.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class CheckFreq:
    """Chooses the checkpoint interval from measured costs (CheckFreq, FAST'21).

    ``cost`` per checkpoint = snapshot stall + slowdown of the steps that overlap its background
    persist; the interval ``k`` is the smallest with ``cost / (k * step_time) <= overhead`` and
    ``k * step_time > persist_time`` (so a snapshot never waits for the previous persist).
    The first checkpoint is taken right after ``warmup`` measured steps to profile the costs.
    """

    def __init__(self, overhead: float = 0.035, warmup: int = 3, window: int = 64):
        if not 0 < overhead < 1:
            raise ValueError(f"checkfreq_overhead={overhead!r} must be a fraction in (0, 1), "
                             "e.g. 0.035 for 3.5%")
        self.overhead, self.warmup = overhead, warmup
        self.steps: deque[float] = deque(maxlen=window)  # step times without a persist running
        self.snapshots: deque[float] = deque(maxlen=8)
        self.persists: deque[float] = deque(maxlen=8)
        self.interference: deque[float] = deque(maxlen=8)

    def step_time(self) -> float | None:
        return statistics.median(self.steps) if len(self.steps) >= self.warmup else None

    def interval(self) -> int | None:
        """Steps between checkpoints, or None until the first costs are measured."""
        t = self.step_time()
        if t is None or not self.snapshots:
            return None
        t = max(t, 1e-9)
        cost = statistics.median(self.snapshots)
        if self.interference:
            cost += statistics.median(self.interference)
        k = math.ceil(cost / (self.overhead * t))
        if self.persists:
            k = max(k, math.floor(statistics.median(self.persists) / t) + 1)
        return max(k, 1)
