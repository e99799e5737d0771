"""Pipeline activation memory versus microbatch count, from the compiled step's memory_analysis.

1F1B holds at most p - s microbatches on stage s, so its temp bytes should stay flat as the
microbatch count m grows (the microbatch size is fixed here, so the global batch grows with m);
GPipe holds all m and grows linearly. Writes benchmarks/results/pipeline_memory.md.

    python benchmarks/pipeline_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=8, d_ff=256)
MB = 2  # sequences per microbatch


def temp_bytes(kind: str, p: int, m: int, v: int = 1, remat: str = "none") -> tuple[int, float]:
    """(temp bytes, FLOPs) of one compiled training step on a pipe=p mesh."""
    model = GPT(CFG, rngs=nnx.Rngs(0))
    mesh = fj.make_mesh(data=1, pipe=p, tensor=1, devices=jax.devices()[:p])
    plan = fj.Plan(mesh=mesh, schedule=kind, microbatches=m, virtual_stages=v, remat=remat)
    trainer = fj.parallelize(model, optax.sgd(1e-3), plan)
    batch = {"tokens": np.zeros((m * MB, CFG.seq_len + 1), np.int32)}
    state = jax.eval_shape(trainer.init)
    compiled = trainer.compiled_step(state, batch)
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes), float(compiled.cost_analysis().get("flops", 0.0))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    p = 4
    ms = [4, 8, 16] if args.quick else [4, 8, 16, 32, 64]
    rows = []
    act = MB * CFG.seq_len * CFG.d_model * 4
    for kind, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]:
        for m in ms:
            t, _ = temp_bytes(kind, p, m, v)
            rows.append((kind, v, m, t))
            print(f"{kind:18s} v={v} m={m:3d} temp={t / 2**20:8.2f} MiB", flush=True)
    out = ["# Pipeline temp memory vs microbatches (p=4, GPT d=64, 8 layers, 2 seq/microbatch)",
           "", f"Microbatch activation (one [2, 64, 64] f32 tensor): {act / 2**10:.0f} KiB.",
           "", "| schedule | v | " + " | ".join(f"m={m}" for m in ms) + " | m=max / m=min |",
           "|---|---|" + "---|" * len(ms) + "---|"]
    for kind, v in dict.fromkeys((r[0], r[1]) for r in rows):
        ts = [r[3] for r in rows if r[0] == kind and r[1] == v]
        cells = " | ".join(f"{t / 2**20:.2f} MiB" for t in ts)
        out.append(f"| {kind} | {v} | {cells} | {ts[-1] / ts[0]:.2f}x |")
    path = Path(__file__).parent / "results" / "pipeline_memory.md"
    path.parent.mkdir(exist_ok=True)
    reporting.write(path, "\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
