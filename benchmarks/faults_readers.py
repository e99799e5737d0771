"""The faults of reliability round four (issue 49), as ``benchmarks/faults.py`` runs them:

- ``readers``: a trainer saving every step (async, ``max_to_keep`` 3) while ``fiddlejax eval``,
  ``generate`` and ``export`` run against its run directory, with a temporary directory of a
  save in progress planted beside its checkpoints. The readers used to clean such directories
  on open (the trainer's own save in progress included: it stopped with exit 1). The trainer
  must exit 0 (stopped with SIGTERM once the readers are done, so they overlap it), every
  checkpoint it leaves must restore with its fingerprints, and the planted directory must
  survive.
- ``export``: ``fiddlejax export`` of a tiny Llama into a directory holding the user's files
  (they must stay byte-identical), into one holding a ``config.json`` no export wrote (refused,
  exit 2, one line, nothing touched), then a re-export under ``ulimit -f 8`` (shards larger
  than the limit): exit 1, one line, the previous export byte-identical and loadable
  (``fiddlejax generate model.from_pretrained=OUT``).
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_tools import ONE, TINY, committed, env, run, start, train, wait_for_step


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fiddlejax.cli", *args]


def readers(tmp: Path) -> dict:
    from fiddlejax.checkpoint import CheckpointManager

    d = tmp / "readers"
    ck = d / "checkpoints"
    p = start(train(d, *ONE, "train.steps=100000", "checkpoint.every=1", "checkpoint.async=true",
                    "checkpoint.max_to_keep=3", "train.log_every=10"))
    wait_for_step(p, r"step\s+10 \|")  # a few saves committed (and deleted) by now
    planted = ck / "999999.orbax-checkpoint-tmp" / "state"
    planted.mkdir(parents=True)
    (planted / "blob").write_bytes(b"a save in progress")
    jobs = {"eval": _cli("eval", f"run.dir={d}", "batches=2"),
            "generate": _cli("generate", f"run.dir={d}", "prompt=def ", "max_new_tokens=4"),
            "export": _cli("export", str(d), str(tmp / "readers-hf"))}
    t0 = time.monotonic()
    procs = {k: start(c) for k, c in jobs.items()}
    done = {k: (q.wait(timeout=600), q.communicate()[1]) for k, q in procs.items()}
    took = time.monotonic() - t0
    overlapped = p.poll() is None  # the trainer was still saving when the readers ended
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    steps = sorted(int(q.name) for q in ck.iterdir() if q.name.isdigit())
    intact = _restores(ck, steps, CheckpointManager)
    survived = (planted / "blob").is_file()
    readers_ok = all(c == 0 for c, _ in done.values())
    ok = p.returncode == 0 and overlapped and intact and survived and readers_ok
    notes = ", ".join(f"{k} exit {c}" + (f" ({e.strip().splitlines()[-1][:160]})" if c else "")
                      for k, (c, e) in done.items())
    return {"scenario": "eval, generate and export against a live trainer saving every step",
            "trials": 1, "failures": int(not ok), "lost": 0, "exact": None,
            "note": f"trainer exit {p.returncode} (SIGTERM after the readers, stopped at step "
                    f"{committed(ck)}), {len(steps)} checkpoints left all restore verified"
                    f"{'' if intact else ' NOT ALL'}; {notes} in {took:.0f} s, overlapping the "
                    f"trainer: {'yes' if overlapped else 'NO'}; a planted save in progress "
                    f"{'kept' if survived else 'DELETED'}"}


def _restores(ck: Path, steps: list[int], manager) -> bool:
    """Every step restores onto one device, every array's fingerprint checked."""
    import jax

    import fiddlejax as fj
    from fiddlejax.app import build, config

    c = config.load(None, [*TINY, *ONE])
    tr = fj.parallelize(build.build_model(c["model"], 0), build.make_optimizer(c),
                        fj.Plan(mesh=fj.make_mesh(data=1, devices=jax.devices()[:1])))
    try:
        with manager(ck, tr, read_only=True) as m:
            for s in steps:
                m.restore(s)
    except (ValueError, OSError) as e:
        print(f"  readers: a checkpoint does not restore: {e}", flush=True)
        return False
    return bool(steps)


LLAMA = ["model.name=llama", "model.n_kv_heads=2", "checkpoint.async=false", "train.steps=2"]
USER = {"model-backup.safetensors": b"the user's backup weights", "model_v1.safetensors": b"v1",
        "README.md": b"# my model\n"}


def export(tmp: Path) -> dict:
    d = tmp / "export-run"
    assert run(train(d, *ONE, *LLAMA)).returncode == 0
    notes, ok = [], True
    # 1. a directory holding the user's files: written beside them, never over them
    out = tmp / "export-out"
    out.mkdir()
    for name, data in USER.items():
        (out / name).write_bytes(data)
    r = run(_cli("export", str(d), str(out)))
    kept = all((out / n).read_bytes() == b for n, b in USER.items())
    ok &= r.returncode == 0 and kept
    notes.append(f"beside 3 user files: exit {r.returncode}, user files "
                 f"{'byte-identical' if kept else 'CHANGED'}")
    # 2. a config.json that no export wrote: refused, nothing touched
    theirs = tmp / "export-theirs"
    theirs.mkdir()
    (theirs / "config.json").write_bytes(b'{"model_type": "the user\'s"}')
    before = _digest(theirs)
    r = run(_cli("export", str(d), str(theirs)))
    lines = r.stderr.strip().splitlines()
    refused = r.returncode == 2 and len(lines) == 1 and _digest(theirs) == before
    ok &= refused
    notes.append(f"over a user's config.json: exit {r.returncode}, {len(lines)} line, "
                 f"{'untouched' if refused else 'TOUCHED'}")
    # 3. a re-export that fails half-way (file size limit): the previous export intact
    before = _digest(out)
    cmd = _cli("export", str(d), str(out), "--max-shard-size", "20KB")
    r = subprocess.run(["bash", "-c", 'ulimit -f 8 && exec "$@"', "bash", *cmd],
                       capture_output=True, text=True, timeout=600,
                       env=env(JAX_ENABLE_COMPILATION_CACHE="false"))
    lines = r.stderr.strip().splitlines()
    intact = _digest(out) == before
    left = [q.name for q in tmp.iterdir() if "fiddlejax-export" in q.name]
    loads = run(_cli("generate", f"model.from_pretrained={out}", "prompt=def ",
                     "max_new_tokens=4"))
    ok &= (r.returncode == 1 and len(lines) == 1 and "File too large" in lines[0] and intact
           and not left and loads.returncode == 0)
    notes.append(f"re-export past `ulimit -f 8`: exit {r.returncode}, {len(lines)} stderr line, "
                 f"previous export {'byte-identical' if intact else 'CHANGED'}, "
                 f"{'loads' if loads.returncode == 0 else 'DOES NOT LOAD'} (fiddlejax generate "
                 f"exit {loads.returncode}), {len(left)} temporary directories left")
    return {"scenario": "fiddlejax export beside user files, over a user's file, failing "
                        "half-way", "trials": 3, "failures": int(not ok), "lost": 0,
            "exact": None, "note": "; ".join(notes)}
