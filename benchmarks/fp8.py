"""fp8 matmuls against bf16: the default ``fiddlejax train`` job, same steps, validation loss.

Runs the default job (GPT, 150 steps, 8 simulated CPU devices, (data, pipe, tensor) = (2, 2, 2),
interleaved 1F1B) twice, ``plan.compute_dtype=bfloat16`` with and without
``plan.matmul_dtype=fp8``, and writes both validation losses to ``benchmarks/results/fp8.md``.
The CPU emulates float8: it rounds the operands to f8 and upcasts them for the dot, so the
numerics are fp8's and the step times are not (see docs/precision.md).

    python benchmarks/fp8.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import reporting

OUT = Path(__file__).parent / "results" / "fp8.md"
BAR = 0.02  # issue 38: fp8's validation loss within 2% of bf16's


def run(matmul: str, steps: int, root: Path) -> dict:
    """One ``fiddlejax train`` job; its summary.json."""
    where = root / matmul
    args = [sys.executable, "-m", "fiddlejax.cli", "train", "plan.compute_dtype=bfloat16",
            f"plan.matmul_dtype={matmul}", f"train.steps={steps}", f"run.dir={where}",
            "checkpoint.dir=null", "run.progress=lines"]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return json.loads((where / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    steps = parser.parse_args().steps
    with tempfile.TemporaryDirectory() as tmp:
        bf16, fp8 = (run(m, steps, Path(tmp)) for m in ("null", "fp8"))
    gap = fp8["final_val_loss"] / bf16["final_val_loss"] - 1
    rows = [("bf16 (`plan.compute_dtype=bfloat16`)", bf16),
            ("fp8 (`... plan.matmul_dtype=fp8`)", fp8)]
    lines = [
        "# fp8 matmuls against bf16: the default job",
        "",
        f"Reproduce: `python benchmarks/fp8.py` (`--steps {steps}`). The default `fiddlejax "
        "train` job (GPT d=128, 4 layers, seq 128, 8 simulated CPU devices, (data, pipe, "
        "tensor) = (2, 2, 2), interleaved 1F1B, 4 microbatches), once in bf16 and once with "
        "the layers' dense matmuls in fp8 (e4m3, e5m2 gradients, per-tensor current scaling); "
        "the embedding, head and attention's dots stay bf16, master weights float32. The CPU "
        "emulates float8 (operands rounded to f8, dot in float32): the losses are fp8's, the "
        "step times are not a GPU's.",
        "",
        "| run | validation loss: start -> end | final train loss | median step |",
        "|---|---|---|---|",
        *(f"| {name} | {r['initial_val_loss']:.4f} -> {r['final_val_loss']:.4f} | "
          f"{r['final_loss']:.4f} | {1e3 * r['median_step_time_s']:.0f} ms |" for name, r in rows),
        "",
        f"fp8's final validation loss is {100 * gap:+.2f}% from bf16's "
        f"({'within' if abs(gap) <= BAR else 'OUTSIDE'} the {100 * BAR:.0f}% bar of issue 38).",
        "",
    ]
    reporting.write(OUT, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
