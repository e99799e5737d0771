"""What a ``fiddlejax train`` run writes before its first step, taken back when it is refused.

A run refused before its first step completes (a pre-flight check, a shape the model cannot
take, a data error) must not leave a run directory behind that looks like a run (config.yaml,
an empty metrics.jsonl, TensorBoard files, an empty checkpoints/), nor overwrite an earlier
run's config.yaml or metrics.jsonl. :class:`Artifacts` notes what existed when the job began;
:meth:`Artifacts.remove` deletes what this run created and restores what it rewrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fiddlejax.app.config import checkpoint_dir

FILES = ("config.yaml", "metrics.jsonl", "summary.json")
EVENTS = "events.out.tfevents*"


class Artifacts:
    """The run directory's and checkpoint directory's state when the job began."""

    def __init__(self, cfg: dict):
        self.run_dir = Path(cfg["run"]["dir"])
        ckpt = checkpoint_dir(cfg)
        self.ckpt = Path(ckpt) if ckpt else None
        self.new_dirs = [d for d in (self.run_dir, self.ckpt) if d is not None and not d.exists()]
        self.files = {self.run_dir / n: (self.run_dir / n).read_bytes()
                      if (self.run_dir / n).is_file() else None for n in FILES}
        self.events = set(self.run_dir.glob(EVENTS))
        self.kept = False  # set once a step has run: from then on the run's files are its own

    def remove(self) -> list[Path]:
        """Delete what this run created and restore the files it rewrote; what it removed."""
        if self.kept:
            return []
        gone = []
        for d in self.new_dirs:
            if d.exists() and not any(s.name.isdigit() for s in d.glob("*")):
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d)
        if self.run_dir.is_dir():
            for path, old in self.files.items():
                if old is None and path.exists():
                    path.unlink()
                    gone.append(path)
                elif old is not None and path.read_bytes() != old:
                    path.write_bytes(old)
            for e in set(self.run_dir.glob(EVENTS)) - self.events:
                e.unlink(missing_ok=True)
                gone.append(e)
        return gone
