"""Peak host memory of one ``fiddlejax train`` process, phase by phase (issue 45's tool).

    python benchmarks/job_phases.py train model.from_pretrained=CKPT plan.zero=3 mesh.data=8 \\
        mesh.pipe=1 mesh.tensor=1 plan.schedule=null plan.microbatches=1 train.steps=1 \\
        data.batch_size=8 model.seq_len=64 train.eval_batches=0 data.tokenizer=bytes

runs the job as ``python -m fiddlejax`` would and prints, on stderr, one ``[phase]`` line at each
boundary (init, each step, the save's conversion, its fingerprints, Orbax's save, close): the
peak resident memory since the previous line (``VmHWM``, reset through ``/proc/self/clear_refs``;
Linux only) and the memory now. Divide by a checkpoint's bytes for the ratios of issue 45.
A checkpoint to try: ``benchmarks/hf_checkpoint_memory.py``'s ``make_checkpoint(dir, layers)``.
"""

from __future__ import annotations

import atexit
import functools
import runpy
import sys
import time
from pathlib import Path

T0 = time.time()


def _memory() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) / 1e6  # kB -> GB
    return out


def mark(name: str) -> None:
    """Print the peak since the last mark and the memory now, then reset the peak."""
    m = _memory()
    print(f"[phase] {time.time() - T0:7.1f}s {name:34s} peak since last {m['VmHWM']:.2f} GB, "
          f"now {m['VmRSS']:.2f} GB", file=sys.stderr, flush=True)
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak (VmHWM)


def marked(owner, name: str, block: bool = False) -> None:
    """Wrap ``owner.name`` so a mark precedes and follows each call (results waited for)."""
    import jax

    fn = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        mark(f"before {label}")
        out = fn(*args, **kwargs)
        if block:
            jax.block_until_ready(out)
        mark(label)
        return out

    setattr(owner, name, wrapped)


def main() -> None:
    import fiddlejax.models  # noqa: F401  (what the job imports, before the first mark)
    from fiddlejax import canonical, train
    from fiddlejax.app import checkpoints
    from fiddlejax.checkpoint import manifest

    mark("import")
    for name in ("init", "step"):
        marked(train.Trainer, name, block=True)
    marked(canonical.Forwarding, "__call__", block=True)  # the save's and restore's conversion
    marked(manifest, "save_summaries", block=True)
    for name in ("start", "after_step", "close"):
        marked(checkpoints.JobCheckpoints, name)
    atexit.register(mark, "exit")
    sys.argv = ["fiddlejax", *sys.argv[1:]]
    runpy.run_module("fiddlejax", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
