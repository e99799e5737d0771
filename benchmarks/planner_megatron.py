"""The planner against every published run it ships, each predicted with the settings it ran with.

The same tables as ``fiddlejax plan validate`` (prediction, published TFLOP/s per GPU, error and
the time shares) and ``python -m fiddlejax.planner.attribution`` (the error of every run as each
change to the planner was added). Nothing is fitted per run; why each change, and the runs'
settings, are in docs/planner.md ("Validation"). Writes benchmarks/results/planner_megatron.md.

    python benchmarks/planner_megatron.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import reporting

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fiddlejax.planner import attribution, published, recent  # noqa: E402


def main() -> int:
    rows = published.compare()
    off = published.off(rows)
    lines = ["# Planner vs published runs, each predicted as it ran", "",
             "Published and predicted TFLOP/s per GPU (Megatron formula, full recomputation); "
             "error = predicted / published - 1.", "",
             "## After (`fiddlejax plan validate`)", "", published.markdown(rows), "",
             "## Before, and what each change moved (`python -m fiddlejax.planner.attribution`)",
             "", "Each row adds one change to the previous; the first is the planner before "
             "them.", "", attribution.markdown(), "",
             "## Recent runs, 2024-26 (`fiddlejax/planner/recent.py`), tokens/s per GPU", "",
             "Each run with its runtime's knobs and the cheapest remat the planner says fits; "
             "held-out runs were not used to check any change (docs/planner.md, \"Recent "
             "runs\").", "", recent.markdown(recent.compare()), "",
             "### What each runtime knob moves (`python -m fiddlejax.planner.attribution`)", "",
             "Each run's error with fiddlejax's runtime, then its runtime's knobs added one "
             "at a time (each run keeps its final recomputation); the last column is the "
             "table above.", "", attribution.recent_markdown()]
    text = "\n".join(lines)
    reporting.write(Path(__file__).parent / "results" / "planner_megatron.md", text)
    print(text)
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
