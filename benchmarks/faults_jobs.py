"""The faults of reliability round three (issue 36), as ``benchmarks/faults.py`` runs them:

- ``concurrent``: two ``fiddlejax train`` started at once on one ``checkpoint.dir`` (fresh, then
  both ``resume=auto``): one runs, the other is refused (exit 2) naming the holder; nothing of the
  runner's is lost and its resumed run equals an uninterrupted one bitwise.
- ``nan``: a run that diverges (``optimizer.lr=100``: a NaN gradient norm under a finite loss;
  ``optimizer.lr=1e30``: a NaN loss): the non-finite updates are skipped, the job stops after
  ``train.nonfinite_limit`` in a row with exit 1 naming the last good checkpoint as
  ``resume=N``, and every checkpoint written holds only finite values.
- ``frozen``: SIGSTOP on one of two processes under ``launch/local.py``: the survivor names the
  frozen peer in one line within 60 s, no C++ stack dump, the launcher exits non-zero, not 134.
- ``ulimit``: a synchronous save past the file-size limit (``ulimit -f``): exit 1, one line
  naming the directory, the earlier checkpoints byte for byte untouched, and ``resume=auto``
  afterwards ends exactly like an uninterrupted run. Needs no root (unlike the tmpfs disks).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from fault_tools import ONE, TINY, TWO, committed, env, launcher, losses, ranks, run, start, train


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and ".orbax-checkpoint-tmp"
            not in str(p)}


def _two_at_once(cmds: list[list[str]]) -> list[tuple[int, str, str]]:
    procs = [start(c) for c in cmds]
    return [(p.wait(timeout=600), *p.communicate()) for p in procs]


def concurrent(tmp: Path, trials: int, steps: int = 8) -> dict:
    cfg = [*ONE, "checkpoint.every=2", "checkpoint.async=false", "checkpoint.max_to_keep=null"]
    ref = tmp / "conc-ref"  # the same two runs, one at a time
    for extra in ([f"train.steps={steps}"], [f"train.steps={2 * steps}", "resume=auto"]):
        assert run(train(ref, *cfg, f"checkpoint.dir={ref / 'ckpt'}", *extra)).returncode == 0
    want = losses(ref)
    failures, lost, exact_all, notes = 0, 0, True, []
    for t in range(trials):
        ck = tmp / f"conc{t}" / "ckpt"
        ok, winner, got = True, None, {}
        for phase, extra in (("fresh", [f"train.steps={steps}"]),
                             ("resume=auto", [f"train.steps={2 * steps}", "resume=auto"])):
            dirs = [tmp / f"conc{t}" / f"{phase}-{i}" for i in range(2)]
            if winner is not None:  # the resume runs in the run directory that saved
                dirs[0] = winner
            done = _two_at_once([train(d, *cfg, f"checkpoint.dir={ck}", *extra) for d in dirs])
            codes = [c for c, _, _ in done]
            ran = [i for i, c in enumerate(codes) if c == 0]
            refused = [e.strip() for c, _, e in done if c == 2]
            ok &= (sorted(codes) == [0, 2] and len(refused) == 1
                   and "is in use by another fiddlejax job (host" in refused[0]
                   and refused[0].count("\n") == 0)
            if not ran:
                break
            winner = dirs[ran[0]]
            got.update(losses(winner))  # the steps this phase's runner logged
            end = steps if phase == "fresh" else 2 * steps
            lost += max(0, end - (committed(ck) or 0))
        exact = got == want
        exact_all &= exact
        failures += not (ok and exact)
        notes.append(f"{'refused the second job twice' if ok else 'NOT REFUSED'}, "
                     f"{'exact' if exact else 'DIFFERS'}")
    return {"scenario": "two jobs at once on one checkpoint.dir (fresh, then both resume=auto)",
            "trials": trials, "failures": failures, "lost": lost, "exact": exact_all,
            "note": "; ".join(notes)}


def nan(tmp: Path) -> dict:
    """NaN injected through the learning rate: a finite loss with NaN gradients, a NaN loss."""
    from fiddlejax.checkpoint import CheckpointManager

    failures, lost, notes = 0, 0, []
    for lr in ("100", "1e30"):
        d = tmp / f"nan-{lr}"
        ck = d / "ckpt"
        cfg = [*ONE, f"optimizer.lr={lr}", "optimizer.warmup_steps=0", "train.steps=60",
               "checkpoint.every=1", "checkpoint.max_to_keep=null", "checkpoint.async=false",
               "train.nonfinite_limit=3", f"checkpoint.dir={ck}"]
        r = run(train(d, *cfg))
        line = r.stderr.strip()
        m = re.search(r"step (\d+): the (loss|gradient norm) is \S+.*the last checkpoint is step "
                      r"(\d+) in .*\(resume=(\d+) continues from it\)", line)
        ok = r.returncode == 1 and line.count("\n") == 0 and m is not None
        first = int(m.group(1)) if m else 0
        newest = committed(ck) or 0
        ok &= m is not None and int(m.group(3)) == int(m.group(4)) == newest < first
        finite, steps = _finite_checkpoints(ck, cfg, CheckpointManager)
        ok &= finite
        lost += max(0, first - 1 - newest) if m else 0
        failures += not ok
        what = m.group(2) if m else "?"
        notes.append(f"lr={lr}: non-finite {what} from step {first}, exit {r.returncode}, "
                     f"resume={newest} named, {steps} checkpoints all finite" if finite else
                     f"lr={lr}: {steps} checkpoints, SOME NOT FINITE")
    return {"scenario": "NaN injection: lr=100 (NaN gradients, finite loss), lr=1e30 (NaN loss)",
            "trials": 2, "failures": failures, "lost": lost, "exact": None,
            "note": "; ".join(notes)}


def _finite_checkpoints(ck: Path, cfg: list[str], manager) -> tuple[bool, int]:
    """Whether every checkpoint in ``ck`` restores to finite values (onto one device)."""
    import jax
    import numpy as np

    import fiddlejax as fj
    from fiddlejax.app import build, config

    c = config.load(None, [*TINY, *cfg])
    tr = fj.parallelize(build.build_model(c["model"], 0), build.make_optimizer(c),
                        fj.Plan(mesh=fj.make_mesh(data=1, devices=jax.devices()[:1])))
    with manager(ck, tr, read_only=True) as m:
        steps = m.all_steps()
        ok = all(all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(m.restore(s)))
                 for s in steps)
    return ok and bool(steps), len(steps)


def frozen(tmp: Path, trials: int) -> dict:
    failures, notes = 0, []
    for t in range(trials):
        rank = 1 - t % 2  # the second process, then the first (the coordinator)
        p = start(launcher(*train(tmp / f"frozen{t}", *TWO, "train.steps=100000",
                                  "checkpoint.dir=null")))
        wait_for = r"\[0\] step\s+\d+ \|"
        for line in p.stdout:
            if re.search(wait_for, line):
                break
        os.kill(ranks(p.pid)[rank], signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        took, code = time.monotonic() - t0, p.returncode
        named = [x for x in err.splitlines() if f"lost process {rank}" in x
                 and "stopped answering" in x]
        ok = (code not in (0, 134) and took < 60 and len(named) == 1 and "Check failure" not in
              err and "*** " not in err and f"process {rank} is stopped" in err)
        failures += not ok
        notes.append(f"rank {rank} stopped: launcher exit {code} after {took:.1f} s")
    return {"scenario": "SIGSTOP (frozen) one of two processes under launch/local.py",
            "trials": trials, "failures": failures, "lost": 0, "exact": None,
            "note": "; ".join(notes)}


def ulimit(tmp: Path, steps: int = 8) -> dict:
    cfg = [*ONE, "checkpoint.every=2", "checkpoint.async=false", "checkpoint.max_to_keep=null"]
    ref = tmp / "ulimit-ref"  # the same runs without the limit (train.steps shapes the schedule)
    for extra in ([f"train.steps={steps // 2}"], [f"train.steps={steps}", "resume=auto"]):
        assert run(train(ref, *cfg, f"checkpoint.dir={ref / 'ckpt'}", *extra)).returncode == 0
    d = tmp / "ulimit"
    ck = d / "ckpt"
    assert run(train(d, *cfg, f"checkpoint.dir={ck}", f"train.steps={steps // 2}")
               ).returncode == 0
    before = _digest(ck)
    cmd = train(d, *cfg, f"checkpoint.dir={ck}", f"train.steps={steps}", "resume=auto")
    r = subprocess.run(["bash", "-c", 'ulimit -f 64 && exec "$@"', "bash", *cmd],
                       capture_output=True, text=True, timeout=600,
                       env=env(JAX_ENABLE_COMPILATION_CACHE="false"))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    ok = (r.returncode == 1 and len(lines) == 1 and f"to {ck} failed (File too large" in lines[0]
          and f"(step {steps // 2}) is intact" in lines[0] and _digest(ck) == before)
    r2 = run(train(d, *cfg, f"checkpoint.dir={ck}", f"train.steps={steps}", "resume=auto"))
    exact = r2.returncode == 0 and losses(d) == losses(ref)
    return {"scenario": "synchronous save past `ulimit -f` (a full disk without root)",
            "trials": 1, "failures": int(not (ok and exact)), "lost": 0, "exact": exact,
            "note": f"exit {r.returncode}, {len(r.stderr.splitlines())} stderr line(s), steps "
                    f"1-{steps // 2} byte-identical; resume=auto after it "
                    f"{'exact' if exact else 'DIFFERS'}"}
