"""FSDP through a pipeline: gather each layer per microbatch, or a stage once per step?

``fj.Plan(zero=3)`` gathers each layer's weights over ``data`` just before each use, forward
and backward, every microbatch, and reduce-scatters its gradient each time (``fsdp_gather=
"layer"``): nothing is held gathered beyond one layer. ``fsdp_gather="step"`` (MaxText's
``pipeline_fsdp_ag_once``) gathers a stage's weights once per step in the compute dtype and
reduce-scatters its gradient, summed over the microbatches in float32 at full size, once after
the last: 1/m of the traffic, for the stage's weights and gradient held whole through the step.

Two sections, written to ``benchmarks/results/fsdp_gather_once.md``:

1. Priced with the planner (``fsdp_gather`` is a ``planner.Layout`` field: its FSDP traffic
   term and its memory) on H100 80 GB nodes, seq 4096, bf16, full remat, 1f1b, on the layouts
   users of FSDP through a pipeline run.
2. Compiled (``--compile``): a ~1B Llama shape built abstractly (``nnx.eval_shape``), one
   training step compiled on 8 simulated CPU devices in both modes: ``trainer.memory`` beside
   the planner's prediction, and the all-gathers and reduce-scatters inside the step's loops
   (per microbatch) against outside them (once). float32, because XLA's CPU keeps a float32
   copy of bf16 weights held across its loops (a GPU holds them in bf16).

    python benchmarks/fsdp_gather_once.py [--compile]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

if __name__ == "__main__":  # before jax is imported: 8 simulated devices for the compile
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import reporting  # noqa: E402

from fiddlejax import planner  # noqa: E402

GIB = 2**30
SEQ = 4096
LLAMA_8B = planner.llama(32, 4096, 32, 8, 14336, SEQ, 128256, name="llama3-8b")
LLAMA_70B = planner.llama(80, 8192, 64, 8, 28672, SEQ, 128256, name="llama3-70b")
LLAMA_1B = planner.llama(16, 2048, 32, 8, 8192, SEQ, 128256, name="llama-1b")
CASES = [  # (model, layout): the scale benchmark's picks, a wide-FSDP 70B layout, a ~1B
    (LLAMA_8B, planner.Layout(tensor=2, pipe=2, data=2, microbatch_size=1, global_batch=32)),
    (LLAMA_70B, planner.Layout(tensor=8, pipe=4, data=2, microbatch_size=4, global_batch=128)),
    (LLAMA_70B, planner.Layout(tensor=2, pipe=2, data=16, microbatch_size=2, global_batch=128)),
    (LLAMA_1B, planner.Layout(tensor=1, pipe=2, data=4, microbatch_size=1, global_batch=64)),
]
COMMON = dict(schedule="1f1b", remat="full", zero=3, precision="bf16-mixed",
              attention="xla")  # as the results were priced: XLA's attention
GATHERS = ("layer", "step")


def priced(model: planner.ModelSpec, layout: planner.Layout) -> dict:
    """The planner's step time, FSDP traffic and memory per GPU of both modes on H100s."""
    cluster = planner.cluster("h100", nodes=max(1, layout.gpus // 8))
    out = {"layout": dataclasses.replace(layout, **COMMON).short(), "m": layout.microbatches,
           "budget": cluster.memory_budget}
    for g in GATHERS:
        pr = planner.predict(model, cluster, dataclasses.replace(layout, **COMMON, fsdp_gather=g))
        out[g] = {"time": pr.time.total, "comm": pr.time.data_comm, "memory": pr.memory.total,
                  "fits": pr.fits}
    return out


def collectives_in_loops(hlo: str) -> dict[str, tuple[int, int]]:
    """``{op: (in the whole program, inside loops)}`` for all-gathers and reduce-scatters of a
    compiled module's text: a collective inside a ``while`` body runs per iteration (per
    microbatch or tick), one outside runs once per step."""
    blocks = {}
    for block in re.split(r"\n(?=\S)", hlo):
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if name:
            blocks[name.group(1)] = block
    called = r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
    inside = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    todo = list(inside)
    while todo:
        text = blocks.get(todo.pop(), "")
        found = re.findall(called, text)
        for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
            found += re.findall(r"%?([\w.\-]+)", group)
        for name in found:
            if name not in inside:
                inside.add(name)
                todo.append(name)
    out = {}
    for op in ("all-gather", "reduce-scatter"):
        pattern = re.compile(rf"= [^=\n]*? {op}(?:-start)?\(")
        out[op] = (sum(len(pattern.findall(b)) for b in blocks.values()),
                   sum(len(pattern.findall(blocks[n])) for n in inside if n in blocks))
    return out


def compiled(model: planner.ModelSpec, layout: planner.Layout, config) -> dict:
    """One step of ``models.llama.Llama(config)`` (abstract) in ``layout``: the compiled
    per-device peak, the planner's prediction and the collectives inside loops."""
    import jax
    import optax
    from flax import nnx

    import fiddlejax as fj
    from fiddlejax.models.llama import Llama

    net = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    mesh = fj.make_mesh(data=layout.data, pipe=layout.pipe, tensor=layout.tensor,
                        devices=jax.devices()[:layout.gpus])
    plan = fj.Plan(mesh=mesh, schedule=layout.kind, microbatches=layout.microbatches,
                   remat=layout.remat, zero=3, fsdp_gather=layout.fsdp_gather,
                   compute_dtype="bfloat16" if layout.precision == "bf16-mixed" else "float32")
    trainer = fj.parallelize(net, optax.adamw(1e-4), plan)
    batch = {"tokens": jax.ShapeDtypeStruct((layout.global_batch, config.seq_len + 1), "int32")}
    hlo = trainer.lower_step(trainer.abstract_state(), batch).compile().as_text()
    peak = trainer.memory(layout.global_batch)["peak_bytes"]
    return {"compiled": peak, "predicted": planner.memory(model, layout).total,
            "collectives": collectives_in_loops(hlo)}


def priced_rows() -> list[str]:
    rows = ["| model | layout | m | per layer: step, FSDP traffic, memory | once per step: "
            "step, FSDP traffic, memory | time saved | once fits 90% of 80 GiB |",
            "|---|---|---|---|---|---|---|"]
    for model, layout in CASES:
        r = priced(model, layout)
        a, b = r["layer"], r["step"]
        rows.append(
            f"| {model.name} | {r['layout']} | {r['m']} | {a['time']:.2f} s, {a['comm']:.2f} s, "
            f"{a['memory'] / GIB:.1f} GiB | {b['time']:.2f} s, {b['comm']:.3f} s, "
            f"{b['memory'] / GIB:.1f} GiB | {1 - b['time'] / a['time']:.1%} | "
            f"{'yes' if b['fits'] else 'no'} |")
        print(rows[-1], flush=True)
    return rows


def compiled_rows(seq: int) -> list[str]:
    from fiddlejax.models.llama import LlamaConfig

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         seq_len=seq, max_position_embeddings=max(seq, 8192))
    model = planner.llama(16, 2048, 32, 8, 8192, seq, 128256, name="llama-1b")
    rows = ["| fsdp_gather | layout | predicted | compiled | error | all-gathers: all, in "
            "loops | reduce-scatters: all, in loops |", "|---|---|---|---|---|---|---|"]
    for g in GATHERS:
        layout = planner.Layout(tensor=1, pipe=2, data=4, microbatch_size=1, global_batch=32,
                                schedule="1f1b", remat="full", zero=3, fsdp_gather=g,
                                attention="xla")
        r = compiled(model, layout, config)
        ag, rs = r["collectives"]["all-gather"], r["collectives"]["reduce-scatter"]
        rows.append(f"| {g} | {layout.short()} | {r['predicted'] / GIB:.2f} GiB | "
                    f"{r['compiled'] / GIB:.2f} GiB | {r['predicted'] / r['compiled'] - 1:+.1%}"
                    f" | {ag[0]}, {ag[1]} | {rs[0]}, {rs[1]} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile", action="store_true",
                    help="also compile a ~1B Llama step in both modes on 8 CPU devices")
    ap.add_argument("--seq", type=int, default=1024, help="sequence length of the compile")
    a = ap.parse_args()
    out = ["# FSDP through a pipeline: gather per layer or once per step", "",
           f"Reproduce: `python benchmarks/fsdp_gather_once.py{' --compile' if a.compile else ''}`"
           f". Planner, H100 80 GB, seq {SEQ}, bf16, zero=3, full remat, 1f1b; FSDP traffic "
           "counted as exposed. Once per step: one all-gather and one reduce-scatter of the "
           "stage's weights instead of m of each (and m more gathers in the backward), for "
           "the stage's weights (bf16) and gradient (float32) held whole.", "",
           *priced_rows()]
    if a.compile:
        out += ["", f"Compiled on 8 simulated CPU devices: a ~1B Llama (16 layers, hidden 2048, "
                f"vocabulary 128256), seq {a.seq}, float32, 8 microbatches per replica; "
                "`trainer.memory` peak per device beside the planner's prediction:", "",
                *compiled_rows(a.seq)]
    path = Path(__file__).parent / "results" / "fsdp_gather_once.md"
    reporting.write(path, "\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
