"""benchmarks/scale.py on a tiny Llama: the planner's pipelined zero=3 bf16 pick compiles, and
its memory prediction sits beside the compiled figure (the full shapes run in the benchmark)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import scale  # noqa: E402

from fiddlejax import planner  # noqa: E402

TINY = scale.Shape("tiny-llama", 4, 64, 4, 2, 128, 256, gpus=8, global_batch=16)


def test_scale_core_on_a_tiny_llama():
    row = scale.measure(TINY, 32, planner.cluster("cpu-sim"))
    print(scale.markdown([row]))
    assert "zero3" in row["layout"] and row["layout"].split()[1] != "p1"
    assert row["compiled"] > 0 and row["predicted"] > 0
    assert abs(row["error"]) < 0.5  # the tiny shape is dominated by fixed costs; see scale.md


def test_scale_extrapolates_from_fewer_layers():
    """Compiling N and 2N layers and extrapolating agrees with the full compile."""
    cluster = planner.cluster("cpu-sim")
    full = scale.measure(TINY, 32, cluster)
    lo = scale.pick_layout(TINY.spec(32), cluster, TINY.global_batch).layout
    part = scale.measure(TINY, 32, cluster, layers=lo.pipe)
    assert part["compiled"] == pytest.approx(full["compiled"], rel=0.02)
    with pytest.raises(ValueError, match="multiple of pipe"):
        scale.measure(TINY, 32, cluster, layers=lo.pipe + 1)
