"""What the fault-injection scenarios share: the tiny job, its commands and the readers of what
it leaves behind (``benchmarks/faults.py`` and ``benchmarks/faults_jobs.py``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "faults.md"
TINY = ["model.vocab_size=256", "model.seq_len=16", "model.d_model=32", "model.n_heads=4",
        "model.n_layers=2", "model.d_ff=64", "data.batch_size=8", "mesh.pipe=1",
        "mesh.tensor=1", "plan.schedule=null", "plan.microbatches=1", "train.eval_every=0",
        "train.eval_batches=0", "train.log_every=1", "run.progress=lines",
        "optimizer.warmup_steps=5"]
ONE = ["run.cpu_devices=2", "mesh.data=2"]  # one process, 2 devices
TWO = ["mesh.data=4"]  # two processes x 2 devices


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("FIDDLEJAX_", "SLURM_", "OMPI_", "JAX_NUM_CPU_DEVICES"))}
    e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
    e.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **CACHE, **extra)
    return e


CACHE: dict[str, str] = {}


def train(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fiddlejax.cli", "train", *TINY, f"run.dir={run_dir}", *extra]


def launcher(*cmd: str) -> list[str]:
    return [sys.executable, str(ROOT / "launch" / "local.py"), "--nproc", "2",
            "--devices-per-process", "2", "--", *cmd]


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), "a step is logged twice"
    return {r["step"]: r["loss"] for r in recs}


def committed(ckpt: Path) -> int | None:
    steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.is_dir() else []
    return max(steps) if steps else None


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=kw.pop("env", env()),
                          timeout=kw.pop("timeout", 600), cwd=ROOT, **kw)


def start(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=kw.pop("env", env()), cwd=ROOT, start_new_session=True, **kw)


def wait_for_step(p: subprocess.Popen, pattern: str = r"step\s+\d+ \|") -> list[str]:
    """Lines of ``p``'s stdout up to its first step line (or its end)."""
    out = []
    for line in p.stdout:
        out.append(line)
        if re.search(pattern, line):
            break
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(launcher_pid: int) -> list[int]:
    """The launcher's two training processes, rank order (by FIDDLEJAX_PROCESS_ID)."""
    kids = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True,
                          text=True).stdout.split()
    ranked = {}
    for k in kids:
        environ = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
        rank = [e for e in environ if e.startswith(b"FIDDLEJAX_PROCESS_ID=")]
        if rank:
            ranked[int(rank[0].split(b"=")[1])] = int(k)
    return [ranked[r] for r in sorted(ranked)]
