"""PipeDream-2BW against 1F1B: the bubble amortized over K unflushed steps, the memory of the
second weight version (``memory_analysis``), and convergence on the stdlib corpus.

    python benchmarks/pipeline_2bw.py [--quick] [--train]

``--train`` runs ``fiddlejax train`` twice (plan.schedule=1f1b and 2bw, everything else the
default run) and compares the final validation losses; it takes two default runs' time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bubbles(p: int = 4, m: int = 4, ks=(1, 2, 4, 8, 16)) -> list[tuple[int, float]]:
    from fiddlejax.pipeline import schedules

    return [(k, schedules.build("2bw", stages=p, microbatches=m, steps=k).bubble_fraction)
            for k in ks]


def memory(quick: bool) -> list[dict]:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import fiddlejax as fj
    from models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=64 if quick else 128, d_model=128, n_heads=4,
                    n_layers=4, d_ff=512)
    mesh = fj.make_mesh(data=2, pipe=2, tensor=2)
    rng = np.random.default_rng(0)
    rows = []
    for kind, k in [("1f1b", 1), ("2bw", 1), ("2bw", 4)]:
        trainer = fj.parallelize(GPT(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3),
                                 fj.Plan(mesh=mesh, schedule=kind, microbatches=4))
        state = trainer.init()
        toks = rng.integers(0, 256, (k, 32, cfg.seq_len + 1), dtype=np.int32)
        if kind == "1f1b":
            compiled = trainer.compiled_step(state, {"tokens": toks[0]})
        else:
            batches = {"tokens": jax.device_put(toks, jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(None, "data")))}
            compiled = trainer._steps.lower(state, batches).compile()
        ma = compiled.memory_analysis()
        param_bytes = sum(x.addressable_shards[0].data.nbytes
                          for x in jax.tree.leaves(state.params))
        rows.append({"schedule": kind, "steps per call": k,
                     "params/device MiB": param_bytes / 2**20,
                     "argument MiB": ma.argument_size_in_bytes / 2**20,
                     "temp MiB": ma.temp_size_in_bytes / 2**20})
    return rows


def train(lr: float) -> dict:
    """Final validation loss of the default run under 1F1B and 2BW (no global-norm clip: 2BW
    updates per stage, so both runs use the same elementwise AdamW)."""
    out = {}
    for kind in ("1f1b", "2bw"):
        run_dir = Path("/tmp/fiddlejax_2bw") / f"{kind}-{lr}"
        subprocess.run([sys.executable, "-m", "fiddlejax.cli", "train", f"plan.schedule={kind}",
                        "plan.virtual_stages=1", "optimizer.clip=0", f"optimizer.lr={lr}",
                        f"run.dir={run_dir}", "run.progress=lines"], check=True, cwd=ROOT)
        out[kind] = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--train", action="store_true", help="also run the two default trainings")
    args = ap.parse_args()
    import jax

    lines = ["# PipeDream-2BW vs 1F1B", "",
             f"jax {jax.__version__}, {jax.default_backend()}; written by "
             f"`python benchmarks/pipeline_2bw.py{' --quick' if args.quick else ''}"
             f"{' --train' if args.train else ''}`.", "",
             "## Bubble (simulator, p=4, m=4 per step, F=1 B=2)", "",
             "| steps per call K | bubble |", "|---|---|"]
    lines += [f"| {k} | {b:.2%} |" for k, b in bubbles()]
    lines += ["", "## Memory per device (GPT d=128, 4 layers, (data, pipe, tensor) = (2, 2, 2), "
              "m=4, AdamW, float32; `memory_analysis()`)", "",
              "| schedule | K | params/device MiB | argument MiB | temp MiB |",
              "|---|---|---|---|---|"]
    for r in memory(args.quick):
        lines.append(f"| {r['schedule']} | {r['steps per call']} | {r['params/device MiB']:.2f} "
                     f"| {r['argument MiB']:.2f} | {r['temp MiB']:.2f} |")
    if args.train:
        lines += ["", "## Convergence (`fiddlejax train plan.schedule=... plan.virtual_stages=1 "
                  "optimizer.clip=0 optimizer.lr=...`, the default run otherwise)", "",
                  "| lr | 1f1b final val loss | 2bw final val loss | gap |", "|---|---|---|---|"]
        for lr in (3e-3, 1e-3):
            v = train(lr)
            lines.append(f"| {lr:g} | {v['1f1b']:.4f} | {v['2bw']:.4f} | "
                         f"{v['2bw'] / v['1f1b'] - 1:+.2%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results" / "pipeline_2bw.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
