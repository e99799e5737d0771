"""Compiled FLOPs of the pipelined step against the unpipelined step, per schedule and stage.

A pipeline must not repeat or mask work: summed over its stages, the compiled training step
should do the model math of one unpipelined step, no more. XLA's ``cost_analysis`` counts a
``while`` body once and a ``conditional`` as its costliest branch, so the real step (a scan over
ticks around a per-tick switch) cannot be measured directly; ``Pipeline.stage_flops`` compiles
each stage's program from the same branch functions, dispatched statically tick by tick with
every layer loop unrolled (``data = tensor = 1``). The reference, ``costs.unpipelined_flops``, is
the same model's ``value_and_grad`` on one device, layers unrolled, same remat policy.

Two counts: matrix-multiply FLOPs (``costs.hlo_dot_flops``: every ``dot`` of the optimized HLO,
the model math) and ``cost_analysis()["flops"]`` (elementwise work included; it moves with XLA's
fusion choices, so its ratio is reported, not asserted). Writes
benchmarks/results/pipeline_flops.md.

    python benchmarks/pipeline_flops.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# LLVM optimization off: the counts come from the optimized HLO and are identical (checked),
# the compiles take half the time.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.memory import policies  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402
from fiddlejax.pipeline import costs  # noqa: E402

QUICK = dict(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=8, d_ff=64)
FULL = dict(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=8, d_ff=256)
MB = 2  # sequences per microbatch
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]
TOL = 0.02  # matmul FLOPs over stages / unpipelined


def batch_of(cfg: GPTConfig, m: int) -> dict:
    rng = np.random.default_rng(m)
    return {"tokens": rng.integers(0, cfg.vocab_size, (m * MB, cfg.seq_len + 1), np.int32)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cfg = GPTConfig(**(QUICK if args.quick else FULL))
    model = GPT(cfg, rngs=nnx.Rngs(0))
    # --quick: m = p, and remat full only on p = 2 (12 configurations instead of 32).
    configs = [(p, remat, kind, v, m) for p in (2, 4) for remat in ("none", "full")
               for kind, v in SCHEDULES for m in (p, 2 * p)
               if not args.quick or (m == p and (p == 2 or remat == "none"))]
    refs: dict[tuple[int, str], dict] = {}
    rows = []
    t0 = time.perf_counter()
    for p, remat, kind, v, m in configs:
        mesh = fj.make_mesh(data=1, pipe=p, tensor=1, devices=jax.devices()[:p])
        plan = fj.Plan(mesh=mesh, schedule=kind, microbatches=m, virtual_stages=v, remat=remat)
        trainer = fj.parallelize(model, optax.sgd(0.1), plan)
        batch = batch_of(cfg, m)
        if (m, remat) not in refs:  # the reference depends on the batch and remat only
            refs[m, remat] = costs.unpipelined_flops(
                trainer.staged, nnx.state(model, nnx.Param), batch,
                lambda f, remat=remat: policies.remat_layer(f, remat))
        ref = refs[m, remat]
        stages = trainer.stage_flops(jax.eval_shape(trainer.init), batch)
        dot = sum(s["dot_flops"] for s in stages) / ref["dot_flops"]
        allf = sum(s["flops"] for s in stages) / ref["flops"]
        share = [s["dot_flops"] / ref["dot_flops"] for s in stages]
        rows.append((p, kind, v, m, remat, dot, allf, share))
        print(f"p={p} {kind:16s} v={v} m={m} remat={remat:4s} matmul {dot:.4f} all {allf:.4f} "
              "stages " + " ".join(f"{x:.3f}" for x in share)
              + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
    worst = max(abs(r[5] - 1) for r in rows)
    c = cfg
    out = [
        "# Pipeline FLOPs: compiled per-stage programs vs the unpipelined step", "",
        f"`python benchmarks/pipeline_flops.py{' --quick' if args.quick else ''}` "
        f"(jax {jax.__version__}, CPU). GPT vocab {c.vocab_size}, seq {c.seq_len}, d "
        f"{c.d_model}, {c.n_heads} heads, d_ff {c.d_ff}, {c.n_layers} layers; {MB} sequences "
        "per microbatch; mesh data=1 x pipe=p x tensor=1.", "",
        "Each stage's whole step is compiled as its own program (`Pipeline.stage_flops`): the "
        "same branch functions as the real step, dispatched statically tick by tick, layer "
        "loops unrolled, because XLA's cost analysis counts a `while` body once and a "
        "`conditional` as its costliest branch. The reference is `value_and_grad` of the same "
        "model on one device (`costs.unpipelined_flops`), layers unrolled, same remat.", "",
        "- matmul: sum over stages of the HLO `dot` FLOPs / the unpipelined step's "
        f"(must be within {TOL:.0%}).",
        "- all: the same with `cost_analysis()['flops']`, elementwise work included (moves with "
        "XLA's fusion choices).",
        "- per stage: each stage's matmul FLOPs / the unpipelined step's, stage 0 first. The "
        "last stage also runs the head (a matmul) and the loss; stage 0's embedding is a "
        "gather, with no matmul FLOPs.", "",
        "| p | schedule | v | m | remat | matmul ratio | all-FLOPs ratio | per stage (matmul) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p, kind, v, m, remat, dot, allf, share in rows:
        out.append(f"| {p} | {kind} | {v} | {m} | {remat} | {dot:.4f} | {allf:.4f} | "
                   + " / ".join(f"{x:.3f}" for x in share) + " |")
    out += ["", f"Largest matmul deviation: {worst:.2e}. "
            f"All-FLOPs ratio range: {min(r[6] for r in rows):.4f} to "
            f"{max(r[6] for r in rows):.4f}. Wall time {time.perf_counter() - t0:.0f} s."]
    path = Path(__file__).parent / "results" / "pipeline_flops.md"
    path.parent.mkdir(exist_ok=True)
    reporting.write(path, "\n".join(out) + "\n")
    print("\n".join(out))
    return 0 if worst < TOL else 1


if __name__ == "__main__":
    sys.exit(main())
