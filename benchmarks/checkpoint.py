"""Checkpoint overhead per training step: synchronous, async and CheckFreq saving against none.

One GPT trains on 8 simulated CPU devices (data=4, tensor=2). Four variants take turns in
windows of ``--window`` steps, each with its own state, manager and directory:

- ``none``: no checkpoints;
- ``sync``: a blocking save every ``--every`` steps (snapshot and write on the training thread);
- ``async``: the same saves, written in the background after the device-to-host snapshot;
- ``checkfreq``: ``every="auto"``: the interval chosen from measured costs for a 3.5% budget.

A window's time includes waiting for its last background write, so no variant's I/O spills into
another's window; the order of the variants rotates from round to round. Each round's window
times are divided by the ``none`` window of the same round and the table gives the median ratio
over rounds, and also the ratio of total times: CheckFreq saves once in many windows, so only the
totals amortize its cost (the first round, which compiles, is discarded).
Only these ratios are claims: absolute CPU times depend on the machine and its load.
Writes ``benchmarks/results/checkpoint.md``.

    python benchmarks/checkpoint.py            # about 5 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax import checkpoint  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("none", "sync", "async", "checkfreq")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30, help="measured rounds (plus one warm-up)")
    ap.add_argument("--window", type=int, default=10, help="steps per variant per round")
    ap.add_argument("--every", type=int, default=5, help="interval of sync and async saves")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS / "checkpoint.md")
    args = ap.parse_args()

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, d_model=args.d_model, n_heads=8,
                    n_layers=args.layers, d_ff=4 * args.d_model)
    plan = fj.Plan(mesh=fj.make_mesh(data=4, pipe=1, tensor=2))
    trainer = fj.parallelize(GPT(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3), plan)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 256, (args.batch, cfg.seq_len + 1), np.int32)}
               for _ in range(8)]
    root = Path(tempfile.mkdtemp(prefix="fj-ckpt-bench-"))
    managers = {
        "sync": checkpoint.CheckpointManager(root / "sync", trainer, every=0, max_to_keep=1,
                                             async_save=False),
        "async": checkpoint.CheckpointManager(root / "async", trainer, every=0, max_to_keep=1),
        "checkfreq": checkpoint.CheckpointManager(root / "checkfreq", trainer, every="auto",
                                                  max_to_keep=1),
    }
    states = {v: trainer.init() for v in VARIANTS}
    steps = dict.fromkeys(VARIANTS, 0)
    for m in managers.values():
        m.warm_up(states["none"])
    state_mb = sum(x.nbytes for x in jax.tree.leaves(states["none"])) / 2**20

    def window(variant: str) -> float:
        state, m = states[variant], managers.get(variant)
        t0 = time.perf_counter()
        for _ in range(args.window):
            steps[variant] += 1
            s = steps[variant]
            state, metrics = trainer.step(state, batches[s % len(batches)])
            float(metrics["loss"])  # a real loop reads its loss every step
            if variant in ("sync", "async"):  # mid-window, so writes end inside the window
                m.save(s, state, force=s % args.every == args.every // 2)
            elif variant == "checkfreq":
                m.save(s, state)
        if m is not None:
            m.wait()
        states[variant] = state
        return (time.perf_counter() - t0) / args.window

    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    spent = dict.fromkeys(VARIANTS, 0.0)  # measured windows' wall time per variant
    for r in range(args.rounds + 1):
        order = VARIANTS[r % 4:] + VARIANTS[:r % 4]  # rotate: no variant always runs first
        times = {v: window(v) for v in order}
        times = {v: times[v] for v in VARIANTS}
        if r == 0:  # steady state from here: CheckFreq's accounting is rebased below
            base = managers["checkfreq"].stats()
        print(f"round {r}{' (warm-up)' if r == 0 else ''}: " +
              ", ".join(f"{v} {t * 1e3:.1f} ms/step" for v, t in times.items()), flush=True)
        if r:
            for v in VARIANTS:
                ratios[v].append(times[v] / times["none"])
                spent[v] += times[v] * args.window
    stats = {v: m.stats() for v, m in managers.items()}
    # CheckFreq's own accounting counts from its first save; rebase it on its own measured
    # windows (other variants' windows pass in between, and the warm-up compiles).
    cf = stats["checkfreq"]
    cf["own_share"] = (cf["ckpt_stall_s"] + cf["ckpt_interference_s"] - base["ckpt_stall_s"]
                       - base["ckpt_interference_s"]) / spent["checkfreq"]
    cf["measured_saves"] = cf["ckpt_saves"] - base["ckpt_saves"]
    for m in managers.values():
        m.close()
    shutil.rmtree(root, ignore_errors=True)
    write(args, cfg, state_mb, ratios, spent, stats)


def write(args, cfg, state_mb: float, ratios: dict, spent: dict, stats: dict) -> None:
    cf = stats["checkfreq"]
    lines = [
        "# Checkpoint overhead per step",
        "",
        f"GPT d_model={cfg.d_model}, {cfg.n_layers} layers, d_ff={cfg.d_ff}, AdamW: "
        f"{state_mb:.1f} MiB of train state (params + optimizer) on 8 simulated CPU devices "
        f"(data=4, tensor=2), global batch {args.batch} x {cfg.seq_len} tokens. Variants "
        f"alternate (order rotating) in windows of {args.window} steps; median over "
        f"{args.rounds} rounds of (window time / the `none` window of the same round), and the "
        "ratio of total times, which amortizes CheckFreq's rare saves. Written by "
        "`python benchmarks/checkpoint.py`.",
        "",
        "| saving | interval (steps) | time per step vs none (median) | overhead (median) | "
        "overhead (totals) |",
        "|---|---|---|---|---|",
    ]
    interval = {"none": "-", "sync": str(args.every), "async": str(args.every),
                "checkfreq": f"auto: {cf.get('ckpt_every', '?')}"}
    for v in VARIANTS:
        med = statistics.median(ratios[v])
        tot = spent[v] / spent["none"]
        lines.append(f"| {v} | {interval[v]} | {med:.3f}x | {100 * (med - 1):+.1f}% | "
                     f"{100 * (tot - 1):+.1f}% |")
    lines += [
        "",
        "CheckFreq's own accounting over the run (checkpoint stall plus slowdown of the steps "
        f"that overlapped a background write, as a share of wall time): "
        f"{100 * cf['own_share']:.1f}% of its measured windows' time, {cf['measured_saves']} "
        "saves (budget 3.5%).",
        f"Its last measured snapshot took {cf.get('ckpt_snapshot_s', float('nan')) * 1e3:.0f} ms "
        f"and the write behind it {cf.get('ckpt_persist_s', float('nan')) * 1e3:.0f} ms "
        "(CPU times, for the interval choice only).",
        "",
        "Per-round ratios: " + "; ".join(
            f"{v} " + " ".join(f"{x:.3f}" for x in ratios[v]) for v in VARIANTS[1:]),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    reporting.write(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
