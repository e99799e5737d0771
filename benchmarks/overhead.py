"""Trainer overhead: fiddlejax on one device against a hand-written ``jax.jit`` train step.

Same model, optimizer and batch; the two steps alternate in one run and we report the median
step-time ratio (fiddlejax / hand-written; target <= 1.03). Writes benchmarks/results/overhead.md.

    python benchmarks/overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.models.common import scan_layers  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=4, d_ff=512)


def hand_written(model, opt):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p, batch):
        m = nnx.merge(graphdef, p)
        x = scan_layers(m.blocks, m.embed(batch["tokens"][:, :-1]))
        return m.loss(m.head(x), batch)

    @jax.jit
    def step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step, params, opt.init(params)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 10 if args.quick else 40
    model = GPT(CFG, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-3)
    batch = {"tokens": np.random.default_rng(0).integers(0, 256, (16, CFG.seq_len + 1))
             .astype(np.int32)}
    step, params, opt_state = hand_written(model, opt)
    mesh = fj.make_mesh(data=1, devices=jax.devices()[:1])
    trainer = fj.parallelize(model, opt, fj.Plan(mesh=mesh))
    state = trainer.init()
    sb = trainer.shard_batch(batch)
    fj_step = trainer.step_function()  # same program as trainer.step, without donation

    def run_hand():
        jax.block_until_ready(step(params, opt_state, batch))

    def run_fj():
        jax.block_until_ready(fj_step(state, sb))

    run_hand()
    run_fj()
    t_hand, t_fj = [], []
    for _ in range(repeats):
        for fn, acc in ((run_fj, t_fj), (run_hand, t_hand)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    ratio = statistics.median(t_fj) / statistics.median(t_hand)
    lines = ["# Trainer overhead (one CPU device)", "",
             f"GPT d=128, 4 layers, seq 128, batch 16, adamw; {repeats} alternating steps each.",
             "", "| fiddlejax / hand-written jit step (median) |", "|---|", f"| {ratio:.3f} |"]
    out = Path(__file__).parent / "results" / "overhead.md"
    out.parent.mkdir(exist_ok=True)
    reporting.write(out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
