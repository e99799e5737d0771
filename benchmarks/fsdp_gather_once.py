"""FSDP through a pipeline: gather each layer per microbatch (fiddlejax) or once per step
(MaxText's ``pipeline_fsdp_ag_once``)?

Per microbatch, each layer's weights are all-gathered over ``data`` for the forward and again for
the backward, and its gradient reduce-scattered: m times the traffic of gathering once, but
nothing is held gathered beyond one layer. Gathering once holds a stage's weights gathered (in
the compute dtype) and its gradient at full size (float32, reduce-scattered once after the last
microbatch) for the whole step. This script prices both with the planner's model (its FSDP
traffic term and its memory, which is within 15% of compiled steps: ``benchmarks/scale.py``) on
the layouts users of FSDP through a pipeline run, and writes
``benchmarks/results/fsdp_gather_once.md``.

    python benchmarks/fsdp_gather_once.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from fiddlejax import planner
from fiddlejax.planner.predict import stage_params

GIB = 2**30
SEQ = 4096
CASES = [  # (model, GPUs, layout): the scale benchmark's picks, issue 16's 70B layout, a ~1B
    ("llama3-8b", planner.llama(32, 4096, 32, 8, 14336, SEQ, 128256, name="llama3-8b"),
     planner.Layout(tensor=2, pipe=2, data=2, microbatch_size=1, global_batch=32)),
    ("llama3-70b", planner.llama(80, 8192, 64, 8, 28672, SEQ, 128256, name="llama3-70b"),
     planner.Layout(tensor=8, pipe=4, data=2, microbatch_size=4, global_batch=128)),
    ("llama3-70b", planner.llama(80, 8192, 64, 8, 28672, SEQ, 128256, name="llama3-70b"),
     planner.Layout(tensor=2, pipe=2, data=16, microbatch_size=2, global_batch=128)),
    ("llama-1b", planner.llama(16, 2048, 32, 8, 8192, SEQ, 128256, name="llama-1b"),
     planner.Layout(tensor=1, pipe=2, data=4, microbatch_size=1, global_batch=64)),
]
COMMON = dict(schedule="1f1b", remat="full", zero=3, precision="bf16-mixed")


def compare(model: planner.ModelSpec, layout: planner.Layout) -> dict:
    """Step time and memory per GPU of both gathering strategies on H100 80 GB nodes."""
    layout = dataclasses.replace(layout, **COMMON)
    cluster = planner.cluster("h100", nodes=max(1, layout.gpus // 8))
    pr = planner.predict(model, cluster, layout)
    m, d = layout.microbatches, layout.data
    once_comm = pr.time.data_comm / m  # one gather and one reduce-scatter instead of m
    held = stage_params(model, layout) * (2 + 4) * (1 - 1 / d)  # bf16 weights + f32 grads
    once_time = pr.time.total - pr.time.data_comm_exposed + once_comm
    once_mem = pr.memory.total + held
    return {"layout": layout.short(), "m": m, "per_mb_time": pr.time.total,
            "per_mb_comm": pr.time.data_comm, "per_mb_mem": pr.memory.total,
            "once_time": once_time, "once_mem": once_mem,
            "fits": once_mem <= cluster.memory_budget, "budget": cluster.memory_budget}


def main() -> int:
    rows = ["# FSDP through a pipeline: gather per microbatch or once per step", "",
            "Reproduce: `python benchmarks/fsdp_gather_once.py` (planner model, H100 80 GB, "
            f"seq {SEQ}, bf16, zero=3, full remat, 1f1b). Gathering once saves (m-1)/m of the "
            "FSDP traffic and holds a stage's weights gathered (bf16) and its gradient "
            "unsharded (float32) for the whole step.", "",
            "| model | layout | m | per microbatch: step, FSDP traffic, memory | once: step, "
            "memory | time saved | fits 90% of 80 GiB |", "|---|---|---|---|---|---|---|"]
    for name, model, layout in CASES:
        r = compare(model, layout)
        saved = 1 - r["once_time"] / r["per_mb_time"]
        rows.append(
            f"| {name} | {r['layout']} | {r['m']} | {r['per_mb_time']:.2f} s, "
            f"{r['per_mb_comm']:.2f} s, {r['per_mb_mem'] / GIB:.1f} GiB | "
            f"{r['once_time']:.2f} s, {r['once_mem'] / GIB:.1f} GiB | {saved:.1%} | "
            f"{'yes' if r['fits'] else 'no'} |")
        print(rows[-1], flush=True)
    path = Path(__file__).parent / "results" / "fsdp_gather_once.md"
    path.write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
