"""benchmarks/mfu.py at its smoke shape on 8 simulated CPU devices: the one-device comparison
with a hand-written step and every 8-device layout run and land in the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mfu_smoke(tmp_path):
    out = tmp_path / "mfu.md"
    # the suite's XLA_FLAGS (8 devices, -O0, elemental emitters: see conftest) pass through
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mfu.py"), "--smoke",
                        "--steps", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert "Device: cpu" in text.lower() or "(cpu)" in text
    ratio_row = text.split("| ratio (median of rounds) |")[1].splitlines()[2]
    assert float(ratio_row.strip("| ").split("|")[-1]) > 0
    for layout in ("data=8", "fsdp data=8 (zero=3)", "tensor=2 data=4", "1f1b", "interleaved",
                   "zb-v"):
        assert f"{layout}" in text, layout
    assert "n/a (peak unknown)" in text  # a CPU has no MFU
