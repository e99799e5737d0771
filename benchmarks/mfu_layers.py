"""The layer loop's cost on one device: fiddlejax's step with its layers in a ``scan`` against
the same step unrolled (``Plan(unroll_layers=...)``) and a hand-written ``jit(value_and_grad)``
step, all donating their state, timed alternately in one process (benchmarks/mfu.py's model).

    python benchmarks/mfu_layers.py            # on a GPU (H200: scan 42.6%, unrolled 50.0% MFU)
    python benchmarks/mfu_layers.py --smoke    # tiny shape on the CPU
"""

from __future__ import annotations

import os
import statistics
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    from fiddlejax.app import xla_flags

    xla_flags.apply()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from mfu import GPU_CONFIG, SMOKE_CONFIG, hand_written, peak_flops, timed  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax import models  # noqa: E402
from fiddlejax.models.llama import Llama  # noqa: E402


def main() -> int:
    smoke = "--smoke" in sys.argv
    cfg, batch_size = (SMOKE_CONFIG, 2) if smoke else (GPU_CONFIG, 4)
    steps, rounds = (2, 2) if smoke else (6, 3)
    device = jax.devices()[0]
    model, optimizer = Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-4)
    batch = {"tokens": np.random.default_rng(0).integers(
        0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)}
    runs = {}
    for name, unroll in (("fiddlejax, layers in a scan", False),
                         ("fiddlejax, layers unrolled", True)):
        plan = fj.Plan(mesh=fj.make_mesh(data=1, devices=[device]), compute_dtype="bfloat16",
                       unroll_layers=unroll)
        trainer = fj.parallelize(model, optimizer, plan)
        runs[name] = [trainer.step_function(donate=True), trainer.init(),
                      trainer.shard_batch(batch)]
    step, state = hand_written(model, optimizer, device)
    runs["hand-written jit(value_and_grad)"] = [step, state, jax.device_put(batch, device)]
    times = {name: [] for name in runs}
    for run in runs.values():  # compile and warm up
        run[1], _ = timed(run[0], run[1], run[2], 2)
    for _ in range(rounds):
        for name, run in runs.items():
            run[1], t = timed(run[0], run[1], run[2], steps)
            times[name] += t
    flops = models.get("llama").flops_per_step(model, batch_size)
    peak, base = peak_flops(device), statistics.median(times["hand-written jit(value_and_grad)"])
    print(f"{device.device_kind}; batch {batch_size} x {cfg.seq_len}; {rounds} rounds x {steps} "
          "steps, alternated\n\n| step | s/step | / hand-written | MFU |\n|---|---|---|---|")
    for name, t in times.items():
        s = statistics.median(t)
        mfu = "n/a" if peak is None else f"{100 * flops / s / peak:.1f}%"
        print(f"| {name} | {s:.4f} | {s / base:.3f} | {mfu} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
