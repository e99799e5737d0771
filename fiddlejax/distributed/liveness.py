"""Peer liveness: a dead peer ends the job in seconds, with one line naming it.

After the preflight every process keeps one TCP connection to process 0. The kernel closes a
process's sockets however it dies (SIGKILL included), so the other end reads EOF at once: a
process whose peer vanished without a goodbye prints one line naming it and exits 1, instead of
hanging in a collective until JAX's heartbeat timeout aborts it with a C++ stack dump. Process 0
relays a loss to the others. Best effort: if the connection cannot be made, JAX's heartbeat
(FIDDLEJAX_HEARTBEAT_TIMEOUT_S) still ends the job.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

from fiddlejax.distributed.wire import read_hello, send, who

PEER_GRACE_S = 20.0  # a peer that exited with an error: time for this process to finish too


def listen_any() -> socket.socket | None:
    """Process 0's watch socket on a free port, or None (then JAX's heartbeat watches)."""
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", 0))
    except OSError:
        return None


def accept_watchers(srv: socket.socket, seen: dict, n: int) -> dict[int, socket.socket]:
    """Process 0: the other processes' watch connections, by id (those that came in 10 s)."""
    conns: dict[int, socket.socket] = {}
    deadline = time.monotonic() + 10.0
    with srv:
        while len(conns) < n - 1 and time.monotonic() < deadline:
            srv.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                conn, _ = srv.accept()
            except OSError:
                break
            hello = read_hello(conn)
            if hello is None or hello["process_id"] not in seen:
                conn.close()
                continue
            conns[hello["process_id"]] = conn
    return conns


def join_watch(host: str, port: int, me: dict) -> None:
    """Any other process: connect to process 0's watch port and start watching it."""
    try:
        conn = socket.create_connection((host, port), timeout=10.0)
        conn.sendall(json.dumps(me).encode() + b"\n")
    except OSError as e:
        print(f"fiddlejax: no watchdog connection to process 0 ({e}); a dead peer is found by "
              "JAX's heartbeat instead", file=sys.stderr, flush=True)
        return
    start_watchdog(me["process_id"], {0: conn}, {0: {"host": host, "pid": "?"}})


class _Watchdog:
    """One thread per connection; the first peer lost ends this process."""

    def __init__(self, me: int, conns: dict[int, socket.socket], hosts: dict):
        self.me, self.conns, self.hosts = me, conns, hosts
        self.finishing = threading.Event()
        self.lock = threading.Lock()
        for peer, conn in conns.items():
            conn.settimeout(None)
            threading.Thread(target=self._watch, args=(peer, conn), daemon=True,
                             name=f"fiddlejax-watch-{peer}").start()

    def _watch(self, peer: int, conn: socket.socket) -> None:
        bye = None
        try:
            for line in conn.makefile("rb"):
                msg = json.loads(line)
                if "lost" in msg:  # process 0 relays another peer's loss
                    self._lost(int(msg["lost"]), msg.get("why", ""))
                if "bye" in msg:
                    bye = msg["bye"]
        except (OSError, ValueError):
            pass
        if bye is None:
            self._lost(peer, "it ended without a goodbye (killed, or crashed)")
        elif bye != 0 and not self.finishing.wait(PEER_GRACE_S):
            self._lost(peer, f"it exited with status {bye} and this process did not finish "
                             f"within {PEER_GRACE_S:.0f}s")

    def _lost(self, peer: int, why: str) -> None:
        if self.finishing.is_set():
            return
        with self.lock:
            if self.me == 0:
                for other, c in self.conns.items():
                    if other != peer:
                        send(c, {"lost": peer, "why": why})
            info = self.hosts.get(peer, {})
            where = f" ({who(info)})" if info.get("pid", "?") != "?" else ""
            sys.stdout.flush()
            sys.stderr.write(f"fiddlejax: lost process {peer}{where}: {why}; ending process "
                             f"{self.me} (exit 1). Restart the job with resume=auto to continue "
                             "from the last checkpoint\n")
            sys.stderr.flush()
            os._exit(1)

    def goodbye(self, code: int) -> None:
        self.finishing.set()
        for c in self.conns.values():
            send(c, {"bye": int(code)})


_watchdog: _Watchdog | None = None


def start_watchdog(me: int, conns: dict[int, socket.socket], hosts: dict) -> None:
    """Watch ``conns`` (peer id -> socket; ``hosts``: peer id -> hello, for messages)."""
    global _watchdog
    import atexit

    _watchdog = _Watchdog(me, conns, hosts)
    atexit.register(goodbye, 0)  # a normal interpreter exit is not a lost peer


def goodbye(code: int = 0) -> None:
    """Tell the other processes this one is ending on purpose with exit status ``code``
    (``fiddlejax train`` calls it; interpreter exit sends 0). No-op with one process."""
    if _watchdog is not None and not _watchdog.finishing.is_set():
        _watchdog.goodbye(code)
