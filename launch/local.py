#!/usr/bin/env python3
"""Run N cooperating processes of one command on this machine: a multi-host job in miniature.

    python launch/local.py --nproc 2 --devices-per-process 2 -- fiddlejax train mesh.data=4

Each process gets ``FIDDLEJAX_COORDINATOR`` (127.0.0.1 and a free port),
``FIDDLEJAX_NUM_PROCESSES`` and ``FIDDLEJAX_PROCESS_ID``, which ``fiddlejax.distributed.initialize``
reads. Output lines are prefixed with the rank. SIGINT/SIGTERM are forwarded to every process.
When one process fails, the others are ended and the launcher exits with the failed one's status
(128 + signal number for a process killed by a signal), so a job never hangs on a dead peer.
After a forwarded SIGTERM/SIGINT the launcher exits 0 when every process saved and exited 0.
Standard library only: it must work before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, devices: int | None,
             gpus: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of process ``rank``: where the coordinator is and who this process is."""
    env = dict(os.environ if base is None else base)
    env.update({
        "FIDDLEJAX_COORDINATOR": f"127.0.0.1:{port}",
        "FIDDLEJAX_NUM_PROCESSES": str(nproc),
        "FIDDLEJAX_PROCESS_ID": str(rank),
        "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed, not at exit
    })
    if devices:
        env["FIDDLEJAX_CPU_DEVICES"] = str(devices)
        env["JAX_NUM_CPU_DEVICES"] = str(devices)  # for programs that skip fiddlejax
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(rank * gpus + i) for i in range(gpus))
    return env


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it cannot act on SIGTERM."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class Group:
    """The child processes, each in its own session so a signal reaches its whole tree."""

    def __init__(self, cmd: list[str], nproc: int, devices: int | None, gpus: int | None,
                 port: int | None):
        self.port = port or free_port()
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        width = len(str(nproc - 1))
        for r in range(nproc):
            p = subprocess.Popen(cmd, env=rank_env(r, nproc, self.port, devices, gpus),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
            prefix = f"[{r:>{width}}] ".encode()
            for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_pump, args=(stream, out, prefix, self.lock),
                                     daemon=True)
                t.start()
                self.pumps.append(t)
            self.procs.append(p)

    def say(self, text: str) -> None:
        with self.lock:
            sys.stderr.buffer.write(f"[launch] {text}\n".encode())
            sys.stderr.flush()

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def end(self, grace_s: float) -> None:
        """SIGTERM the live processes, then SIGKILL whatever is left after ``grace_s`` (a
        stopped process at once: it would only act on SIGTERM once continued)."""
        for p in self.procs:
            if p.poll() is None and stopped(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, grace_s: float, received: list[int]) -> int:
        """0 when every process succeeds; else the first failure's status, the others ended.

        Signals in ``received`` (appended by the handler) are forwarded here, in the loop, not
        in the handler: a handler that takes ``self.lock`` can interrupt a ``say`` holding it.
        """
        forwarded = 0
        while True:
            for sig in received[forwarded:]:
                self.say(f"received {signal.Signals(sig).name}; forwarding it to every process")
                self.signal_all(sig)
                forwarded += 1
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            # A process killed by a signal is the cause; peers that exit on noticing it follow.
            failed.sort(key=lambda rc: rc[1] > 0)
            if failed:
                rank, code = failed[0]
                live = [r for r, c in enumerate(codes) if c is None]
                frozen = [r for r in live if stopped(self.procs[r].pid)]
                self.say(f"process {rank} {_describe(code)}"
                         + (f"; ending processes {live}" if live else "")
                         + (f" (process {', '.join(map(str, frozen))} is stopped: SIGSTOP or a "
                            "debugger; killed at once)" if frozen else ""))
                self.end(grace_s)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        ours, cmd = argv[:split], argv[split + 1:]
    else:
        ours, cmd = argv, []
    p = argparse.ArgumentParser(
        prog="launch/local.py", usage="%(prog)s --nproc N [options] -- COMMAND [ARGS ...]",
        description="Start N cooperating processes of COMMAND on this machine.")
    p.add_argument("--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                   help="simulated CPU devices per process (FIDDLEJAX_CPU_DEVICES)")
    p.add_argument("--gpus-per-process", type=int, default=None, metavar="G",
                   help="give process r the GPUs r*G .. r*G+G-1 (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="after SIGTERM, wait this long before SIGKILL (default 10)")
    args = p.parse_args(ours)
    if not cmd:
        p.error("give the command after --, e.g. -- fiddlejax train mesh.data=4")
    if args.nproc < 1:
        p.error(f"--nproc={args.nproc} must be at least 1")
    for name in ("devices_per_process", "gpus_per_process"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")

    received: list[int] = []  # installed before the first process starts: no signal is lost
    signal.signal(signal.SIGINT, lambda sig, _frame: received.append(sig))
    signal.signal(signal.SIGTERM, lambda sig, _frame: received.append(sig))
    group = Group(cmd, args.nproc, args.devices_per_process, args.gpus_per_process, args.port)
    try:
        code = group.wait(args.grace, received)
    finally:
        group.end(args.grace)
        for t in group.pumps:
            t.join(timeout=2.0)
    # Every process exited 0: a forwarded SIGTERM/SIGINT was handled cleanly (saved and
    # stopped), which is success, not 128 + signal.
    return code


if __name__ == "__main__":
    sys.exit(main())
