"""One job per checkpoint directory: an exclusive lock held for the job's lifetime.

Two jobs saving into one directory lose data: each one's retention policy deletes the other's
steps, and a fresh run's "this directory already holds checkpoints" check races with the other
job's first save. :class:`DirectoryLock` takes ``fcntl.flock`` on ``<dir>/.fiddlejax-lock``, a
holder file naming the host, pid and run directory of the job that holds it. The kernel releases
a flock however the process ends (SIGKILL included), so a lock is never left behind by a dead
job; the holder file such a job leaves is recognised and taken over. On filesystems without
flock (some network mounts) the holder file itself is the lock (created with ``O_EXCL``), and a
holder on this host whose pid no longer runs is stale and taken over. The holder file is never
opened through a symbolic link (nor written when it has other hard links): a link planted there
would have the lock's record written into the file it points at.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".fiddlejax-lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class DirectoryInUse(ValueError):
    """Another live job holds the checkpoint directory's lock; the message names it."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (signal 0 tests without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def describe(holder: dict | None) -> str:
    """A holder record as a person reads it: host, pid, run directory, since when."""
    if not holder:
        return "a process that has not written its name yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    run = f", run.dir={holder['run_dir']}" if holder.get("run_dir") else ""
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}{run}, since {since}"


class DirectoryLock:
    """An exclusive, process-lifetime lock on ``directory`` (which must exist).

    :meth:`acquire` raises :class:`DirectoryInUse` naming the directory and the holder, or
    returns a note when it took over the record of a job that ended without releasing.
    :meth:`release` (also on ``with`` exit) removes the holder file; call it on every exit path
    (the kernel releases the flock anyway when the process ends).
    """

    def __init__(self, directory: str | Path, run_dir: str | Path | None = None, what: str = ""):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.what = what or f"checkpoint directory {self.directory}"
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "run_dir": str(Path(run_dir).absolute()) if run_dir else None}
        self._fd: int | None = None
        self._flock = True

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> str | None:
        import fcntl

        for _ in range(5):  # the file can be replaced between open and lock: retry
            fd = self._open(os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno in _NO_FLOCK:
                    if holder is None:  # the empty file our open just created
                        self.path.unlink(missing_ok=True)
                    return self._acquire_exclusive_file()
                raise self._in_use(holder, flock=True) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder released (and removed) it between our open and flock
                os.close(fd)
                continue
            previous = _read(fd)
            self._write(fd)
            self._fd = fd
            return self._stale_note(previous)
        raise DirectoryInUse(f"{self.what} is being locked and released by other jobs in a "
                             "loop; give this run its own checkpoint.dir")

    def _acquire_exclusive_file(self) -> str | None:
        """No flock on this filesystem: the holder file itself is the lock."""
        self._flock = False
        note = None
        for _ in range(2):
            try:
                fd = self._open(os.O_RDWR | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                holder = _read_path(self.path)
                if not _stale(holder, self.me["host"]):
                    raise self._in_use(holder, flock=False) from None
                note = self._stale_note(holder)
                self.path.unlink(missing_ok=True)
                continue
            self._write(fd)
            self._fd = fd
            return note
        raise self._in_use(_read_path(self.path), flock=False)

    def _open(self, flags: int) -> int:
        """Open the holder file, refusing a symbolic or hard link (never written through)."""
        try:
            fd = os.open(self.path, flags | _NOFOLLOW, 0o644)
        except OSError:
            if not self.path.is_symlink():
                raise
            what = f"a symbolic link (to {os.readlink(self.path)})"
        else:
            if os.fstat(fd).st_nlink <= 1:
                return fd
            os.close(fd)
            what = "a hard link to another file"
        raise DirectoryInUse(
            f"{self.what}: its lock file {self.path} is {what}; fiddlejax never writes "
            f"through a link. Remove it (rm {self.path}) and start again")

    def _write(self, fd: int) -> None:
        data = json.dumps({**self.me, "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def _stale_note(self, previous: dict | None) -> str | None:
        if not previous or previous.get("pid") is None:
            return None
        return (f"{self.what}: the lock record of an earlier job ({describe(previous)}) was left "
                "behind (it was killed); that job no longer runs, so this one takes the lock")

    def _in_use(self, holder: dict | None, flock: bool) -> DirectoryInUse:
        hint = ""
        if holder and holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            if not pid_alive(holder["pid"]):
                hint = (f" (pid {holder['pid']} no longer runs: a process it started still holds "
                        f"the lock; see `fuser {self.path}`)" if flock else "")
        where = "" if flock else (f"; if that job is gone (another host cannot be checked from "
                                  f"here), delete {self.path}")
        return DirectoryInUse(
            f"{self.what} is in use by another fiddlejax job ({describe(holder)}){hint}: two jobs "
            "saving into one directory delete each other's checkpoints. Wait for it to end, or "
            f"give this run its own checkpoint.dir{where}")

    def release(self) -> None:
        """Remove the holder file and drop the lock; safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except OSError:
            pass
        os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _read_path(path: Path) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        return _read(fd)
    finally:
        os.close(fd)


def _stale(holder: dict | None, host: str) -> bool:
    """A holder record whose process is known to be gone (same host, pid not running)."""
    return (bool(holder) and holder.get("host") == host and isinstance(holder.get("pid"), int)
            and not pid_alive(holder["pid"]))
