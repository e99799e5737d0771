"""Fault injection: kill, preempt, corrupt and starve `fiddlejax train`, count what is lost.

Every scenario runs the real command (a tiny GPT on 2 simulated CPU devices per process) and
compares with an uninterrupted reference run of the same config, step by step:

- ``sigkill``: SIGKILL at random moments while async saves run (every 2 steps), then
  ``resume=auto``, N times in a chain. A trial fails if the resume starts before the newest
  committed checkpoint (a lost step) or any loss differs from the reference (bitwise).
- ``sigterm-launcher``: SIGTERM to ``launch/local.py`` running two processes: both save, the
  launcher exits 0, and the resumed run's losses equal the uninterrupted two-process run's.
- ``corrupt``: the newest checkpoint truncated or bit-flipped: ``resume=auto`` is refused (exit
  2) naming the step and suggesting ``resume=<previous>``; that resume finishes exactly.
- ``peer-kill``: SIGKILL of one of two processes (with and without the launcher): the survivor
  prints one line naming the lost process and exits non-zero within 60 s, no C++ stack dump;
  the launcher exits non-zero.
- ``disk``: a read-only and a full checkpoint disk (tmpfs mounts; needs root, else skipped):
  refused before the first step / the failed save stops the run (exit 1), nothing continues
  without saves.
- ``concurrent``, ``nan``, ``frozen``, ``ulimit`` (round three, ``benchmarks/faults_jobs.py``):
  two jobs on one checkpoint directory, NaN injection, a frozen peer, a file-size limit.
- ``readers``, ``export`` (round four, ``benchmarks/faults_readers.py``): eval, generate and
  export against a live trainer; export beside the user's files and failing half-way.

    python benchmarks/faults.py [--kills 20] [--trials 2] [--seed 0]

writes ``benchmarks/results/faults.md`` (with ``--only``: prints those rows, writes nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import faults_jobs
import faults_readers
import reporting
from fault_tools import (
    CACHE,
    ONE,
    OUT,
    TWO,
    committed,
    env,
    free_port,
    launcher,
    losses,
    ranks,
    run,
    start,
    train,
    wait_for_step,
)


# -- scenarios ---------------------------------------------------------------------------------
def sigkill_chain(tmp: Path, kills: int, steps: int, rng: random.Random) -> dict:
    cfg = [*ONE, f"train.steps={steps}", "checkpoint.every=2", "checkpoint.async=true"]
    ref = tmp / "ref"
    r = run(train(ref, *cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    want = losses(ref)
    step_s = sorted(json.loads(x)["step_time_s"] for x in
                    (ref / "metrics.jsonl").read_text().splitlines()[1:])[steps // 2]
    d, ck = tmp / "chain", tmp / "chain" / "ckpt"
    trials, failures, lost, redone, mid_save = 0, 0, 0, [], 0
    last_committed = None
    for _ in range(kills):
        extra = ["resume=auto"] if ck.exists() else []
        p = start(train(d, *cfg, f"checkpoint.dir={ck}", *extra))
        head = wait_for_step(p)
        resumed = next((int(m.group(1)) for x in head
                        if (m := re.search(r"resumed from .* at step (\d+)", x))), 0)
        if last_committed is not None:
            trials += 1
            if resumed != last_committed:  # it must resume from the newest committed save
                failures += 1
                lost += max(0, last_committed - resumed)
                print(f"  trial {trials}: resumed at {resumed}, newest committed "
                      f"{last_committed}: {sorted(q.name for q in ck.iterdir())}", flush=True)
        # Anywhere from mid-step to a few saves later (the first save after a start is slow).
        time.sleep(rng.uniform(0, max(1.5, 20 * step_s)))
        if p.poll() is not None:  # finished before the kill: the chain is over
            break
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        logged = max(losses(d)) if (d / "metrics.jsonl").exists() else 0
        last_committed = committed(ck) or 0
        mid_save += any(".orbax-checkpoint-tmp" in q.name for q in ck.iterdir())
        redone.append(logged - last_committed)
    r = run(train(d, *cfg, f"checkpoint.dir={ck}", "resume=auto"))
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"resumed from .* at step (\d+)", r.stdout)
    trials += 1
    if (int(m.group(1)) if m else 0) != last_committed:
        failures += 1
        print(f"  final resume: {m.group(0) if m else r.stdout[-500:]!r}, newest committed "
              f"{last_committed}", flush=True)
    got = losses(d)
    exact = got == want
    if not exact:
        failures += 1
    return {"scenario": f"SIGKILL at random moments, async saves every 2 steps ({steps} steps)",
            "trials": trials, "failures": failures, "lost": lost, "exact": exact,
            "note": f"re-ran {sum(redone)} steps after {len(redone)} kills (max {max(redone)}, "
                    f"never beyond the last committed save); {mid_save} kills left a save "
                    "half-written (ignored on resume)"}


def sigterm_launcher(tmp: Path, trials: int, steps: int) -> dict:
    cfg = [*TWO, f"train.steps={steps}", "checkpoint.every=4"]
    ref = tmp / "ref2"
    r = run(launcher(*train(ref, *cfg)))
    assert r.returncode == 0, r.stderr[-2000:]
    want = losses(ref)
    failures, exact_all, notes = 0, True, []
    for t in range(trials):
        d = tmp / f"term{t}"
        p = start(launcher(*train(d, *cfg, f"checkpoint.dir={d / 'ckpt'}")))
        wait_for_step(p, r"\[0\] step\s+[3-9] \|")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        saved = re.findall(r"\[(\d)\] preempted: saved step (\d+)", out)
        ok = p.returncode == 0 and len(saved) == 1  # only process 0 prints
        r = run(launcher(*train(d, *cfg, f"checkpoint.dir={d / 'ckpt'}", "resume=auto")))
        exact = r.returncode == 0 and losses(d) == want
        exact_all &= exact
        failures += not (ok and exact)
        notes.append(f"launcher exit {p.returncode}, saved step {saved[0][1] if saved else '-'}")
    return {"scenario": "SIGTERM to launch/local.py, 2 processes", "trials": trials,
            "failures": failures, "lost": 0, "exact": exact_all, "note": "; ".join(notes)}


def corrupt(tmp: Path, steps: int) -> dict:
    cfg = [*ONE, f"train.steps={steps}", "checkpoint.every=4", "checkpoint.async=false"]
    ref = tmp / "ref3"
    assert run(train(ref, *cfg)).returncode == 0
    want = losses(ref)
    failures, notes = 0, []
    for damage in ("truncate", "bitflip"):
        d = tmp / damage
        ck = d / "ckpt"
        half = [f"train.steps={steps // 2}"]
        assert run(train(d, *cfg, *half, f"checkpoint.dir={ck}")).returncode == 0
        newest = committed(ck)
        files = sorted((ck / str(newest) / "state").rglob("ocdbt.process_0/d/*"),
                       key=lambda q: q.stat().st_size)
        data = files[-1].read_bytes()
        if damage == "truncate":
            files[-1].write_bytes(data[:len(data) // 2])
        else:
            b = bytearray(data)
            b[len(b) // 2] ^= 0x01
            files[-1].write_bytes(bytes(b))
        r = run(train(d, *cfg, f"checkpoint.dir={ck}", "resume=auto"))
        line = r.stderr.strip()
        prev = newest - 4
        refused = (r.returncode == 2 and line.count("\n") == 0 and f"step {newest}" in line
                   and f"resume={prev}" in line and "Traceback" not in r.stderr)
        r2 = run(train(d, *cfg, f"checkpoint.dir={ck}", f"resume={prev}"))
        exact = r2.returncode == 0 and losses(d) == want
        failures += not (refused and exact)
        notes.append(f"{damage}: refused (exit {r.returncode}), resume={prev} "
                     f"{'exact' if exact else 'DIFFERS'}")
    return {"scenario": "truncated / bit-flipped newest checkpoint", "trials": 2,
            "failures": failures, "lost": 0, "exact": failures == 0, "note": "; ".join(notes)}


def peer_kill(tmp: Path, trials: int) -> dict:
    cfg = [*TWO, "train.steps=100000"]
    failures, notes = 0, []
    for t in range(trials):
        via = "launcher" if t % 2 else "bare"
        d = tmp / f"peer{t}"
        if via == "launcher":
            p = start(launcher(*train(d, *cfg)))
            wait_for_step(p, r"\[0\] step\s+\d+ \|")
            pids = ranks(p.pid)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            out, err = p.communicate(timeout=120)
            took, code = time.monotonic() - t0, p.returncode
            survivor_err = "\n".join(x for x in err.splitlines() if x.startswith("[0]"))
        else:
            port = free_port()
            procs = [start(train(d, *cfg), env=env(
                FIDDLEJAX_COORDINATOR=f"127.0.0.1:{port}", FIDDLEJAX_NUM_PROCESSES="2",
                FIDDLEJAX_PROCESS_ID=str(r), FIDDLEJAX_CPU_DEVICES="2")) for r in range(2)]
            wait_for_step(procs[0])
            procs[1].kill()
            t0 = time.monotonic()
            _, survivor_err = procs[0].communicate(timeout=120)
            took, code = time.monotonic() - t0, procs[0].returncode
            procs[1].wait()
        lines = [x for x in survivor_err.splitlines() if "lost process 1" in x]
        ok = (code != 0 and took < 60 and len(lines) == 1 and "Check failure" not in survivor_err
              and "SIGABRT" not in survivor_err and "*** " not in survivor_err)
        failures += not ok
        notes.append(f"{via}: exit {code} after {took:.1f} s")
    return {"scenario": "SIGKILL of one of two processes", "trials": trials,
            "failures": failures, "lost": 0, "exact": None, "note": "; ".join(notes)}


def disk(tmp: Path) -> dict:
    mnt = tmp / "mnt"
    mnt.mkdir()
    notes, failures, trials = [], 0, 0
    for kind, opts in (("read-only", "ro,size=1m"), ("full", "size=256k")):
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
                          capture_output=True).returncode != 0:
            notes.append(f"{kind}: skipped (mounting a tmpfs needs root)")
            continue
        try:
            trials += 1
            d = tmp / f"disk-{kind}"
            r = run(train(d, *ONE, "train.steps=30", f"checkpoint.dir={mnt / 'ckpt'}",
                          "checkpoint.every=4"))
            line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
            done = len(losses(d)) if (d / "metrics.jsonl").exists() else 0
            if kind == "read-only":
                ok = r.returncode == 2 and "is not writable" in line and done == 0
                notes.append(f"read-only: exit {r.returncode} before step 1")
            else:
                m = re.search(r"saving checkpoint step (\d+)", line)
                ok = r.returncode == 1 and m is not None and done <= int(m.group(1)) + 4
                notes.append(f"full: exit {r.returncode}, stopped at step {done} after the "
                             f"failed save of step {m.group(1) if m else '?'}")
            failures += not ok
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
    return {"scenario": "checkpoint disk read-only / full", "trials": trials,
            "failures": failures, "lost": 0, "exact": None, "note": "; ".join(notes)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="SIGKILL trials (default 20)")
    ap.add_argument("--trials", type=int, default=2,
                    help="trials of the concurrent-jobs and frozen-peer faults (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=None, help="scenario names to run; their rows are "
                    "printed, the results file is left alone (only a full run writes it)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="fiddlejax-faults-"))
    CACHE.update(JAX_COMPILATION_CACHE_DIR=str(tmp / "jax-cache"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    t0 = time.time()
    rows = []
    try:
        for name, fn in (("sigkill", lambda: sigkill_chain(tmp, args.kills, 400, rng)),
                         ("sigterm", lambda: sigterm_launcher(tmp, 2, 16)),
                         ("corrupt", lambda: corrupt(tmp, 16)),
                         ("peer", lambda: peer_kill(tmp, 4)),
                         ("disk", lambda: disk(tmp)),
                         ("concurrent", lambda: faults_jobs.concurrent(tmp, args.trials)),
                         ("nan", lambda: faults_jobs.nan(tmp)),
                         ("frozen", lambda: faults_jobs.frozen(tmp, args.trials)),
                         ("ulimit", lambda: faults_jobs.ulimit(tmp)),
                         ("readers", lambda: faults_readers.readers(tmp)),
                         ("export", lambda: faults_readers.export(tmp))):
            if args.only is not None and name not in args.only:
                continue
            t = time.time()
            rows.append(fn())
            rows[-1]["seconds"] = time.time() - t
            print(f"{name}: {rows[-1]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.only is not None:  # a partial run: the report is written whole, by a full run
        print("\n".join(_row(r) for r in rows))
        return int(any(r["failures"] for r in rows))
    lines = ["# Fault injection", "",
             f"`python benchmarks/faults.py --kills {args.kills} --trials {args.trials} "
             f"--seed {args.seed}` "
             f"({time.time() - t0:.0f} s on this machine). Tiny GPT (2 layers, d=32) on 2 "
             "simulated CPU devices per process; every trial is compared with an uninterrupted "
             "run of the same config. Steps lost: steps before the newest committed checkpoint "
             "that a resume had to redo (the rule is 0). Exact: every logged loss of the "
             "interrupted-and-resumed run equals the reference bitwise.", "",
             "| scenario | trials | failures | steps lost | exact resumes | notes |",
             "|---|---|---|---|---|---|"]
    lines += [_row(r) for r in rows]
    reporting.write(OUT, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return int(any(r["failures"] for r in rows))


def _row(r: dict) -> str:
    exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
    return (f"| {r['scenario']} | {r['trials']} | {r['failures']} | {r['lost']} | {exact} | "
            f"{r['note']} ({r['seconds']:.0f} s) |")


if __name__ == "__main__":
    sys.exit(main())
