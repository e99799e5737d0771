"""Pipeline runtime efficiency: per-tick traffic, the stash against its bound, step time.

Three tables (GPT, 8 layers, p=4 on simulated CPU devices, 4 sequences of 64 tokens per
microbatch), written to benchmarks/results/pipeline_efficiency.md:

1. **Bytes per tick vs m.** ``cost_analysis()`` counts a loop body once, so the difference
   between the step compiled with two ticks per scan iteration and with one is exactly one
   tick's ``bytes accessed``. It must not grow with the microbatch count m (the buffers are
   updated in place). The whole step's figure is shown too: it also counts the one-time
   zeroing of the stash, which does grow with GPipe's m.
2. **Stash slope against its bound.** Temp bytes per layer per stage (8 -> 16 layers), divided
   by (the stage's peak held microbatches) x (one layer's residual bytes under plain
   ``jax.value_and_grad`` on one device, same policy, same microbatch).
3. **Step time** of the pipelined step against a single-device ``jax.value_and_grad`` + SGD
   step on the same global batch, alternating, median of several, at m = p, 2p, 4p; then every
   kind against 1F1B at m = 4p, all of them alternating in one loop.

Tables 1 and 2 run each schedule as written (split backwards as on a GPU); table 3 as the
runtime runs it here (on the CPU a split schedule runs each I with its W as one backward).

    python benchmarks/pipeline_efficiency.py [--quick] [--only bytes,stash,time]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.adaptation.split import split_model  # noqa: E402
from fiddlejax.memory import policies  # noqa: E402
from fiddlejax.models.common import scan_layers  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402

P_STAGES, MB, SEQ = 4, 4, 64
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2),
         ("interleaved-zb", 2)]


def config(d: int, layers: int = 8) -> GPTConfig:
    return GPTConfig(vocab_size=256, seq_len=SEQ, d_model=d, n_heads=4, n_layers=layers,
                     d_ff=4 * d)


def batch(m: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 256, (m * MB, SEQ + 1)).astype(np.int32)}


def pipelined(kind: str, v: int, m: int, cfg: GPTConfig, remat: str = "none",
              split: bool | None = False):
    """``split``: the plan's ``split_backward`` (False: as written; None: the runtime's
    choice for this backend)."""
    model = GPT(cfg, rngs=nnx.Rngs(0))
    mesh = fj.make_mesh(data=1, pipe=P_STAGES, tensor=1, devices=jax.devices()[:P_STAGES])
    plan = fj.Plan(mesh=mesh, schedule=kind, microbatches=m, virtual_stages=v, remat=remat,
                   split_backward=split)
    return fj.parallelize(model, optax.sgd(1e-3), plan)


def compiled(trainer, m: int, unroll: int = 1, what: str = "step"):
    """The compiled training step, or (``what="grads"``) the pipeline's loss and gradients in
    the runtime's own layout, as the step consumes them (the conversion to the canonical tree
    is not stash)."""
    trainer.pipeline.tick_unroll = unroll
    state = jax.eval_shape(trainer.init)
    if what == "step":
        return trainer.lower_step(state, batch(m)).compile()
    return trainer.lower_loss_and_grads(state, batch(m), canonical=False).compile()


def bytes_per_tick(kind: str, v: int, m: int, d: int) -> tuple[float, float]:
    """(one tick's bytes accessed, the whole step's) of the compiled training step."""
    # a fresh trainer each: jit caches the traced step, and the unroll factor is not an argument
    one = compiled(pipelined(kind, v, m, config(d)), m, 1).cost_analysis()["bytes accessed"]
    two = compiled(pipelined(kind, v, m, config(d)), m, 2).cost_analysis()["bytes accessed"]
    return two - one, one


def single_layer_bytes(remat: str, d: int) -> float:
    """One layer's residual bytes under plain jax.value_and_grad on one device (one microbatch):
    the temp-memory slope from 8 to 16 layers."""
    pol = policies.resolve(remat)

    def temp(layers):
        sm, params = split_model(GPT(config(d, layers), rngs=nnx.Rngs(0)))
        layer = policies.remat_layer(sm.layer, pol) if pol.remat else sm.layer

        def loss(p, b):
            x = jax.lax.scan(lambda h, lp: (layer(lp, h), None), sm.prologue(p, b),
                             p[sm.stack])[0]
            return sm.epilogue(p, x, b)

        c = jax.jit(jax.value_and_grad(loss)).lower(params, batch(1)).compile()
        return c.memory_analysis().temp_size_in_bytes

    return (temp(16) - temp(8)) / 8


def stash_ratio(kind: str, v: int, remat: str, d: int, m: int) -> tuple[float, float, int]:
    """(temp bytes per layer per stage, ratio to the bound, held peak). The gradients are the
    program's outputs, so the slope is the stash and the working set that grows with layers."""
    def temp(layers):
        trainer = pipelined(kind, v, m, config(d, layers), remat)
        held = max(trainer.pipeline.schedule_run.held_peak)
        # A chunk of the interleaved/V kinds holds layers/(p*v): count held chunk-microbatches.
        return compiled(trainer, m, what="grads").memory_analysis().temp_size_in_bytes, held

    (t8, held), (t16, _) = temp(8), temp(16)
    per_layer_stage = (t16 - t8) / (8 / P_STAGES)
    bound = held / v * single_layer_bytes(remat, d)
    return per_layer_stage, per_layer_stage / bound, held


def step_time(kind: str, v: int, m: int, d: int, repeats: int) -> float:
    """Median pipelined step / median single-device value_and_grad + SGD step."""
    cfg = config(d)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.sgd(1e-3)

    def loss(p, b):
        mdl = nnx.merge(graphdef, p)
        return mdl.loss(mdl.head(scan_layers(mdl.blocks, mdl.prologue(b))), b)

    @jax.jit
    def single(p, b):
        value, g = jax.value_and_grad(loss)(p, b)
        u, _ = opt.update(g, opt.init(p), p)
        return optax.apply_updates(p, u), value

    one = jax.devices()[0]
    b = batch(m)
    p1, b1 = jax.device_put(params, one), jax.device_put(b, one)
    run_pipe = runner(kind, v, m, cfg)

    def run_single():
        jax.block_until_ready(single(p1, b1))

    run_single()
    ts, tp = [], []
    for _ in range(repeats):
        for fn, acc in ((run_pipe, tp), (run_single, ts)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(tp) / statistics.median(ts)


def runner(kind: str, v: int, m: int, cfg: GPTConfig):
    """One compiled, warmed-up pipelined step as the runtime runs it here: a function to time
    (its ``ticks`` attribute: the tick count)."""
    trainer = pipelined(kind, v, m, cfg, split=None)
    state, sb = trainer.init(), trainer.shard_batch(batch(m))
    step = trainer.step_function()

    def run():
        jax.block_until_ready(step(state, sb))

    run()
    run.ticks = trainer.pipeline.tables.num_ticks
    return run


def against_1f1b(m: int, d: int, repeats: int) -> list[tuple[str, int, float]]:
    """(kind, ticks, median step / 1F1B's median step), every kind's step timed in turn in
    one loop, so that a machine's load weighs on all alike."""
    runs = [(kind, runner(kind, v, m, config(d))) for kind, v in KINDS]
    times: dict[str, list[float]] = {kind: [] for kind, _ in runs}
    for _ in range(repeats):
        for kind, run in runs:
            t0 = time.perf_counter()
            run()
            times[kind].append(time.perf_counter() - t0)
    base = statistics.median(times["1f1b"])
    return [(kind, run.ticks, statistics.median(times[kind]) / base) for kind, run in runs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="bytes,stash,time")
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args()
    only = set(args.only.split(","))
    d = args.d
    out = [f"# Pipeline runtime efficiency (GPT d={d}, 8 layers, p={P_STAGES}, {MB} sequences "
           f"of {SEQ} tokens per microbatch, simulated CPU devices)", "",
           "Reproduce: `python benchmarks/pipeline_efficiency.py" +
           (" --quick" if args.quick else "") + "`.", ""]
    kinds = KINDS
    if "bytes" in only:
        ms = (4, 16) if args.quick else (4, 8, 16)
        out += ["## Bytes accessed per tick vs microbatches", "",
                "One tick = step compiled with 2 ticks per scan iteration minus with 1. "
                "The whole step adds the one-time zeroing of the buffers.", "",
                "| schedule | " + " | ".join(f"tick m={m}" for m in ms) +
                f" | m={ms[-1]} / m={ms[0]} | " + " | ".join(f"step m={m}" for m in ms) + " |",
                "|---|" + "---|" * (2 * len(ms) + 1)]
        for kind, v in kinds:
            vals = [bytes_per_tick(kind, v, m, d) for m in ms]
            ticks = " | ".join(f"{t / 2**20:.2f} MiB" for t, _ in vals)
            steps = " | ".join(f"{s / 2**20:.1f} MiB" for _, s in vals)
            row = f"| {kind} | {ticks} | {vals[-1][0] / vals[0][0]:.3f} | {steps} |"
            out.append(row)
            print(row, flush=True)
        out.append("")
    if "stash" in only:
        m = 8
        out += ["## Stash slope against its bound", "",
                f"m={m}. Slope = temp bytes per layer on a stage (8 -> 16 layers); bound = held "
                "microbatches x one layer's residual bytes under plain `jax.value_and_grad` "
                "(one device, same policy, same microbatch). Interleaved kinds hold chunks of "
                "L/(p v) layers: held chunk-microbatches / v.", "",
                "| schedule | remat | held | slope per layer | bound | ratio to bound |",
                "|---|---|---|---|---|---|"]
        for kind, v in kinds:
            for remat in ("none", "full", "dots"):
                slope, ratio, held = stash_ratio(kind, v, remat, d, m)
                row = (f"| {kind} | {remat} | {held} | {slope / 2**20:.2f} MiB | "
                       f"{slope / ratio / 2**20:.2f} MiB | {ratio:.3f} |")
                out.append(row)
                print(row, flush=True)
        out.append("")
    if "time" in only:
        repeats = 5 if args.quick else 9
        ms = (P_STAGES, 4 * P_STAGES) if args.quick else (P_STAGES, 2 * P_STAGES, 4 * P_STAGES)
        out += ["## Step time against a single-device step", "",
                f"Pipelined step / single-device `jax.value_and_grad` + SGD step, same global "
                f"batch, alternating, median of {repeats}. CPU devices share 2 cores: a lockstep "
                "bubble costs little wall time here, per-tick overhead costs it all.", "",
                "| schedule | " + " | ".join(f"m={m}" for m in ms) + " |",
                "|---|" + "---|" * len(ms)]
        for kind, v in kinds:
            row = f"| {kind} | " + " | ".join(
                f"{step_time(kind, v, m, d, repeats):.2f}" for m in ms) + " |"
            out.append(row)
            print(row, flush=True)
        m = 4 * P_STAGES
        out += ["", f"Against 1F1B at m={m}: every kind's step in turn in one loop, median of "
                f"{2 * repeats + 1}.", "", "| schedule | ticks | step / 1F1B's |", "|---|---|---|"]
        for kind, ticks, ratio in against_1f1b(m, d, 2 * repeats + 1):
            out.append(f"| {kind} | {ticks} | {ratio:.2f} |")
            print(out[-1], flush=True)
    path = Path(__file__).parent / "results" / "pipeline_efficiency.md"
    path.parent.mkdir(exist_ok=True)
    text = merge_sections(path.read_text() if path.exists() else "", "\n".join(out) + "\n")
    reporting.write(path, text)
    print(text)
    return 0


def merge_sections(old: str, new: str) -> str:
    """``new`` with every ``## `` section it lacks kept from ``old``, so ``--only`` re-runs one
    table without dropping the others (and the notes written under them)."""
    def sections(text):
        parts = re.split(r"(?m)^(?=## )", text)
        return parts[0], {part.splitlines()[0]: part for part in parts[1:]}

    _, old_parts = sections(old)
    head, new_parts = sections(new)
    merged = {**old_parts, **new_parts}
    order = [h for h in old_parts] + [h for h in new_parts if h not in old_parts]
    return head + "".join(merged[h] if merged[h].endswith("\n\n") else merged[h] + "\n"
                          for h in order)


if __name__ == "__main__":
    sys.exit(main())
