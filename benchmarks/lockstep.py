"""What running a pipeline's layer loops in lockstep costs (fiddlejax/pipeline/lockstep.py).

A tensor split that makes GSPMD reshard inside a layer (a fused q|k|v kernel split over
``tensor``) puts collective-permutes in the layer loops, which every device must reach: the
executor then runs every stage's loops whenever any stage runs them. This measures that cost on
one program: nanoGPT (``tests/external/nanogpt``) with its MLP split over ``tensor`` (which needs
no lockstep) on data=2 x pipe=2 x tensor=2, 1F1B, against the very same program with lockstep
forced on. Steps alternate in one run; the median ratio is reported. (Compiled FLOPs cannot
show it: a ``while`` body, here one tick, is counted once whatever its loops' trip counts.)

    python benchmarks/lockstep.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.pipeline import lockstep  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MLP_NAMES = {r"mlp/c_fc/kernel": ("embed", "mlp"), r"mlp/c_fc/bias": ("mlp",),
             r"mlp/c_proj/kernel": ("mlp", "embed")}


def nanogpt(n_layer: int, d: int, seq: int):
    spec = importlib.util.spec_from_file_location(
        "nanogpt_model", ROOT / "tests" / "external" / "nanogpt" / "model.py")
    gpt = sys.modules["nanogpt_model"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    cfg = gpt.GPTConfig(block_size=seq, vocab_size=256, n_layer=n_layer, n_head=4, n_embd=d,
                        dropout=0.0)
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    fj.sharding.annotate(model, MLP_NAMES)
    return model


def ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def build(model, batch, forced: bool):
    plan = fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule="1f1b", microbatches=4)
    trainer = fj.parallelize(model, optax.sgd(1e-3), plan, loss=fj.next_token(ce), layers="h")
    state = trainer.init()
    sb = trainer.shard_batch(batch)
    with mock.patch.object(lockstep, "needs_lockstep", lambda *a, **k: True) if forced \
            else mock.patch.object(lockstep, "unsafe_collectives", lockstep.unsafe_collectives):
        state, _ = trainer.step(state, sb)  # remat='auto' picks its policy on the first step
        step = trainer.step_function()
        compiled = step.lower(state, sb).compile()
    return compiled, state, sb


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats = 5 if args.quick else 20
    n_layer, d, seq, b = 4, 128, 64, 16
    model = nanogpt(n_layer, d, seq)
    batch = {"tokens": np.random.default_rng(0).integers(0, 256, (b, seq + 1)).astype(np.int32)}
    runs = {name: build(model, batch, forced) for name, forced in
            (("free", False), ("lockstep", True))}
    times = {name: [] for name in runs}
    for step, state, sb in runs.values():
        jax.block_until_ready(step(state, sb))
    for _ in range(repeats):
        for name, (step, state, sb) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, sb))
            times[name].append(time.perf_counter() - t0)
    ratio = statistics.median(times["lockstep"]) / statistics.median(times["free"])
    lines = [
        "# The cost of lockstep layer loops (CPU, 8 simulated devices)", "",
        f"nanoGPT {n_layer} layers, d={d}, seq {seq}, batch {b}; data=2 x pipe=2 x tensor=2, "
        f"1F1B, 4 microbatches; MLP split over tensor; {repeats} alternating steps each.", "",
        "| lockstep / free step time (median) |", "|---|", f"| {ratio:.3f} |", "",
        "Lockstep runs, every tick, each loop that any stage runs (results of the loops a stage",
        "would have skipped are discarded), so its extra work is the compute of the ticks a stage",
        "idles in the schedule's bubble and of the actions other stages run beside its own.",
        "Avoid it by splitting q, k and v as separate kernels over heads, or by leaving a fused",
        "q|k|v kernel (and its output projection) replicated, as inferred names do."]
    out = ROOT / "benchmarks" / "results" / "lockstep.md"
    reporting.write(out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
