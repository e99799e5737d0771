"""PipeDream-2BW against 1F1B: the bubble amortized over K unflushed steps, the memory of the
second weight version (``memory_analysis``), and convergence on the stdlib corpus.

    python benchmarks/pipeline_2bw.py [--quick]
    python benchmarks/pipeline_2bw.py --train [--train-steps N] [--overrides 'k=v ...']
        [--stale-correction A] [--steps-per-call K]

``--train`` runs ``fiddlejax train`` twice (plan.schedule=1f1b and 2bw, same overrides, the
default run otherwise) and prints their final validation losses (``--reference``: the same
update rules on one device); ``--train-table`` does so for every row of ``TRAIN_ROWS`` and
writes results/pipeline_2bw_train.md (about 15 minutes on 2 CPU cores), ``--reference-table``
for ``REFERENCE_ROWS`` on one device, results/pipeline_2bw_reference.md (``--jobs 2``: two
rows at once, one core each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import reporting

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bubbles(p: int = 4, m: int = 4, ks=(1, 2, 4, 8, 16)) -> list[tuple[int, float]]:
    from fiddlejax.pipeline import schedules

    return [(k, schedules.build("2bw", stages=p, microbatches=m, steps=k).bubble_fraction)
            for k in ks]


def stable_lr_times_curvature(beta: float, delay: int, nesterov: bool = False) -> float:
    """Largest lr * a for which momentum (Adam's first moment, preconditioned curvature a) is
    stable on a quadratic when gradients arrive ``delay`` steps late.

    Why 2BW hurts Adam: with delay 0 the bound is 2(1+beta)/(1-beta) = 38 at beta=0.9; with
    one step of delay it drops to 1 whatever beta is, and Adam trains at that edge. Nesterov
    momentum (direction m_t + beta (m_t - m_{t-1})) recovers part of it.
    """
    import numpy as np

    def spectral_radius(c: float) -> float:
        def step(x0, x1, m1):  # x_t, x_{t-1}, m_{t-1} -> x_{t+1}, x_t, m_t
            m = beta * m1 + (1 - beta) * (x1 if delay else x0)
            d = m + beta * (m - m1) if nesterov else m
            return np.array([x0 - c * d, x0, m])

        return max(abs(np.linalg.eigvals(np.stack([step(*e) for e in np.eye(3)], 1))))

    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spectral_radius(mid) < 1 - 1e-12 else (lo, mid)
    return lo


def memory(quick: bool) -> list[dict]:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import fiddlejax as fj
    from fiddlejax.models.gpt import GPT, GPTConfig

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
            compiled = trainer.lower_steps(state, batches).compile()
        ma = compiled.memory_analysis()
        param_bytes = sum(x.addressable_shards[0].data.nbytes
                          for x in jax.tree.leaves(state.params))
        rows.append({"schedule": kind, "steps per call": k,
                     "params/device MiB": param_bytes / 2**20,
                     "argument MiB": ma.argument_size_in_bytes / 2**20,
                     "temp MiB": ma.temp_size_in_bytes / 2**20})
    return rows


def train(overrides: list[str], correction: float, steps: int, per_call: int) -> dict:
    """Final validation loss of the default run under 1F1B and 2BW with the same ``overrides``
    (2BW adds ``optimizer.stale_correction``). No global-norm clip: 2BW updates per stage."""
    out = {}
    tag = "-".join(x.split("=")[-1] for x in overrides) or "default"
    for kind in ("1f1b", "2bw"):
        extra = ([f"optimizer.stale_correction={correction}", f"train.steps_per_call={per_call}"]
                 if kind == "2bw" else [])
        run_dir = Path("/tmp/fiddlejax_2bw") / f"{kind}-{tag}-{correction}-{steps}"
        subprocess.run([sys.executable, "-m", "fiddlejax.cli", "train", f"plan.schedule={kind}",
                        "plan.virtual_stages=1", "optimizer.clip=0", f"train.steps={steps}",
                        *overrides, *extra, f"run.dir={run_dir}", "run.progress=lines"],
                       check=True, cwd=ROOT)
        out[kind] = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    return out


def reference(overrides: list[str], stale: bool) -> float:
    """Final validation loss of the default run's model, data and optimizer on one device, with
    fresh gradients (1F1B's semantics) or PipeDream-2BW's rule W(t+1) = W(t) + update(grad at
    W(t-1)), W(-1) = W(0): the rule the pipelined runtime reproduces (tests/test_pipeline.py),
    at a fraction of the cost of eight simulated devices, for sweeps."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from fiddlejax.app import build, config

    cfg = config.load(None, ["optimizer.clip=0", *overrides])
    model = build.build_model(cfg["model"], cfg["train"]["seed"])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = build.make_optimizer(cfg)
    data = build.build_data(cfg, model)
    train_it, val_it = data.train, data.validation
    val = [next(val_it) for _ in range(cfg["train"]["eval_batches"])]

    def loss(p, batch):
        m = nnx.merge(graphdef, p, rest)
        return m.loss(m(batch["tokens"][:, :-1]), batch)

    @jax.jit
    def step(p, prev, opt_state, batch):
        g = jax.grad(loss)(prev if stale else p, batch)
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), p, opt_state

    p, prev, opt_state = params, params, tx.init(params)
    for _ in range(cfg["train"]["steps"]):
        p, prev, opt_state = step(p, prev, opt_state, next(train_it))
    evaluate = jax.jit(loss)
    return float(np.mean([float(evaluate(p, b)) for b in val]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--train", action="store_true",
                    help="instead: train 1F1B and 2BW side by side, print a convergence row")
    ap.add_argument("--train-table", action="store_true",
                    help="instead: every row of TRAIN_ROWS, written to pipeline_2bw_train.md")
    ap.add_argument("--reference-table", action="store_true",
                    help="instead: every row of REFERENCE_ROWS (one device), written to "
                         "pipeline_2bw_reference.md")
    ap.add_argument("--jobs", type=int, default=1,
                    help="--reference-table: rows trained at once (one process each)")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--overrides", default="",
                    help="--train: config overrides for both runs, e.g. 'optimizer.name=muon'")
    ap.add_argument("--stale-correction", type=float, default=0.0,
                    help="--train: optimizer.stale_correction of the 2BW run")
    ap.add_argument("--steps-per-call", type=int, default=1, help="--train: 2BW's K")
    ap.add_argument("--reference", action="store_true",
                    help="--train on one device: fresh vs 2BW rule (same numbers, much faster)")
    args = ap.parse_args()
    if args.train_table or args.reference_table:
        convergence_table(args.reference_table, args.jobs)
        return
    if args.train:  # one row, printed (the report is written whole by --train-table)
        print(convergence_row(args.train_steps, args.overrides, args.stale_correction,
                              "reference" if args.reference else args.steps_per_call))
        return
    import jax

    cmd = " ".join(["python benchmarks/pipeline_2bw.py", *sys.argv[1:]])
    lines = ["# PipeDream-2BW vs 1F1B", "",
             f"jax {jax.__version__}, {jax.default_backend()}; written by `{cmd}`.", "",
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
    lines += ["", "## Why stale gradients hurt Adam: largest stable lr x curvature on a quadratic "
              "(momentum beta1, preconditioned curvature)", "",
              "| beta1 | fresh | fresh, Nesterov | 1 step stale | 1 step stale, Nesterov |",
              "|---|---|---|---|---|"]
    for beta in (0.0, 0.5, 0.9):
        v = [stable_lr_times_curvature(beta, d, n) for d in (0, 1) for n in (False, True)]
        lines.append(f"| {beta} | " + " | ".join(f"{x:.3f}" for x in v) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    reporting.write((ROOT / "benchmarks" / "results" / "pipeline_2bw.md"), text)


# The rows of the convergence tables: (steps, overrides, 2BW's stale correction, K).
# results/pipeline_2bw_train.md: the pipelined runtime itself (8 simulated devices, minutes).
TRAIN_ROWS = [
    (150, "optimizer.lr=3e-3", 0, 1), (150, "optimizer.lr=1e-3", 0, 1),
    (150, "optimizer.name=muon", 1, 5),
]
# results/pipeline_2bw_reference.md: the single-device implementation of the same update rules
# (``reference``; the runtime reproduces it exactly, tests/test_pipeline.py), for the long runs
# and sweeps (about an hour and a half on 2 CPU cores). It runs none of the pipeline runtime,
# so a change to the step's code leaves it current (benchmarks/run.py: ``not_run``).
REFERENCE_ROWS = [
    (150, "optimizer.lr=3e-3", 0), (150, "optimizer.lr=3e-4", 0),
    (150, "optimizer.lr=1e-3 optimizer.b2=0.999", 0),
    (150, "optimizer.lr=1e-3 optimizer.nesterov=true", 0),
    (600, "optimizer.lr=1e-3 optimizer.nesterov=true", 0),
    (150, "optimizer.lr=3e-3", 1), (150, "optimizer.name=muon", 0),
    (150, "optimizer.name=muon", 1), (600, "optimizer.name=muon", 0),
    (600, "optimizer.name=muon", 1), (1200, "optimizer.name=muon", 1),
    (600, "optimizer.name=muon optimizer.lr=3e-4", 1),
    (600, "optimizer.name=muon optimizer.lr=1e-3", 1),
]


def convergence_row(steps: int, overrides: str, correction: float, k) -> str:
    """One row of results/pipeline_2bw_train.md: two full trainings (1F1B and 2BW)."""
    overrides = overrides.split()
    if k == "reference":
        base = [f"train.steps={steps}", *overrides]
        v = {"1f1b": reference(base, stale=False),
             "2bw": reference([*base, f"optimizer.stale_correction={correction}"], stale=True)}
    else:
        v = train(overrides, correction, steps, k)
    return (f"| {steps} | {' '.join(overrides) or '(none)'} | {correction:g}, {k} | "
            f"{v['1f1b']:.4f} | {v['2bw']:.4f} | {v['2bw'] / v['1f1b'] - 1:+.2%} |")


def convergence_table(reference_rows: bool, jobs: int = 1) -> None:
    """Write results/pipeline_2bw_train.md (``TRAIN_ROWS``, the pipelined runtime) or
    results/pipeline_2bw_reference.md (``REFERENCE_ROWS``, one device) whole. ``jobs``: rows
    trained at once, each in a process of its own (a one-device training keeps one core
    busy); the table keeps the rows' order."""
    if reference_rows:
        name, rows = "pipeline_2bw_reference.md", [(*r, "reference") for r in REFERENCE_ROWS]
        how = ("Each row on one device, with fresh gradients (1f1b) or PipeDream-2BW's rule "
               "W(t+1) = W(t) + update(grad at W(t-1)) (2bw), the default `fiddlejax train` "
               "run's model, data and optimizer (`optimizer.clip=0`, the overrides listed; the "
               "2BW run adds `optimizer.stale_correction`): the update rules the pipelined "
               "runtime reproduces exactly (`--train --reference` runs one row).")
    else:
        name, rows = "pipeline_2bw_train.md", TRAIN_ROWS
        how = ("The default `fiddlejax train` run (8 simulated devices) with "
               "`plan.schedule=1f1b` or `2bw`, `plan.virtual_stages=1`, `optimizer.clip=0` "
               "and the overrides listed (both runs); the 2BW run adds "
               "`optimizer.stale_correction` and `train.steps_per_call` (K).")
    lines = ["# PipeDream-2BW vs 1F1B: convergence on the stdlib corpus", "",
             how + " Final validation loss.", "",
             "| steps | overrides | 2bw correction, K | 1f1b | 2bw | gap |",
             "|---|---|---|---|---|---|"]
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = pool.map(convergence_row, *zip(*rows, strict=True))
            for line in done:
                lines.append(line)
                print(line, flush=True)
    else:
        for row in rows:
            lines.append(convergence_row(*row))
            print(lines[-1], flush=True)
    reporting.write(ROOT / "benchmarks" / "results" / name, "\n".join(lines))


if __name__ == "__main__":
    main()
