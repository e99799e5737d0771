"""Pipeline memory and step time at a real vocabulary size: the embedding and head placement.

GPT with vocabulary 32,768 (d=256, 8 layers, sequences of 64) on (data, pipe, tensor) =
(1, 4, 2) with 1F1B, m=8, AdamW, 4 sequences per microbatch. Memory is the compiled step's
``memory_analysis`` per device (abstract model, nothing allocated); the embedding and head's
share is the difference against the same model at vocabulary 256. Step time is the median of
``--repeats`` steps, and with ``--baseline-commit SHA`` (an older fiddlejax, checked out into a
temporary ``git worktree``; b7c3edd replicated the embedding and head per stage) or
``--baseline DIR`` (such a checkout) this checkout and the baseline run alternately in
subprocesses, three times each, on the same batch. Writes benchmarks/results/vocab_parallel.md.

    python benchmarks/vocab_parallel.py [--baseline-commit b7c3edd] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import reporting

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def _gpt_module():
    """The GPT of the fiddlejax being run: ``fiddlejax.models.gpt``, or, in a checkout from
    before the models moved into the package (8b19b81; b7c3edd is one), its top-level
    ``models.gpt`` (``fiddlejax.models`` would then resolve to the installed fiddlejax's)."""
    import importlib

    import fiddlejax

    inside = (Path(fiddlejax.__file__).parent / "models").is_dir()
    return importlib.import_module("fiddlejax.models.gpt" if inside else "models.gpt")


def _model(vocab: int, tie: bool, abstract: bool):
    from flax import nnx

    gpt = _gpt_module()
    GPT, GPTConfig = gpt.GPT, gpt.GPTConfig  # noqa: N806

    cfg = GPTConfig(vocab_size=vocab, seq_len=64, d_model=256, n_heads=4, n_layers=8,
                    d_ff=1024, tie_embeddings=tie)
    make = lambda: GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    return nnx.eval_shape(make) if abstract else make()


def _trainer(model, kind: str = "1f1b", remat: str = "none"):
    import jax
    import optax

    import fiddlejax as fj

    mesh = fj.make_mesh(data=1, pipe=4, tensor=2, devices=jax.devices()[:8])
    return fj.parallelize(model, optax.adamw(1e-3),
                          fj.Plan(mesh=mesh, schedule=kind, microbatches=8, remat=remat))


def memory_rows() -> list[dict]:
    rows = []
    for vocab in (256, 32768):
        for tie in (False, True):
            mem = _trainer(_model(vocab, tie, abstract=True)).memory(32)
            rows.append({"vocab": vocab, "tied": tie, **{k: v / MiB for k, v in mem.items()}})
            print(rows[-1], flush=True)
    return rows


def time_step(repeats: int) -> dict:
    """Median step time of this checkout (run in a subprocess by ``--baseline``)."""
    import time

    import jax
    import numpy as np

    trainer = _trainer(_model(32768, False, abstract=False))
    state = trainer.init()
    batch = trainer.shard_batch(
        {"tokens": np.random.default_rng(0).integers(0, 32768, (32, 65)).astype(np.int32)})
    step = trainer.step_function()
    _, metrics = jax.block_until_ready(step(state, batch))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t)
    return {"seconds": float(np.median(times)), "loss": float(metrics["loss"])}


def _worker(checkout: Path, *args: str):
    """Run this file's worker mode on the fiddlejax of ``checkout`` (its own models too)."""
    env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{checkout / 'tests'}"}
    r = subprocess.run([sys.executable, __file__, "--worker", *args], cwd=checkout,
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"the worker on {checkout} ({' '.join(args)}) failed:\n"
                           f"{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, help="a checkout of an older fiddlejax")
    ap.add_argument("--baseline-commit", help="an older commit, checked out for the run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # in a subprocess, on the checkout PYTHONPATH names
        what, *rest = args.worker
        print(json.dumps(memory_rows() if what == "memory" else time_step(int(rest[0]))))
        return 0
    if args.baseline_commit:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "worktree", "add", "--detach", tmp, args.baseline_commit],
                           cwd=ROOT, check=True, capture_output=True)
            try:
                return report(args, Path(tmp), args.baseline_commit)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT,
                               check=False, capture_output=True)
    return report(args, args.baseline, args.baseline and str(args.baseline))


def _share(rows: dict, name: str) -> float:
    """The embedding and head's argument MiB: untied vocabulary 32,768 minus 256."""
    return rows[name, 32768, False]["argument_bytes"] - rows[name, 256, False]["argument_bytes"]


def report(args, baseline: Path | None, label: str | None) -> int:
    checkouts = {"this": ROOT, **({"baseline": baseline.resolve()} if baseline else {})}
    out = ["# Embedding and head at vocabulary 32,768 (GPT d=256, 8 layers, (1,4,2) 1f1b, m=8)",
           "", "Per device, compiled `memory_analysis`, AdamW (float32 parameters, gradients, "
           "two moments).", "",
           "| checkout | vocab | tied | arguments | temp | peak |", "|---|---|---|---|---|---|"]
    rows = {}
    for name, checkout in checkouts.items():
        for r in _worker(checkout, "memory"):
            rows[name, r["vocab"], r["tied"]] = r
            out.append(f"| {name} | {r['vocab']} | {r['tied']} | {r['argument_bytes']:.2f} MiB "
                       f"| {r['temp_bytes']:.2f} MiB | {r['peak_bytes']:.2f} MiB |")
            print(out[-1], flush=True)
    if baseline:
        share, base = _share(rows, "this"), _share(rows, "baseline")
        out += ["", f"Embedding and head's share of the arguments (vocabulary 32,768 minus 256, "
                f"untied): this checkout {share:.2f} MiB, baseline {base:.2f} MiB, ratio "
                f"{share / base:.2f}. Temp at vocabulary 256 (no embedding effect): baseline "
                f"{rows['baseline', 256, False]['temp_bytes']:.2f} -> this "
                f"{rows['this', 256, False]['temp_bytes']:.2f} MiB; at 32,768: "
                f"{rows['baseline', 32768, False]['temp_bytes']:.2f} -> "
                f"{rows['this', 32768, False]['temp_bytes']:.2f} MiB."]
        runs = {"this": [], "baseline": []}
        for _ in range(3):  # alternately, so machine load hits both alike
            for name, checkout in checkouts.items():
                runs[name].append(_worker(checkout, "time", str(args.repeats)))
            print(runs, flush=True)
        med = {k: sorted(x["seconds"] for x in v)[1] for k, v in runs.items()}
        out += ["", f"Step time (median of {args.repeats} steps, 3 alternating runs each): "
                f"this checkout {med['this']:.3f} s, baseline ({label}) "
                f"{med['baseline']:.3f} s, ratio {med['this'] / med['baseline']:.2f}; loss "
                f"{runs['this'][0]['loss']:.6f} vs {runs['baseline'][0]['loss']:.6f}."]
    path = ROOT / "benchmarks" / "results" / "vocab_parallel.md"
    reporting.write(path, "\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
