"""TBD-style benchmark suite: models x layouts x schedules x remat on 8 simulated CPU devices.

For each configuration: compile time, compiled memory (argument + temp) and FLOPs
(``memory_analysis`` / ``cost_analysis``, exact and machine independent), the planner's predicted
memory and its error, the schedule's simulated bubble (unit costs F=1, B=2), and the step-time
ratio against the baseline layout (data=8, no pipeline, no remat) of the same model: the two
steps alternate, median of several rounds (docs/benchmarks.md: ratios only, never absolute CPU
times). tokens/s ratio = 1 / step-time ratio (every configuration trains the same global batch).

Bubble measured: not measured. The 8 simulated devices share this machine's cores, so stages
never run in parallel and a wall-clock bubble would measure the CPU, not the schedule.

    python benchmarks/suite.py [--quick]    # writes benchmarks/results/suite.{md,json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax import planner  # noqa: E402
from fiddlejax.models.bert import BERT, BERTConfig, mlm_batch  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402
from fiddlejax.pipeline import schedules  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GLOBAL_BATCH, MB = 16, 2  # sequences per step; per microbatch
GPT_CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=8, d_ff=256)
BERT_CFG = BERTConfig(seq_len=64, d_model=64, n_heads=4, n_layers=8, d_ff=256)

# (data, pipe, tensor, schedule, virtual_stages, remat)
BASELINE = (8, 1, 1, None, 1, "none")
QUICK = [BASELINE, (2, 2, 2, "1f1b", 1, "none"), (2, 2, 2, "gpipe", 1, "none"),
         (1, 4, 2, "1f1b", 1, "full")]
FULL = [BASELINE, (8, 1, 1, None, 1, "full"), (4, 1, 2, None, 1, "none")] + [
    (d, p, t, s, v, r)
    for d, p, t in ((2, 2, 2), (1, 4, 2))
    for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))
    for r in ("none", "full")
]


def build(model_name: str, cfg: tuple):
    d, p, t, sched, v, remat = cfg
    m = GLOBAL_BATCH // (d * MB)
    if model_name == "gpt":
        model = GPT(GPT_CFG, rngs=nnx.Rngs(0))
        tokens = np.random.default_rng(0).integers(0, 256, (GLOBAL_BATCH, GPT_CFG.seq_len + 1))
        batch = {"tokens": tokens.astype(np.int32)}
        spec = planner.gpt(8, 64, 4, 64, 256)
    else:
        model = BERT(BERT_CFG, rngs=nnx.Rngs(0))
        tokens = np.random.default_rng(0).integers(0, 256, (GLOBAL_BATCH, BERT_CFG.seq_len))
        batch = mlm_batch(tokens, BERT_CFG, 0)
        spec = None
    mesh = fj.make_mesh(data=d, pipe=p, tensor=t)
    plan = fj.Plan(mesh=mesh, schedule=sched, microbatches=m, virtual_stages=v, remat=remat)
    trainer = fj.parallelize(model, optax.adamw(1e-3), plan)
    return trainer, batch, spec, m


def measure(model_name: str, cfg: tuple) -> dict:
    d, p, t, sched, v, remat = cfg
    trainer, batch, spec, m = build(model_name, cfg)
    state = trainer.init()
    t0 = time.perf_counter()
    compiled = trainer.compiled_step(jax.eval_shape(trainer.init), batch)
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    device = int(mem.argument_size_in_bytes + mem.temp_size_in_bytes)
    row = {"model": model_name, "data": d, "pipe": p, "tensor": t, "schedule": sched or "-",
           "virtual": v, "remat": remat, "microbatches": m, "compile_s": compile_s,
           "temp_mib": mem.temp_size_in_bytes / 2**20, "device_mib": device / 2**20,
           "flops": float(cost.get("flops", 0.0)),
           "bubble_simulated": (schedules.build(sched, stages=p, microbatches=m,
                                                virtual_stages=v).bubble_fraction
                                if p > 1 else 0.0),
           "bubble_measured": None}
    if spec is not None:
        lo = planner.Layout(tensor=t, pipe=p, data=d, virtual_stages=v, microbatch_size=MB,
                            global_batch=GLOBAL_BATCH, schedule=sched, remat=remat,
                            attention="xla")
        pred = planner.memory(spec, lo).total
        row["predicted_mib"] = pred / 2**20
        row["memory_error"] = pred / device - 1
    return row, trainer, state, batch


def timed(trainer, state, batch) -> tuple[float, object]:
    t0 = time.perf_counter()
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics["loss"])
    return time.perf_counter() - t0, state


def run_model(model_name: str, configs: list, rounds: int) -> list[dict]:
    rows = []
    base_row, base_tr, base_state, base_batch = measure(model_name, configs[0])
    _, base_state = timed(base_tr, base_state, base_tr.shard_batch(base_batch))  # warm up
    base_row["step_ratio"] = base_row["tokens_ratio"] = 1.0
    rows.append(base_row)
    print(f"{model_name} baseline compiled in {base_row['compile_s']:.1f}s", flush=True)
    for cfg in configs[1:]:
        row, tr, state, batch = measure(model_name, cfg)
        sb = tr.shard_batch(batch)
        bb = base_tr.shard_batch(base_batch)
        _, state = timed(tr, state, sb)
        ratios = []
        for _ in range(rounds):  # alternate: the two steps see the same machine load
            a, state = timed(tr, state, sb)
            b, base_state = timed(base_tr, base_state, bb)
            ratios.append(a / b)
        row["step_ratio"] = statistics.median(ratios)
        row["tokens_ratio"] = 1.0 / row["step_ratio"]
        rows.append(row)
        print(f"{model_name} {cfg}: compile {row['compile_s']:.1f}s temp {row['temp_mib']:.2f} "
              f"MiB step x{row['step_ratio']:.2f}", flush=True)
    return rows


def markdown(rows: list[dict], quick: bool, wall: float) -> str:
    out = [f"# Benchmark suite ({'--quick' if quick else 'full'}; {wall:.0f} s on this machine)",
           "", f"Global batch {GLOBAL_BATCH} sequences, {MB} per microbatch, AdamW, 8 simulated "
           "CPU devices. Step and tokens/s are ratios to the model's baseline (data=8, no "
           "pipeline, no remat), alternating, median. Memory = argument + temp bytes of the "
           "compiled step; predicted = `fiddlejax.planner.memory` (GPT only). Bubble measured: "
           "not measured (simulated devices share the CPU cores; stages never overlap). GFLOPs: "
           "`cost_analysis` counts a scan body once, so pipelined and unpipelined programs are "
           "not comparable on it.", "",
           "| model | d,p,t | schedule | v | remat | m | compile s | temp MiB | device MiB | "
           "predicted MiB | error | GFLOPs | bubble (sim) | step ratio | tokens/s ratio |",
           "|" + "---|" * 15]
    for r in rows:
        pred = f"{r['predicted_mib']:.2f}" if "predicted_mib" in r else "-"
        err = f"{r['memory_error']:+.1%}" if "memory_error" in r else "-"
        out.append(
            f"| {r['model']} | {r['data']},{r['pipe']},{r['tensor']} | {r['schedule']} | "
            f"{r['virtual']} | {r['remat']} | {r['microbatches']} | {r['compile_s']:.1f} | "
            f"{r['temp_mib']:.2f} | {r['device_mib']:.2f} | {pred} | {err} | "
            f"{r['flops'] / 1e9:.2f} | {r['bubble_simulated']:.1%} | {r['step_ratio']:.2f} | "
            f"{r['tokens_ratio']:.2f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} {r['data']},{r['pipe']},{r['tensor']} {r['schedule']}"
              f"{' v2' if r['virtual'] > 1 else ''} {r['remat']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.5))
    y = np.arange(len(rows))
    axes[0].barh(y, [r["device_mib"] for r in rows], label="compiled")
    axes[0].scatter([r.get("predicted_mib", np.nan) for r in rows], y, color="k", zorder=3,
                    label="planner")
    axes[0].set_xlabel("MiB per device")
    axes[0].legend()
    axes[1].barh(y, [r["step_ratio"] for r in rows], color="tab:orange")
    axes[1].axvline(1.0, color="k", lw=0.8)
    axes[1].set_xlabel("step time / baseline (CPU, ratio)")
    for ax in axes:
        ax.set_yticks(y, labels if ax is axes[0] else [""] * len(rows), fontsize=8)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="GPT, 4 configurations (minutes)")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    configs = QUICK if args.quick else FULL
    models = ["gpt"] if args.quick else ["gpt", "bert"]
    rounds = args.rounds or (3 if args.quick else 5)
    rows = [r for name in models for r in run_model(name, configs, rounds)]
    wall = time.perf_counter() - t0
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "suite.json").write_text(json.dumps(rows, indent=1))
    reporting.write((RESULTS / "suite.md"), markdown(rows, args.quick, wall))
    plot(rows, RESULTS / "suite.png")
    print(markdown(rows, args.quick, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
