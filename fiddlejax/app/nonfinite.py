"""``train.nonfinite``: what ``fiddlejax train`` does with a step whose loss or gradient norm
is NaN or infinite.

The step itself never applies such an update (:func:`fiddlejax.parallel.exchange.keep_if_finite`
keeps the old parameters in-graph, from the loss and the gradient norm it computes anyway), so
the state stays finite and no checkpoint is poisoned. The job reads the step's loss, gradient
norm and ``nonfinite_skipped`` flag with the loss it logs (no extra sync) and then:

- ``skip`` (default): logs the skipped step and counts it; ``train.nonfinite_limit`` skipped
  steps in a row stop the job (a diverged run never recovers by itself);
- ``stop``: stops at the first one.

Stopping raises :class:`~fiddlejax.checks.NonFiniteLoss` (exit status 1) naming the first bad
step of the run of them, what was not finite, and the last checkpoint as ``resume=N``. A skipped
step is not saved by the periodic schedule (its state is the previous step's parameters with the
data moved on), so the newest checkpoint is always from a step whose update was applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fiddlejax.app.config import checkpoint_dir
from fiddlejax.checks import NonFiniteLoss, nonfinite_what


class NonFiniteSteps:
    """Counts skipped steps and decides when the job stops (see the module docstring)."""

    def __init__(self, cfg: dict, ckpt, log: Callable[[str], None], skipped: int = 0):
        t = cfg["train"]
        self.cfg, self.ckpt, self.log = cfg, ckpt, log
        self.mode, self.limit = t.get("nonfinite", "skip"), int(t.get("nonfinite_limit", 5))
        self.total = int(skipped)  # in this run, and the runs it resumed
        self.streak: list[tuple[int, float, float]] = []  # (step, loss, grad norm) in a row

    def check(self, step: int, losses: list[float], norms: list[float],
              flags: list[int], bad_ids: list[int] | None = None) -> list[bool]:
        """Steps ``step``, ``step + 1``, ...: whether each was skipped. Raises
        :class:`NonFiniteLoss` when the job must stop: at once for a batch whose ids fell
        outside the vocabulary (``bad_ids``; skipped in-graph), which no step would fix."""
        out = []
        for i, (loss, norm, flag) in enumerate(zip(losses, norms, flags)):
            if bad_ids and bad_ids[i]:
                s = step + i
                raise NonFiniteLoss(s, loss, (
                    f"; its update was skipped; stopped before saving it; "
                    f"{self.last_good(s)}. Fix the data (plan.check_inputs=true names the "
                    "first bad id and where it is)"),
                    what=f"the batch holds {bad_ids[i]} token ids outside the model's "
                         "vocabulary")
            bad = bool(flag) or not (math.isfinite(loss) and math.isfinite(norm))
            out.append(bad)
            if not bad:
                self.streak = []
                continue
            s = step + i
            self.total += 1
            self.streak.append((s, loss, norm))
            if self.mode == "stop" or len(self.streak) >= self.limit or not flag:
                raise self.error()
            self.log(f"step {s}: {nonfinite_what(loss, norm)}; its update was skipped "
                     f"({len(self.streak)} in a row, {self.total} in this run; "
                     f"train.nonfinite_limit={self.limit} in a row stops the job)")
        return out

    def error(self) -> NonFiniteLoss:
        """The error that stops the job, naming the first step of the streak."""
        first, loss, norm = self.streak[0]
        last = self.streak[-1][0]
        why = ""
        if self.mode == "skip" and last > first:
            why = (f"; train.nonfinite=skip skipped steps {first}-{last}, "
                   f"train.nonfinite_limit={self.limit} in a row")
        return NonFiniteLoss(first, loss, f"; stopped before saving it; {self.last_good(first)}"
                             f"{why}. Lower optimizer.lr (now {self.cfg['optimizer']['lr']}) "
                             "or set plan.check_inputs=true to check the data",
                             what=nonfinite_what(loss, norm))

    def last_good(self, first: int) -> str:
        """Where to continue from: the newest checkpoint, in the CLI's own form."""
        if self.ckpt is None:
            return (f"the last good step is {first - 1} (checkpoint.dir=null: no checkpoint to "
                    "resume from)")
        last = self.ckpt.last_good()
        where = checkpoint_dir(self.cfg)
        if last is None:
            return f"no checkpoint was written before it in {where}"
        return f"the last checkpoint is step {last} in {where} (resume={last} continues from it)"
