"""The ``checkpoint:`` and ``resume`` parts of ``fiddlejax train``, kept out of the loop.

The library's :class:`~fiddlejax.checkpoint.CheckpointManager` saves and restores; this module
adds what a job needs around it: refusing an unusable directory before anything runs, resuming
(``resume=auto`` or a step, rolling newer steps aside), saving on the job's schedule and on
preemption, and announcing config changes since the checkpoint.

By default (``checkpoint.dir=auto``) a run saves under its own ``<run.dir>/checkpoints``, so a
first ``fiddlejax train`` can be resumed. Like the run's logs, those belong to the run directory:
a fresh run there (``resume=null``) moves an earlier run's checkpoints aside into
``rolled_back/`` (never deletes them). A directory named with ``checkpoint.dir=DIR`` is the
user's: a fresh run refuses to start in it while it holds checkpoints.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from fiddlejax.app.config import AUTO_CHECKPOINT_DIR, checkpoint_dir
from fiddlejax.checkpoint import CheckpointManager, Preemption, jsonable
from fiddlejax.checkpoint.lock import DirectoryInUse, DirectoryLock

ROLLED_BACK = "rolled_back"  # where resume=N moves the checkpoints after N (never deleted)

# Config keys whose change on resume alters what the run computes, and what it changes.
_ANNOUNCE = {"train.steps": "the learning-rate schedule stretches to the new length",
             "optimizer": "the optimizer", "data": "the data stream", "model": "the model",
             "plan": "the layout (the checkpoint converts exactly)", "mesh": "the layout",
             "train.steps_per_call": "steps per call"}


def config_changes(saved: dict | None, cfg: dict) -> list[str]:
    """One line per config key whose change since the checkpoint alters what the run computes
    (``saved``: the config stored in the checkpoint; paths, logging and resume keys ignored)."""
    if not isinstance(saved, dict):
        return []
    from fiddlejax.app.config import leaves

    old, new = leaves(saved), leaves(jsonable(cfg))
    out = []
    for key in sorted(set(old) | set(new)):
        if key not in old or old[key] == new.get(key) \
                or key.startswith(("run.", "checkpoint.", "resume")):
            continue
        what = _ANNOUNCE.get(key) or _ANNOUNCE.get(key.split(".")[0])
        if what:
            out.append(f"config changed since the checkpoint: {key} {old.get(key)!r} -> "
                       f"{new.get(key)!r} ({what})")
    return out


def quiet_storage_errors() -> None:
    """Keep a failed write to one line: the job reports it (naming the directory and the step
    a resume uses), so Orbax's own log of the same error from its writer threads and
    TensorStore's late callbacks into the closed event loop ("Event loop is closed", up to
    hundreds of tracebacks) are dropped. Other logs and unraisable errors pass through."""
    import logging
    import sys

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxWriterErrors) for f in absl.filters):
        absl.addFilter(_OrbaxWriterErrors())
    previous = sys.unraisablehook
    if getattr(previous, "fiddlejax", False):
        return

    def hook(unraisable) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.fiddlejax = True
    sys.unraisablehook = hook


class _OrbaxWriterErrors:
    def filter(self, record) -> bool:
        return "_SignalingThread.run() raised an exception" not in record.getMessage()


def check_directory(cfg: dict) -> None:
    """Refuse an unusable ``checkpoint.dir`` before anything runs: a regular file, a directory
    that cannot be written, or a disk without room for a probe write."""
    d = checkpoint_dir(cfg)
    if not d:
        return
    path = Path(d)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            raise NotADirectoryError(
                f"checkpoint.dir={d} cannot be used: {parent} is a regular file; name a "
                "directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fiddlejax-write-probe-", dir=path)  # O_EXCL:
        with open(fd, "wb") as f:  # never a planted link's target
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(
            f"checkpoint.dir={d} is not writable ({e.strerror or e}); give a directory this "
            "user can write to, with free space, or leave checkpoint.dir unset") from None


def lock_directory(cfg: dict, log: Callable[[str], None] = print) -> DirectoryLock | None:
    """Check ``checkpoint.dir`` (:func:`check_directory`) and lock it for this job's lifetime:
    process 0 holds the lock for the whole job; every process learns whether it got it, so a
    second job is refused everywhere (naming the holder), before anything is built. The caller
    releases it on every exit path (the kernel does when the process ends)."""
    check_directory(cfg)
    d = checkpoint_dir(cfg)
    if not d:
        return None
    lock, error, note = None, None, None
    if jax.process_index() == 0:
        lock = DirectoryLock(d, cfg["run"]["dir"], what=f"checkpoint.dir={d}")
        try:
            note = lock.acquire()
        except DirectoryInUse as e:
            error = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        refused = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if refused and error is None:
            error = DirectoryInUse(f"checkpoint.dir={d} is in use by another fiddlejax job "
                                   "(process 0's message names it); wait for it to end, or "
                                   "give this run its own checkpoint.dir")
    if error is not None:
        raise error
    if note:
        log(note)
    return lock


class JobCheckpoints:
    """The ``checkpoint:`` and ``resume`` parts of ``fiddlejax train``, kept out of the loop.

    ``resume=N`` before the latest step rolls back: the newer steps are moved, untouched, into
    ``<checkpoint.dir>/rolled_back/<time>/`` (announced), and the run continues from N exactly.
    Numbered directories that hold nothing (a save killed before it wrote) are removed.
    """

    def __init__(self, cfg: dict, trainer, data_iter, log: Callable[[str], None] = print):
        c = cfg["checkpoint"]
        self.cfg, self.trainer, self.data_iter, self.log = cfg, trainer, data_iter, log
        self.resume, self.steps = cfg.get("resume"), cfg["train"]["steps"]
        self.skipped_before = 0  # non-finite steps skipped by the runs this one resumes
        every = c["every"]
        self.directory = Path(checkpoint_dir(cfg)).absolute()
        self.owned = c["dir"] == AUTO_CHECKPOINT_DIR  # the run directory's own checkpoints
        self._remove_empty_steps()
        self.preemption = Preemption()
        quiet_storage_errors()
        self.mgr = CheckpointManager(
            self.directory, trainer, every=every if every == "auto" else int(every or 0),
            max_to_keep=c["max_to_keep"], best_metric=c["best_metric"], best_mode=c["best_mode"],
            async_save=bool(c["async"]), checkfreq_overhead=float(c["checkfreq_overhead"]),
            config=cfg, preemption=self.preemption, snapshot_gb=c.get("snapshot_gb"))
        self.preemption.install()  # after the manager exists: a failure leaves no handler
        if every == "auto" and jax.process_count() > 1:
            _agree_on_saves(self.mgr)
        if self.owned:
            log(f"checkpoints: {checkpoint_dir(cfg)} (checkpoint.dir=auto; checkpoint.dir=null "
                "saves none)")

    def _remove_empty_steps(self) -> None:
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        for p in self.directory.iterdir():
            if p.name.isdigit() and p.is_dir() and not any(p.iterdir()):
                p.rmdir()
                self.log(f"removed {p}: an empty step directory, not a checkpoint")

    def start(self, initial=None):
        """(state, first step): restored when resuming (``resume=auto`` or a step), else fresh
        (from ``initial``, a loader ``trainer.init`` takes, or the model's weights)."""
        latest = self.mgr.latest_step()
        if self.resume not in (None, "auto") and not isinstance(self.resume, int):
            raise ValueError(f"resume={self.resume!r} must be null, auto or a step number")
        if self.resume is None:
            if latest is not None and self.owned:
                self._roll_back(self.mgr.all_steps(), f"a fresh run in {self.directory.parent} "
                                "(resume=null; resume=auto continues instead):")
            elif latest is not None:
                raise ValueError(
                    f"checkpoint.dir={self.mgr.directory} already holds checkpoints (latest "
                    f"step {latest}); pass resume=auto to continue from them, resume=N to go "
                    "back to step N, or use an empty directory")
            return self._fresh(initial)
        if latest is None and self.resume == "auto":
            self.log(f"resume=auto: no checkpoint in {self.mgr.directory}, starting fresh")
            return self._fresh(initial)
        r = self.mgr.restore_all(None if self.resume == "auto" else self.resume)
        newer = [s for s in self.mgr.all_steps() if s > r.step]
        if newer:
            self._roll_back(newer, "rolled back:")
        self.mgr.warm_up(r.state)
        if not hasattr(self.data_iter, "set_state"):
            self.log("warning: this data pipeline cannot be checkpointed; it restarts")
        elif r.data_state is not None:
            self.data_iter.set_state(r.data_state)
        self.skipped_before = int((r.metrics or {}).get("nonfinite_skipped", 0))
        self.log(f"resumed from {self.mgr.directory} at step {r.step} "
                 f"(saved with layout {r.plan['mesh'] if r.plan else '?'})")
        for line in config_changes(r.config, self.cfg):
            self.log(line)
        return r.state, r.step + 1

    def _roll_back(self, newer: list[int], why: str) -> None:
        """Move the steps after the resumed one (all of them, for a fresh run) aside: they
        would block new saves."""
        self.mgr.wait()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest, n = self.directory / ROLLED_BACK / stamp, 1
        while dest.exists():  # two roll-backs within a second
            dest, n = self.directory / ROLLED_BACK / f"{stamp}-{n}", n + 1
        if jax.process_index() == 0:
            dest.mkdir(parents=True, exist_ok=True)
            for s in newer:
                shutil.move(str(self.directory / str(s)), str(dest / str(s)))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("fiddlejax_roll_back")
        self.mgr.reload()
        self.log(f"{why} steps {newer} moved to {dest} (delete it, or move a step back to "
                 "return to it)")

    def _fresh(self, initial=None):
        state = self.trainer.init(initial)
        self.mgr.warm_up(state)
        return state, 1

    def last_good(self) -> int | None:
        """The newest committed step (waits for a write in flight)."""
        try:
            self.mgr.wait()
        except RuntimeError:
            pass
        return self.mgr.latest_step()

    def after_step(self, step: int, state, rec: dict, skipped: bool = False) -> bool:
        """Save if due (interval, CheckFreq, preemption, last step); True when it must stop.
        A ``skipped`` step (its non-finite update was not applied) is saved only when the job
        stops there (preemption, last step): the periodic save waits for an applied step."""
        preempted = self.mgr.reached_preemption(step)
        if skipped and not (preempted or step == self.steps):
            return False
        data_state = self.data_iter.get_state() if hasattr(self.data_iter, "get_state") else None
        self.mgr.save(step, state, force=preempted or step == self.steps,
                      metrics={k: v for k, v in rec.items() if isinstance(v, int | float)},
                      data_state=data_state)
        rec.update(self.mgr.stats())
        if preempted:
            self.mgr.wait()
            self.log(f"preempted: saved step {step} to {self.mgr.directory}; exiting")
        return preempted

    def close(self, quiet: bool = False) -> None:
        """Wait for the last save and release Orbax. ``quiet``: an error is already on its way,
        so a failure here is not raised over it."""
        try:
            self.mgr.close()
        except Exception:
            if not quiet:
                raise


def _agree_on_saves(mgr: CheckpointManager) -> None:
    """Make every process take process 0's CheckFreq decision. Each process times its own
    steps, so their intervals can differ; a save is collective (the canonical conversion and
    Orbax's barriers), and one process saving alone hangs the job."""
    from jax.experimental import multihost_utils

    local = mgr.should_save

    def should_save(step: int) -> bool:
        mine = np.asarray(local(step), dtype=np.int32)
        return bool(multihost_utils.broadcast_one_to_all(mine))

    mgr.should_save = should_save  # save() asks it on every process at the same steps


def for_run(cfg: dict, trainer, data_iter, log: Callable[[str], None] = print
            ) -> JobCheckpoints | None:
    """Checkpointing for ``fiddlejax train``, or None when ``checkpoint.dir`` is null."""
    if not checkpoint_dir(cfg):
        if cfg.get("resume") is not None:
            raise ValueError(f"resume={cfg['resume']!r} needs checkpoint.dir=auto (under "
                             "run.dir) or checkpoint.dir=DIR")
        return None
    return JobCheckpoints(cfg, trainer, data_iter, log)
