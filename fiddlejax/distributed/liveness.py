"""Peer liveness: a dead or frozen peer ends the job in seconds, with one line naming it.

After the preflight every process keeps one TCP connection to process 0. The kernel closes a
process's sockets however it dies (SIGKILL included), so the other end reads EOF at once: a
process whose peer vanished without a goodbye prints one line naming it and exits 1, instead of
hanging in a collective until JAX's heartbeat timeout aborts it with a C++ stack dump. A peer
that stops without dying (SIGSTOP, a debugger, a hung host) keeps its socket open, so both ends
also send a heartbeat every second from a thread of their own (it runs while the main thread
computes or waits in a collective); a peer silent for ``FIDDLEJAX_PEER_TIMEOUT_S`` (10 s, and
always under half of JAX's own heartbeat timeout, whose expiry aborts the process) is lost the
same way. Process 0 relays a loss to the others. Best effort: if the connection cannot be made,
JAX's heartbeat (FIDDLEJAX_HEARTBEAT_TIMEOUT_S) still ends the job.
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
ENV_PEER_TIMEOUT = "FIDDLEJAX_PEER_TIMEOUT_S"
DEFAULT_PEER_TIMEOUT_S = 10.0
BEAT_S = 1.0  # heartbeat period


def peer_timeout() -> float:
    """Seconds without a heartbeat after which a peer is lost: ``FIDDLEJAX_PEER_TIMEOUT_S``
    (default 10), at most half of JAX's heartbeat timeout (which aborts with a stack dump)."""
    from fiddlejax.distributed.cluster_env import DEFAULT_HEARTBEAT_TIMEOUT_S, ENV_HEARTBEAT_TIMEOUT

    def env(key: str, default: float) -> float:
        try:
            value = float(os.environ.get(key) or default)
        except ValueError:
            return default
        return value if value > 0 else default

    jax_beat = env(ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_S)
    return max(min(env(ENV_PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT_S), jax_beat / 2), 2 * BEAT_S)


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
    """One thread per connection, one heartbeat thread; the first peer lost ends this process."""

    def __init__(self, me: int, conns: dict[int, socket.socket], hosts: dict):
        self.me, self.conns, self.hosts = me, conns, hosts
        self.finishing = threading.Event()
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # whole lines: beats, relays and goodbyes interleave
        self.timeout = peer_timeout()
        self.heard = {peer: time.monotonic() for peer in conns}  # peer -> last line received
        for peer, conn in conns.items():
            conn.settimeout(None)
            threading.Thread(target=self._watch, args=(peer, conn), daemon=True,
                             name=f"fiddlejax-watch-{peer}").start()
        threading.Thread(target=self._beat, daemon=True, name="fiddlejax-heartbeat").start()

    def send(self, conn: socket.socket, msg: dict) -> None:
        with self.send_lock:
            send(conn, msg)

    def _beat(self) -> None:
        """Send a heartbeat to every peer each second; lose a peer silent for the timeout."""
        while not self.finishing.wait(BEAT_S):
            for conn in list(self.conns.values()):
                self.send(conn, {"beat": 1})
            now = time.monotonic()
            for peer, last in list(self.heard.items()):
                if now - last > self.timeout:
                    self._lost(peer, f"it stopped answering: no heartbeat for {now - last:.0f} s "
                                     "(frozen: stopped with SIGSTOP or in a debugger, or its host "
                                     f"hangs; {ENV_PEER_TIMEOUT}={self.timeout:g})")

    def _watch(self, peer: int, conn: socket.socket) -> None:
        bye = None
        try:
            for line in conn.makefile("rb"):
                if bye is None:
                    self.heard[peer] = time.monotonic()
                msg = json.loads(line)
                if "lost" in msg:  # process 0 relays another peer's loss
                    self._lost(int(msg["lost"]), msg.get("why", ""))
                if "bye" in msg:  # ending on purpose: no more heartbeats from it
                    bye = msg["bye"]
                    self.heard.pop(peer, None)
        except (OSError, ValueError):
            pass
        self.heard.pop(peer, None)  # its end is judged below, not by heartbeats
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
                        self.send(c, {"lost": peer, "why": why})
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
            self.send(c, {"bye": int(code)})


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
