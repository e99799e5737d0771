"""Reading a run's checkpoint while its training job saves there (``eval``, ``generate``,
``export`` of a live run).

The job deletes its older steps as it saves (``checkpoint.max_to_keep``): saving every step, a
step lives about ``max_to_keep`` steps, often less than a reader needs to read it. A read that
finds its step deleted is done again on a private snapshot of the newest step: hard links to
its files, in ``<checkpoint.dir>/.fiddlejax-reader-<host>-<pid>/`` (no data copied, and the
job's deletion no longer reaches them), removed when the read ends. The reader writes nothing
else there, deletes nothing of the job's, and takes no lock.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def read(mgr, step: int | None, fn: Callable, tries: int = 5) -> T:
    """``fn(manager, step)`` for ``step`` (None: the latest) of the read-only manager ``mgr``;
    when the job deletes the step meanwhile, ``fn`` again on a snapshot of the newest (or of
    the named step, while it exists)."""
    want = None
    try:
        mgr.reload()
        want = mgr.latest_step() if step is None else step
        return fn(mgr, want)
    except (ValueError, OSError):
        if want is None or not _deleted(mgr, want):
            raise  # not a deletion: the error says what it is
    snap = mgr.directory / f".fiddlejax-reader-{socket.gethostname()}-{os.getpid()}"
    why = ""
    try:
        for _ in range(tries):
            want = _newest(mgr) if step is None else step
            if want is None or not (mgr.directory / str(want)).is_dir():
                break
            shutil.rmtree(snap, ignore_errors=True)
            try:
                shutil.copytree(mgr.directory / str(want), snap / str(want),
                                copy_function=os.link)
            except (shutil.Error, OSError) as e:
                why = f" (a snapshot by hard links failed: {str(e)[:200]})"
                continue  # deleted while linked: the newer one
            import fiddlejax as fj

            pinned = fj.CheckpointManager(snap, mgr.trainer, read_only=True)
            try:
                return fn(pinned, want)
            finally:
                pinned.close()
    finally:
        shutil.rmtree(snap, ignore_errors=True)
    mgr.reload()
    raise FileNotFoundError(
        f"checkpoint step {want} in {mgr.directory} was deleted while it was read, by the job "
        f"saving there (it keeps the newest checkpoint.max_to_keep); its steps now: "
        f"{mgr.all_steps()}{why}")


def _deleted(mgr, step: int) -> bool:
    try:
        mgr.reload()
        return step not in mgr.all_steps()
    except OSError:  # listing while the job deletes
        return not (Path(mgr.directory) / str(step)).is_dir()


def _newest(mgr) -> int | None:
    steps = [int(p.name) for p in Path(mgr.directory).iterdir() if p.name.isdigit()]
    return max(steps) if steps else None
