"""Reliability, round three (issue 36), as a user meets it: the real `fiddlejax train` in
subprocesses. Two jobs at once on one checkpoint directory, then a disk that refuses the next
synchronous save; a run whose gradients turn NaN; a frozen peer under launch/local.py."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

import fiddlejax as fj
from fiddlejax import checkpoint as ckpt
from fiddlejax.checkpoint.lock import LOCK_NAME

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.vocab_size=256", "model.seq_len=16", "model.d_model=32", "model.n_heads=4",
        "model.n_layers=2", "model.d_ff=64", "data.batch_size=8", "mesh.pipe=1",
        "mesh.tensor=1", "plan.schedule=null", "plan.microbatches=1", "train.eval_every=0",
        "train.eval_batches=0", "train.log_every=1", "run.progress=lines"]
ONE = [*TINY, "run.cpu_devices=2", "mesh.data=2"]


def train_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "fiddlejax.cli", "train", *extra]


def start(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, **kw)


def trainer_for(*overrides: str) -> fj.Trainer:
    """The job's model and optimizer (any layout restores: checkpoints are canonical)."""
    from fiddlejax.app import build, config

    cfg = config.load(None, list(overrides))
    mesh = fj.make_mesh(data=2, devices=jax.devices()[:2])
    return fj.parallelize(build.build_model(cfg["model"], 0), build.make_optimizer(cfg),
                          fj.Plan(mesh=mesh))


def digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_two_jobs_at_once_lose_nothing_and_a_full_disk_changes_nothing(tmp_path):
    """Both used to exit 0 while the second silently lost its checkpoints; now one holds the
    directory and the other is refused, naming it and the holder. Then a synchronous save that
    the disk refuses (`ulimit -f`) ended with exit 2 and hundreds of traceback lines: now one
    line naming the directory, exit 1, and the earlier checkpoints untouched."""
    ck = tmp_path / "ckpt"
    cfg = [*ONE, "train.steps=4", "checkpoint.every=2", "checkpoint.async=false",
           f"checkpoint.dir={ck}"]
    jobs = [start(train_cmd(*cfg, f"run.dir={tmp_path / name}")) for name in ("a", "b")]
    done = [(p.wait(timeout=600), *p.communicate()) for p in jobs]
    codes = sorted(code for code, _, _ in done)
    assert codes == [0, 2], [(c, e[-2000:]) for c, _, e in done]
    winner = next(i for i, (c, _, _) in enumerate(done) if c == 0)
    refused = done[1 - winner][2].strip()
    assert refused.count("\n") == 0 and "Traceback" not in refused, refused
    assert f"checkpoint.dir={ck} is in use by another fiddlejax job (host " in refused, refused
    assert f"pid {jobs[winner].pid}, run.dir={tmp_path / 'ab'[winner]}" in refused, refused
    assert not (ck / LOCK_NAME).exists()  # released at the end
    tr = trainer_for(*cfg)
    with ckpt.CheckpointManager(ck, tr) as m:
        assert m.all_steps() == [2, 4]  # the winner's, complete
        m.restore(4)

    before = digest(ck)  # `ulimit -f 64`: files up to 64 KiB; a write past it fails (EFBIG)
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}  # only checkpoints are large
    cmd = train_cmd(*cfg, "train.steps=8", "resume=auto", f"run.dir={tmp_path / 'a'}")
    r = subprocess.run(["bash", "-c", 'ulimit -f 64 && exec "$@"', "bash", *cmd],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1, r.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert re.search(rf"saving checkpoint step 6 to {ck} failed \(File too large: a file size "
                     r"limit \(ulimit -f\?\)\); nothing was changed: the previous checkpoint "
                     r"\(step 4\) is intact .*resume=4", lines[0]), lines[0]
    after = {k: v for k, v in digest(ck).items() if not k.startswith("6.orbax-checkpoint-tmp")}
    assert after == before  # steps 2 and 4, byte for byte
    with ckpt.CheckpointManager(ck, tr) as m:
        assert m.all_steps() == [2, 4]


def test_a_nan_gradient_run_saves_only_finite_checkpoints(tmp_path):
    """optimizer.lr=100: the loss grows until a step's gradient norm is NaN while its loss is
    still finite; that update was applied and saved (54 NaN arrays), and the message sent the
    user back to it. Now such steps are skipped, and the job stops after nonfinite_limit of them
    in a row, naming the first and the last good checkpoint as resume=N."""
    ck = tmp_path / "ckpt"
    cfg = [*ONE, "optimizer.lr=100", "optimizer.warmup_steps=0", "train.steps=40",
           "checkpoint.every=1", "checkpoint.max_to_keep=null", "checkpoint.async=false",
           "train.nonfinite_limit=3", f"checkpoint.dir={ck}"]
    r = subprocess.run(train_cmd(*cfg, f"run.dir={tmp_path}"), capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    line = r.stderr.strip()
    assert line.count("\n") == 0 and "Traceback" not in line, line
    m = re.search(r"step (\d+): the (loss|gradient norm) is (nan|inf).*; stopped before saving "
                  r"it; the last checkpoint is step (\d+) in .* \(resume=(\d+) continues from it\);"
                  r" train.nonfinite=skip skipped steps (\d+)-(\d+)", line)
    assert m, line
    first, last, resume = int(m.group(1)), int(m.group(4)), int(m.group(5))
    assert last == resume < first and int(m.group(6)) == first, line
    assert int(m.group(7)) == first + 2  # three in a row
    assert re.search(rf"step {first}: the .* its update was skipped \(1 in a row", r.stdout)
    with ckpt.CheckpointManager(ck, trainer_for(*cfg)) as mgr:
        assert max(mgr.all_steps()) == last  # nothing saved from the first bad step on
        for step in mgr.all_steps():
            leaves = jax.tree.leaves(mgr.restore(step))
            assert all(np.isfinite(np.asarray(x)).all() for x in leaves), step


def test_a_frozen_peer_ends_the_job_with_one_line(tmp_path):
    """SIGSTOP on one of two processes: the survivor used to abort 16-36 s later with SIGABRT
    and a C++ stack dump (launcher exit 134). Now its heartbeat watchdog names the peer."""
    cmd = [sys.executable, str(ROOT / "launch" / "local.py"), "--nproc", "2",
           "--devices-per-process", "2", "--",
           *train_cmd(*TINY, "mesh.data=4", "train.steps=100000", "checkpoint.dir=null",
                      f"run.dir={tmp_path}")]
    env = {**os.environ, "XLA_FLAGS": " ".join(  # 2 devices each; the suite's other flags
        f for f in os.environ["XLA_FLAGS"].split() if "host_platform_device_count" not in f)}
    p = start(cmd, env=env, start_new_session=True)
    for line in p.stdout:
        if re.search(r"\[0\] step\s+\d+ \|", line):
            break
    kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True)
    ranks = {}
    for k in kids.stdout.split():
        environ = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
        rank = [e for e in environ if e.startswith(b"FIDDLEJAX_PROCESS_ID=")]
        if rank:
            ranks[int(rank[0].split(b"=")[1])] = int(k)
    os.kill(ranks[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    assert took < 60 and p.returncode not in (0, 134), (took, p.returncode, err[-3000:])
    lost = [x for x in err.splitlines() if "lost process 1" in x]
    assert len(lost) == 1 and lost[0].startswith("[0] ") and "stopped answering" in lost[0], err
    assert "Check failure" not in err and "*** " not in err and "SIGABRT" not in err
    assert "(process 1 is stopped: SIGSTOP or a debugger; killed at once)" in err, err
