"""The one-line JSON messages processes exchange over TCP during start-up and while they run.

Shared by the preflight (:mod:`~fiddlejax.distributed.preflight`) and the watchdog
(:mod:`~fiddlejax.distributed.liveness`): both open a connection with the same hello.
"""

from __future__ import annotations

import json
import socket


def who(p: dict) -> str:
    """A process as a person reads it in an error: its host and pid."""
    return f"{p['host']} pid {p['pid']}"


def read_hello(conn: socket.socket) -> dict | None:
    """The hello a joining process sends first, or None if ``conn`` is not one of ours."""
    conn.settimeout(10.0)
    buf = b""
    try:
        while b"\n" not in buf and len(buf) < 4096:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            buf += chunk
        # Only the first line: a watcher's heartbeats may already follow its hello.
        hello = json.loads(buf.split(b"\n", 1)[0])
    except (OSError, ValueError):
        return None
    if not isinstance(hello, dict) or not {"process_id", "num_processes"} <= set(hello):
        return None
    hello.setdefault("host", "?")
    hello.setdefault("pid", "?")
    return hello


def send(conn: socket.socket, msg: dict) -> None:
    """Best effort: a peer that is gone is the watchdog's news, not an error here."""
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass
