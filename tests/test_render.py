"""Schedule pictures and the ``fiddlejax schedule`` command."""

import json
import os
import subprocess
import sys
from pathlib import Path

from fiddlejax.pipeline import render, schedules

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_text_timeline_draws_time_to_scale():
    s = schedules.build("1f1b", 2, 3)
    assert render.text_timeline(s) == "\n".join(
        [
            "    time 0              5              10",
            "stage  0 F0|F1|......B0   |F2|B1   |...B2   |",
            "stage  1 ...F0|B0   |F1|B1   |F2|B2   |......",
        ]
    )


def test_tick_text_and_labels_show_chunks_when_interleaved():
    s = schedules.build("interleaved-1f1b", 2, 2, 2)
    lines = render.tick_text(s).splitlines()
    assert len(lines) == 1 + s.stages
    assert lines[1].split()[2:5] == ["F0:0", "F1:0", "F0:2"]
    assert lines[2].split()[2] == "."  # stage 1 idles at tick 0
    assert render.label(schedules.Action("W", 3, 1), schedules.build("zb-h1", 2, 4)) == "W3"


def test_summary_reports_both_bubbles_and_peaks():
    text = render.summary(schedules.build("1f1b", 4, 8))
    assert "makespan 33, bubble 27.27%" in text
    assert "22 ticks, bubble 27.27% of slots, 40.00% cost-weighted" in text
    assert "per stage: 4 3 2 1 (max 4)" in text


def test_command_prints_loadable_json(capsys):
    assert render.schedule_command(["1f1b", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = capsys.readouterr().out
    assert schedules.Schedule.from_dict(json.loads(out)) == schedules.build("1f1b", 4, 8)


def test_command_default_output_and_ticks(capsys):
    assert render.schedule_command(["zb-h1", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("stage  ") == 4 and "bubble 11.11%" in out and "W7|" in out
    assert render.schedule_command(["interleaved-1f1b", "-p", "4", "-m", "8", "--ticks"]) == 0
    assert "38 ticks" in capsys.readouterr().out


def test_command_writes_png(tmp_path, capsys):
    for kind, extra in [("gpipe", []), ("interleaved-1f1b", ["--virtual-stages", "2"])]:
        path = tmp_path / f"{kind}.png"
        argv = [kind, "--stages", "4", "--microbatches", "8", *extra, "--png", str(path)]
        assert render.schedule_command(argv) == 0
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert f"wrote {path}" in capsys.readouterr().err


def test_command_loads_a_json_file(tmp_path, capsys):
    path = tmp_path / "mine.json"
    schedules.dump(schedules.build("gpipe", 2, 2), path)
    assert render.schedule_command([str(path)]) == 0
    assert "gpipe: stages=2 microbatches=2" in capsys.readouterr().out


def test_command_errors_return_2(capsys):
    assert render.schedule_command(["pipedream", "-p", "4", "-m", "8"]) == 2
    assert "known kinds: gpipe, 1f1b, interleaved-1f1b, zb-h1" in capsys.readouterr().err
    assert render.schedule_command(["1f1b", "-p", "4"]) == 2
    assert "--microbatches required" in capsys.readouterr().err
    assert render.schedule_command(["1f1b", "-p", "four"]) == 2  # argparse's own message
    assert "invalid int value" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "fiddlejax.pipeline.render", "gpipe", "-p", "2", "-m", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "gpipe: stages=2 microbatches=2" in done.stdout
