"""`fiddlejax train` on own data resumes exactly: SIGTERM, then resume on the same and on a
different layout, sees the same example ids as an uninterrupted run, with the same losses; a
changed corpus or tokenizer is refused naming the old and the new unless data.allow_change."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_checkpoint import losses, run_until

STEPS = 12
TINY = ["model.name=llama", "model.seq_len=16", "model.d_model=32", "model.n_heads=4",
        "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64", "data.batch_size=8",
        "run.cpu_devices=2", "plan.microbatches=1", "plan.virtual_stages=1",
        "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "run.progress=lines",
        "optimizer.warmup_steps=2", f"train.steps={STEPS}", "checkpoint.every=100"]
DATA_PARALLEL = ["mesh.data=2", "mesh.pipe=1", "mesh.tensor=1", "plan.schedule=null"]
PIPELINE = ["mesh.data=1", "mesh.pipe=2", "mesh.tensor=1", "plan.schedule=1f1b"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.test_data_sources import stdlib_docs

    d = tmp_path_factory.mktemp("resume")
    docs = stdlib_docs(80)
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[::-1]))
    return d


def cmd(run_dir: Path, corpus: Path, *extra: str) -> tuple[list[str], dict]:
    env = dict(os.environ, FIDDLEJAX_EXAMPLE_IDS=str(run_dir / "ids.jsonl"))
    return ([sys.executable, "-m", "fiddlejax.cli", "train", *TINY,
             f"data.path={corpus / 'a.jsonl'}", f"run.dir={run_dir}", *extra], env)


def run(c) -> subprocess.CompletedProcess:
    return subprocess.run(c[0], env=c[1], capture_output=True, text=True, timeout=600)


def ids(run_dir: Path) -> list:
    return [json.loads(x) for x in (run_dir / "ids.jsonl").read_text().splitlines()]


def interrupt(c, step: int) -> str:
    os.environ["FIDDLEJAX_EXAMPLE_IDS"] = c[1]["FIDDLEJAX_EXAMPLE_IDS"]
    try:
        code, out = run_until(c[0], step, signal.SIGTERM)
    finally:
        del os.environ["FIDDLEJAX_EXAMPLE_IDS"]
    assert code == 0 and "preempted: saved step" in out, out[-3000:]
    return out


@pytest.mark.slow
def test_resume_sees_the_same_examples_on_any_layout(corpus, tmp_path):
    straight = tmp_path / "straight"
    r = run(cmd(straight, corpus, *DATA_PARALLEL))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = ids(straight)
    assert len(want) == STEPS and len({i for b in want for i in b}) > 8 * 3

    # one interrupted run, resumed on the same layout and (a copy of it) on another
    interrupt(cmd(tmp_path / "same", corpus, *DATA_PARALLEL), 4)
    shutil.copytree(tmp_path / "same", tmp_path / "other")
    for name, layout in (("same", DATA_PARALLEL), ("other", PIPELINE)):
        d = tmp_path / name
        stopped = max(losses(d))
        assert stopped < STEPS
        r = run(cmd(d, corpus, *layout, "resume=auto"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"at step {stopped}" in r.stdout
        assert ids(d) == want, name  # no example seen twice, none skipped
        a, b = losses(d), losses(straight)
        assert all(abs(a[s] - b[s]) <= 1e-5 * abs(b[s]) for s in b), (name, a, b)

    # another corpus, another tokenizer: refused by name; data.allow_change lets it through
    d = tmp_path / "same"
    other = [f"data.path={corpus / 'b.jsonl'}", "resume=auto", f"train.steps={STEPS + 2}"]
    r = run(cmd(d, corpus, *DATA_PARALLEL, *other))
    assert r.returncode == 2 and "a.jsonl" in r.stderr and "b.jsonl" in r.stderr, r.stderr
    assert "data.allow_change=true" in r.stderr
    r = run(cmd(d, corpus, *DATA_PARALLEL, *other, "data.allow_change=true"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
