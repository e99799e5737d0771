"""The preflight: every process meets process 0 once over TCP before JAX's runtime starts.

JAX's own runtime reports an unreachable coordinator, a duplicate process id or a wrong process
count by aborting in C++ with a message that blames another task. Here process 0 listens on the
coordinator's port, the others connect and say who they are (a :mod:`~fiddlejax.distributed.wire`
hello), and each of those faults becomes a Python error that names the bad value and the fix.
Then the port is free again for JAX's coordination service, and the watchdog
(:mod:`~fiddlejax.distributed.liveness`) takes over.
"""

from __future__ import annotations

import json
import socket
import time

from fiddlejax.distributed import liveness
from fiddlejax.distributed.cluster_env import (
    ENV_COORDINATOR,
    ENV_INIT_TIMEOUT,
    ENV_PORT,
    ENV_PROCESS_ID,
)
from fiddlejax.distributed.wire import read_hello, who

# -- process 0 -------------------------------------------------------------------------------------

def serve(port: int, me: dict, timeout_s: float) -> None:
    """Process 0: wait for every other process, answer all "ok" or all the same error."""
    n = me["num_processes"]
    srv = _coordinator_socket(port)
    seen: dict[int, dict] = {0: me}
    conns: list[socket.socket] = []
    watch = None
    try:
        error = _gather(srv, me, seen, conns, timeout_s)
        watch = None if error else liveness.listen_any()
        _release(conns, error, watch)
    finally:
        for c in conns:
            c.close()
        srv.close()
    if error:
        raise RuntimeError(error)
    if watch is not None:
        liveness.start_watchdog(0, liveness.accept_watchers(watch, seen, n), seen)


def _coordinator_socket(port: int) -> socket.socket:
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6,
                                        dualstack_ipv6=True, reuse_port=False)
        return socket.create_server(("", port))
    except OSError as e:
        raise RuntimeError(
            f"process 0 cannot listen on coordinator port {port} ({e.strerror or e}): another "
            f"job holds it, or another process also has process_id=0; pick a free port with "
            f"{ENV_COORDINATOR}=HOST:PORT (or {ENV_PORT}) and give each process its own id"
        ) from None


def _gather(srv: socket.socket, me: dict, seen: dict[int, dict], conns: list[socket.socket],
            timeout_s: float) -> str | None:
    """Accept hellos into ``seen`` until all processes came; the error for everyone, or None."""
    n = me["num_processes"]
    deadline = time.monotonic() + timeout_s
    while len(seen) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(n)) - set(seen))
            return (f"only {len(seen)} of num_processes={n} processes reached the "
                    f"coordinator within {timeout_s:.0f}s; missing process ids {missing}. "
                    "Start every process (or lower num_processes), or raise "
                    f"{ENV_INIT_TIMEOUT} if they start slowly")
        srv.settimeout(min(left, 1.0))
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        hello = read_hello(conn)
        if hello is None:  # not one of ours (a port scan, a health check): ignore it
            conn.close()
            continue
        conns.append(conn)
        error = _bad_hello(me, hello, seen)
        if error is not None:
            return error
        seen[hello["process_id"]] = hello
        try:
            conn.sendall(b'{"wait": true}\n')
        except OSError:
            pass
    return None


def _bad_hello(me: dict, hello: dict, seen: dict[int, dict]) -> str | None:
    """Why a joining process's hello cannot be accepted, or None."""
    n = me["num_processes"]
    pid, their_n = hello["process_id"], hello["num_processes"]
    if their_n != n:
        return (f"processes disagree on the job size: process 0 ({who(me)}) has "
                f"num_processes={n} but process {pid} ({who(hello)}) has "
                f"num_processes={their_n}; give every process the same count")
    if not 0 <= pid < n:
        return (f"process_id={pid} ({who(hello)}) is outside 0..{n - 1}; ids must be "
                "0, 1, ..., num_processes - 1")
    if pid in seen:
        return (f"process_id={pid} is claimed by two processes ({who(seen[pid])} and "
                f"{who(hello)}); every process needs its own id in 0..{n - 1} (check "
                f"{ENV_PROCESS_ID}, SLURM_PROCID, OMPI_COMM_WORLD_RANK or "
                "JOB_COMPLETION_INDEX, and FIDDLEJAX_PROCESSES_PER_JOB for JobSets)")
    return None


def _release(conns: list[socket.socket], error: str | None,
             watch: socket.socket | None) -> None:
    """Send every joined process the verdict (and the watch port), then let them hang up."""
    reply = json.dumps({"error": error} if error else
                       {"ok": True, "watch": watch.getsockname()[1] if watch else None}
                       ).encode() + b"\n"
    for c in conns:
        try:
            c.sendall(reply)
        except OSError:
            pass
    # Let the peers close first so no TIME_WAIT socket of ours lingers on the port.
    for c in conns:
        try:
            c.settimeout(2.0)
            c.recv(1)
        except OSError:
            pass


# -- every other process ---------------------------------------------------------------------------

def join(host: str, port: int, me: dict, timeout_s: float, coordinator: str,
         ack_timeout_s: float) -> None:
    """Any other process: say hello to process 0 until it answers or ``timeout_s`` passes.

    ``ack_timeout_s`` bounds the wait for the first acknowledgement: our process 0 answers at
    once, so silence means something else holds the port.
    """
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    delay = 0.2
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(
                f"process {me['process_id']} could not reach the coordinator at {coordinator} "
                f"within {timeout_s:.0f}s ({last}). Check that process 0 is running, that "
                f"{host!r} resolves and port {port} is open from {me['host']}; set "
                f"{ENV_COORDINATOR}=HOST:PORT to change it") from None
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError as e:  # refused (not listening yet), unresolvable (DNS not ready), ...
            last = e
            time.sleep(min(delay, max(left, 0)))
            delay = min(delay * 1.5, 2.0)
            continue
        with conn:
            try:
                conn.sendall(json.dumps(me).encode() + b"\n")
                lines = conn.makefile("rb")
                # Our process 0 acknowledges at once; silence means something else holds the
                # port (say, a previous job's JAX service that is still shutting down).
                conn.settimeout(ack_timeout_s)
                answer = _answer(lines.readline())
                if answer.get("wait"):
                    conn.settimeout(max(deadline - time.monotonic(), 1.0))
                    answer = _answer(lines.readline())
            except (OSError, ValueError) as e:
                last = e
                time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                continue
        if "error" in answer:
            raise RuntimeError(answer["error"])
        if answer.get("watch"):
            liveness.join_watch(host, int(answer["watch"]), me)
        return


def _answer(line: bytes) -> dict:
    """A reply line from process 0, or ValueError for anything that is not one."""
    if not line:
        raise ValueError("the coordinator closed the connection without answering")
    answer = json.loads(line)
    if not isinstance(answer, dict) or not {"ok", "wait", "error"} & set(answer):
        raise ValueError(f"unexpected reply from the coordinator port: {line[:80]!r}")
    return answer
