"""Multi-process start-up: find this process's place in the job, check it, start JAX's runtime.

``initialize()`` finds the coordinator address, the number of processes and this process's id
from explicit arguments, ``FIDDLEJAX_*`` environment variables, SLURM, Open MPI or a Kubernetes
indexed Job / JobSet (in that order of precedence), then calls ``jax.distributed.initialize``.
With nothing detected it is a no-op: single-process runs need no set-up.

Before JAX connects, the processes meet once over a plain TCP socket on the coordinator's port
(the "preflight"). JAX's own runtime reports an unreachable coordinator, a duplicate process id
or a wrong process count by aborting in C++ with a message that blames another task; the
preflight turns each of those into a Python error that names the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

ENV_COORDINATOR = "FIDDLEJAX_COORDINATOR"
ENV_NUM_PROCESSES = "FIDDLEJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FIDDLEJAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "FIDDLEJAX_LOCAL_DEVICE_IDS"
ENV_CPU_DEVICES = "FIDDLEJAX_CPU_DEVICES"
ENV_PORT = "FIDDLEJAX_COORDINATOR_PORT"
ENV_PROCESSES_PER_JOB = "FIDDLEJAX_PROCESSES_PER_JOB"
ENV_INIT_TIMEOUT = "FIDDLEJAX_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "FIDDLEJAX_HEARTBEAT_TIMEOUT_S"

# Generous for start-up (pods and nodes come up minutes apart), short for heartbeats: a dead
# peer must end the job in well under a minute instead of JAX's default 100 s.
DEFAULT_INIT_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
DEFAULT_K8S_PORT = 8476


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits in the job and how that was found (``source``).

    ``source`` is one of ``"single"``, ``"explicit"``, ``"env"``, ``"slurm"``, ``"openmpi"``,
    ``"kubernetes"``, ``"jobset"`` or ``"jax"`` (JAX was already initialized by the caller).
    """

    source: str
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None
    local_device_ids: tuple[int, ...] | None = None

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1


_current: Cluster | None = None


# -- detection (pure: reads only the mapping it is given) ------------------------------------------

def detect(environ: Mapping[str, str] | None = None) -> Cluster:
    """The job layout described by ``environ`` (default ``os.environ``); no network, no JAX.

    Cluster variables (SLURM, Open MPI, Kubernetes) come first; ``FIDDLEJAX_*`` variables override
    single fields, so a manifest can supply what the cluster does not (e.g. the process count of
    a Kubernetes Job). Raises ``ValueError`` when a cluster is found but a field is missing.
    """
    return _complete(*_detect_fields(os.environ if environ is None else environ))


def _detect_fields(env: Mapping[str, str]) -> tuple[str, dict]:
    fields: dict = {}
    source = "single"
    for name, probe in (("slurm", _slurm), ("openmpi", _openmpi), ("kubernetes", _kubernetes)):
        found = probe(env)
        if found is not None:
            source = found.pop("source", name)
            fields = found
            break
    overlay = {
        "coordinator": env.get(ENV_COORDINATOR) or None,
        "num_processes": _env_int(env, ENV_NUM_PROCESSES),
        "process_id": _env_int(env, ENV_PROCESS_ID),
        "local_device_ids": _env_ids(env, ENV_LOCAL_DEVICE_IDS),
    }
    if source == "single" and (overlay["num_processes"] is not None
                               or overlay["process_id"] is not None):
        source = "env"
    fields.update({k: v for k, v in overlay.items() if v is not None})
    if fields.get("coordinator") is None and env.get("JAX_COORDINATOR_ADDRESS"):
        fields["coordinator"] = env["JAX_COORDINATOR_ADDRESS"]
    return source, fields


def _complete(source: str, fields: dict) -> Cluster:
    """A Cluster from detected fields, or a ValueError saying which variable to set."""
    if source == "single":
        return Cluster("single", local_device_ids=_tuple(fields.get("local_device_ids")))
    where = _SOURCE_HINT.get(source, source)
    n, pid, coord = fields.get("num_processes"), fields.get("process_id"), fields.get("coordinator")
    if n is None:
        raise ValueError(f"{where}: the number of processes is unknown; set "
                         f"{ENV_NUM_PROCESSES}=N (the total number of processes in the job)")
    if n < 1:
        raise ValueError(f"{where}: num_processes={n} must be at least 1")
    if n == 1:
        return Cluster("single", local_device_ids=_tuple(fields.get("local_device_ids")))
    if pid is None:
        raise ValueError(f"{where}: this process's id is unknown; set {ENV_PROCESS_ID} to a "
                         f"distinct value in 0..{n - 1} on each process")
    if not 0 <= pid < n:
        raise ValueError(f"{where}: process_id={pid} is outside 0..{n - 1} for "
                         f"num_processes={n}; ids must be 0, 1, ..., num_processes - 1")
    if coord is None:
        raise ValueError(f"{where}: the coordinator address is unknown; set "
                         f"{ENV_COORDINATOR}=HOST:PORT to process 0's host and a free port")
    split_address(coord)  # validates
    return Cluster(source, n, pid, coord, _tuple(fields.get("local_device_ids")))


def _tuple(ids) -> tuple[int, ...] | None:
    return tuple(int(i) for i in ids) if ids is not None else None


_SOURCE_HINT = {
    "env": f"{ENV_PROCESS_ID}/{ENV_NUM_PROCESSES} are set",
    "explicit": "initialize() was given a multi-process layout",
    "slurm": "SLURM step detected",
    "openmpi": "Open MPI detected",
    "kubernetes": "Kubernetes indexed Job detected (JOB_COMPLETION_INDEX is set)",
    "jobset": "Kubernetes JobSet detected (JOBSET_NAME is set)",
}


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} must be an integer") from None


def _env_ids(env: Mapping[str, str], key: str) -> list[int] | None:
    raw = env.get(key) or env.get("JAX_LOCAL_DEVICE_IDS")
    if not raw:
        return None
    try:
        return [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{key}={raw!r} must be comma-separated integers, e.g. 0,1") from None


def _port(env: Mapping[str, str]) -> int | None:
    return _env_int(env, ENV_PORT) or _env_int(env, "JAX_COORDINATOR_PORT")


def _one_gpu_per_process(env: Mapping[str, str], local_rank: int, local_size: int | None):
    """``[local_rank]`` when several processes share a node's GPUs, else None (all visible).

    A scheduler that already narrowed ``CUDA_VISIBLE_DEVICES`` to one GPU per task (``srun
    --gpus-per-task=1``) has done the job; restricting again would select a GPU that is not there.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) <= 1:
        return None
    if local_size is not None and local_size > 1:
        return [local_rank]
    return None


def _slurm(env: Mapping[str, str]) -> dict | None:
    # Only inside an srun step: the batch script itself has SLURM_NTASKS but no step, and a
    # plain `python train.py` there must stay single-process instead of waiting for peers.
    need = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID")
    if not all(k in env for k in need):
        return None
    n = _env_int(env, "SLURM_STEP_NUM_TASKS") or _env_int(env, "SLURM_NTASKS")
    port = _port(env) or int(env["SLURM_JOB_ID"]) % 2**12 + (65535 - 2**12 + 1)  # as JAX does
    local = _env_int(env, "SLURM_LOCALID") or 0
    per_node = _slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                                    or env.get("SLURM_TASKS_PER_NODE"),
                                    _env_int(env, "SLURM_NODEID") or 0)
    return {"num_processes": n, "process_id": int(env["SLURM_PROCID"]),
            "coordinator": f"{first_slurm_host(env['SLURM_STEP_NODELIST'])}:{port}",
            "local_device_ids": _one_gpu_per_process(env, local, per_node)}


def _slurm_tasks_on_node(spec: str | None, node: int) -> int | None:
    """Tasks on node ``node`` from SLURM's compressed form, e.g. ``"4(x2),3"`` -> 4, 4, 3."""
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[007-009,012],cpu1"`` -> ``"gpu007"``.

    Brackets may sit mid-name (``"rack1-n[01-04]-ib"`` -> ``"rack1-n01-ib"``); zero padding is kept.
    """
    out, i = [], 0
    while i < len(nodelist):
        ch = nodelist[i]
        if ch == ",":
            break
        if ch == "[":
            end = nodelist.index("]", i)
            out.append(re.split(r"[,-]", nodelist[i + 1:end])[0])
            i = end + 1
            continue
        out.append(ch)
        i += 1
    host = "".join(out).strip()
    if not host:
        raise ValueError(f"SLURM_STEP_NODELIST={nodelist!r} names no host")
    return host


def _openmpi(env: Mapping[str, str]) -> dict | None:
    if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_COMM_WORLD_RANK" not in env:
        return None
    coord = None
    uri = env.get("OMPI_MCA_orte_hnp_uri")  # Open MPI 4 (mpirun's own address); absent in 5.x
    if uri:
        m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
        if m:
            host = next(g for g in m.groups() if g is not None)
            job = int(uri.split(".", 1)[0]) // 2**12
            port = _port(env) or job % 2**12 + (65535 - 2**12 + 1)
            coord = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    local = _env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0
    return {"num_processes": int(env["OMPI_COMM_WORLD_SIZE"]),
            "process_id": int(env["OMPI_COMM_WORLD_RANK"]), "coordinator": coord,
            "local_device_ids": _one_gpu_per_process(
                env, local, _env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))}


def _kubernetes(env: Mapping[str, str]) -> dict | None:
    """Indexed Job or JobSet, from the variables Kubernetes itself sets; no API access needed.

    The process count is not in a pod's environment: manifests set ``FIDDLEJAX_NUM_PROCESSES``.
    """
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    index = int(env["JOB_COMPLETION_INDEX"])
    port = _port(env) or DEFAULT_K8S_PORT
    if env.get("JOBSET_NAME") and env.get("REPLICATED_JOB_NAME"):
        js, rj = env["JOBSET_NAME"], env["REPLICATED_JOB_NAME"]
        per_job = _env_int(env, ENV_PROCESSES_PER_JOB) or 1
        job = _env_int(env, "JOB_INDEX") or 0
        # Pod 0 of job 0; JobSet's headless service (the subdomain) is named after the JobSet.
        return {"source": "jobset", "process_id": job * per_job + index,
                "coordinator": f"{js}-{rj}-0-0.{js}:{port}"}
    return {"source": "kubernetes", "process_id": index}


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``, with a clear error otherwise."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", address.strip())
    if not m:
        raise ValueError(f"coordinator address {address!r} must look like HOST:PORT "
                         "(e.g. 10.0.0.1:8476 or node001:8476)")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    if not 0 < int(port) < 65536:
        raise ValueError(f"coordinator port {port} in {address!r} must be in 1..65535")
    return host, int(port)


# -- start-up --------------------------------------------------------------------------------------

def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    init_timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    cpu_devices: int | None = None,
    preflight: bool = True,
) -> Cluster:
    """Join the job this process belongs to; call before anything touches a JAX device.

    Arguments override what :func:`detect` finds. ``cpu_devices`` (or ``FIDDLEJAX_CPU_DEVICES``)
    simulates that many CPU devices in this process. CPU runs get the gloo collectives. With one
    process this only applies ``cpu_devices``. Calling again is harmless and returns the layout.
    ``preflight=False`` skips the start-up handshake (:func:`rendezvous`) and its clear errors.
    """
    global _current
    import jax

    cpu_devices = cpu_devices if cpu_devices is not None else _env_int(os.environ, ENV_CPU_DEVICES)
    if jax.distributed.is_initialized():
        if _current is None or not _current.is_multiprocess:  # the caller initialized JAX
            _current = Cluster("jax", jax.process_count(), jax.process_index())
        if num_processes is not None and num_processes != _current.num_processes:
            raise RuntimeError(f"JAX is already initialized with {_current.num_processes} "
                               f"processes, not num_processes={num_processes}")
        return _current
    source, fields = _detect_fields(os.environ)
    explicit = {"coordinator": coordinator, "num_processes": num_processes,
                "process_id": process_id, "local_device_ids": local_device_ids}
    if any(v is not None for v in explicit.values()):
        fields.update({k: v for k, v in explicit.items() if v is not None})
        if source == "single" and (num_processes is not None or process_id is not None):
            source = "explicit"
    cluster = _complete(source, fields)

    if _backends_started():
        if cluster.is_multiprocess:
            raise RuntimeError(
                f"fiddlejax.distributed.initialize() found a {cluster.num_processes}-process "
                f"job ({cluster.source}) but JAX's backend already started in this process "
                "(something called jax.devices(), created an array or ran a computation "
                "first); call initialize() at the very top of the program, before any JAX work")
        _current = cluster
        return cluster

    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    if not cluster.is_multiprocess:
        _current = cluster
        return cluster

    init_t = _timeout(init_timeout_s, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S)
    beat_t = _timeout(heartbeat_timeout_s, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_S)
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if preflight:
        rendezvous(cluster.coordinator, cluster.num_processes, cluster.process_id, init_t)
    jax.distributed.initialize(
        cluster.coordinator, cluster.num_processes, cluster.process_id,
        local_device_ids=list(cluster.local_device_ids) if cluster.local_device_ids else None,
        cluster_detection_method="deactivate",  # we detected already; JAX must not re-guess
        initialization_timeout=max(1, round(init_t)),
        heartbeat_timeout_seconds=max(1, round(beat_t)),
    )
    _current = cluster
    return cluster


def current() -> Cluster:
    """The layout :func:`initialize` set up (single-process if it was never called)."""
    return _current or Cluster("single")


def _timeout(value: float | None, key: str, default: float) -> float:
    if value is None:
        raw = os.environ.get(key)
        value = float(raw) if raw else default
    if value <= 0:
        raise ValueError(f"{key.lower()}={value} must be a positive number of seconds")
    return float(value)


def _backends_started() -> bool:
    """Whether JAX's backends already started in this process.

    A private JAX function, on purpose: JAX has no public way to ask (jax 0.10.2), and its own
    check sits inside ``jax.distributed.initialize``, after our preflight rendezvous would have
    waited for peers that this process can no longer join. ``pyproject.toml`` pins jax below
    0.11 and ``tests/test_distributed.py::test_backend_probe_is_pinned`` fails if the function
    moves or changes meaning. Should it move anyway, we answer "not started" and JAX's own
    check still raises, later and less clearly.
    """
    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:
        return False
    return bool(backends_are_initialized())


# -- preflight rendezvous --------------------------------------------------------------------------

def rendezvous(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Meet every process once on the coordinator's port, before JAX's runtime starts there.

    Process 0 listens, the others connect and say who they are; process 0 answers every one
    "ok" once all ``num_processes`` distinct ids have arrived, or sends everyone the error
    (duplicate id, disagreeing process counts, missing processes). Then the port is free again
    for JAX's coordination service.
    """
    host, port = split_address(coordinator)
    me = {"process_id": process_id, "num_processes": num_processes,
          "host": socket.gethostname(), "pid": os.getpid()}
    if process_id == 0:
        _serve(port, me, timeout_s)
    else:
        _join(host, port, me, timeout_s, coordinator)


def _who(p: dict) -> str:
    return f"{p['host']} pid {p['pid']}"


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


def _bad_hello(me: dict, hello: dict, seen: dict[int, dict]) -> str | None:
    """Why a joining process's hello cannot be accepted, or None."""
    n = me["num_processes"]
    pid, their_n = hello["process_id"], hello["num_processes"]
    if their_n != n:
        return (f"processes disagree on the job size: process 0 ({_who(me)}) has "
                f"num_processes={n} but process {pid} ({_who(hello)}) has "
                f"num_processes={their_n}; give every process the same count")
    if not 0 <= pid < n:
        return (f"process_id={pid} ({_who(hello)}) is outside 0..{n - 1}; ids must be "
                "0, 1, ..., num_processes - 1")
    if pid in seen:
        return (f"process_id={pid} is claimed by two processes ({_who(seen[pid])} and "
                f"{_who(hello)}); every process needs its own id in 0..{n - 1} (check "
                f"{ENV_PROCESS_ID}, SLURM_PROCID, OMPI_COMM_WORLD_RANK or "
                "JOB_COMPLETION_INDEX, and FIDDLEJAX_PROCESSES_PER_JOB for JobSets)")
    return None


def _serve(port: int, me: dict, timeout_s: float) -> None:
    n = me["num_processes"]
    srv = _coordinator_socket(port)
    deadline = time.monotonic() + timeout_s
    seen: dict[int, dict] = {0: me}
    conns: list[socket.socket] = []
    error = None
    try:
        while len(seen) < n and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(n)) - set(seen))
                error = (f"only {len(seen)} of num_processes={n} processes reached the "
                         f"coordinator within {timeout_s:.0f}s; missing process ids {missing}. "
                         "Start every process (or lower num_processes), or raise "
                         f"{ENV_INIT_TIMEOUT} if they start slowly")
                break
            srv.settimeout(min(left, 1.0))
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            hello = _read_hello(conn)
            if hello is None:  # not one of ours (a port scan, a health check): ignore it
                conn.close()
                continue
            conns.append(conn)
            error = _bad_hello(me, hello, seen)
            if error is None:
                seen[hello["process_id"]] = hello
                try:
                    conn.sendall(b'{"wait": true}\n')
                except OSError:
                    pass
        watch = None if error else _listen_any()
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
    finally:
        for c in conns:
            c.close()
        srv.close()
    if error:
        raise RuntimeError(error)
    if watch is not None:
        _start_watchdog(0, _accept_watchers(watch, seen, n), seen)


def _read_hello(conn: socket.socket) -> dict | None:
    conn.settimeout(10.0)
    buf = b""
    try:
        while not buf.endswith(b"\n") and len(buf) < 4096:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            buf += chunk
        hello = json.loads(buf)
    except (OSError, ValueError):
        return None
    if not isinstance(hello, dict) or not {"process_id", "num_processes"} <= set(hello):
        return None
    hello.setdefault("host", "?")
    hello.setdefault("pid", "?")
    return hello


def _join(host: str, port: int, me: dict, timeout_s: float, coordinator: str) -> None:
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
                conn.settimeout(_ACK_TIMEOUT_S)
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
            _join_watch(host, int(answer["watch"]), me)
        return


_ACK_TIMEOUT_S = 10.0


def _answer(line: bytes) -> dict:
    """A reply line from process 0, or ValueError for anything that is not one."""
    if not line:
        raise ValueError("the coordinator closed the connection without answering")
    answer = json.loads(line)
    if not isinstance(answer, dict) or not {"ok", "wait", "error"} & set(answer):
        raise ValueError(f"unexpected reply from the coordinator port: {line[:80]!r}")
    return answer


# -- watchdog: a dead peer ends the job in seconds, with one line ---------------------------------
#
# After the preflight every process keeps one TCP connection to process 0. The kernel closes a
# process's sockets however it dies (SIGKILL included), so the other end reads EOF at once: a
# process whose peer vanished without a goodbye prints one line naming it and exits 1, instead of
# hanging in a collective until JAX's heartbeat timeout aborts it with a C++ stack dump. Process 0
# relays a loss to the others. Best effort: if the connection cannot be made, JAX's heartbeat
# (FIDDLEJAX_HEARTBEAT_TIMEOUT_S) still ends the job.

PEER_GRACE_S = 20.0  # a peer that exited with an error: time for this process to finish too


def _listen_any() -> socket.socket | None:
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", 0))
    except OSError:
        return None


def _accept_watchers(srv: socket.socket, seen: dict, n: int) -> dict[int, socket.socket]:
    conns: dict[int, socket.socket] = {}
    deadline = time.monotonic() + 10.0
    with srv:
        while len(conns) < n - 1 and time.monotonic() < deadline:
            srv.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                conn, _ = srv.accept()
            except OSError:
                break
            hello = _read_hello(conn)
            if hello is None or hello["process_id"] not in seen:
                conn.close()
                continue
            conns[hello["process_id"]] = conn
    return conns


def _join_watch(host: str, port: int, me: dict) -> None:
    try:
        conn = socket.create_connection((host, port), timeout=10.0)
        conn.sendall(json.dumps(me).encode() + b"\n")
    except OSError as e:
        print(f"fiddlejax: no watchdog connection to process 0 ({e}); a dead peer is found by "
              "JAX's heartbeat instead", file=sys.stderr, flush=True)
        return
    _start_watchdog(me["process_id"], {0: conn}, {0: {"host": host, "pid": "?"}})


class _Watchdog:
    def __init__(self, me: int, conns: dict[int, socket.socket], who: dict):
        self.me, self.conns, self.who = me, conns, who
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
                        _send(c, {"lost": peer, "why": why})
            info = self.who.get(peer, {})
            where = f" ({_who(info)})" if info.get("pid", "?") != "?" else ""
            sys.stdout.flush()
            sys.stderr.write(f"fiddlejax: lost process {peer}{where}: {why}; ending process "
                             f"{self.me} (exit 1). Restart the job with resume=auto to continue "
                             "from the last checkpoint\n")
            sys.stderr.flush()
            os._exit(1)

    def goodbye(self, code: int) -> None:
        self.finishing.set()
        for c in self.conns.values():
            _send(c, {"bye": int(code)})


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass


_watchdog: _Watchdog | None = None


def _start_watchdog(me: int, conns: dict[int, socket.socket], who: dict) -> None:
    global _watchdog
    import atexit

    _watchdog = _Watchdog(me, conns, who)
    atexit.register(goodbye, 0)  # a normal interpreter exit is not a lost peer


def goodbye(code: int = 0) -> None:
    """Tell the other processes this one is ending on purpose with exit status ``code``
    (``fiddlejax train`` calls it; interpreter exit sends 0). No-op with one process."""
    if _watchdog is not None and not _watchdog.finishing.is_set():
        _watchdog.goodbye(code)


# -- data placement --------------------------------------------------------------------------------

def data_shard(mesh, axis: str = "data", *, process_index: int | None = None) -> tuple[int, int]:
    """``(index, count)``: this process loads share ``index`` of ``count`` of each global batch.

    The share is the slice of ``axis`` that this process's devices own. Processes whose devices
    sit on the same ``data`` slice (``pipe`` or ``tensor`` spanning hosts) load the same rows.
    Pass the result as ``process_index`` / ``process_count`` to the pipelines in
    :mod:`fiddlejax.data`.
    """
    import numpy as np

    if process_index is None:
        import jax

        process_index = jax.process_index()
    me = process_index
    ax = list(mesh.axis_names).index(axis)
    size = mesh.devices.shape[ax]
    mine = sorted({idx[ax] for idx, d in np.ndenumerate(mesh.devices) if d.process_index == me})
    if not mine:
        raise ValueError(f"process {me} owns no device of the mesh; build the mesh from "
                         "jax.devices() (all processes' devices)")
    k = len(mine)
    if mine != list(range(mine[0], mine[0] + k)) or mine[0] % k or size % k:
        raise ValueError(
            f"process {me} owns {axis} slices {mine} of {size}, not one aligned contiguous "
            f"block, so its rows of a batch are not contiguous; order the mesh's devices host "
            f"by host (fj.make_mesh(..., devices=jax.devices()) does)")
    return mine[0] // k, size // k


def describe(mesh) -> str:
    """One line for logs: processes, devices, and which process owns each mesh position.

    The default order (``jax.devices()``, host-major, ``tensor`` innermost) keeps ``tensor``
    inside a host and lets ``pipe`` and then ``data`` span hosts.
    """
    import numpy as np

    owner = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    axes = " x ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.devices.shape))
    n_proc = len(set(owner.flat))
    return (f"{n_proc} processes x {mesh.devices.size // n_proc} devices; mesh {axes}; "
            f"process of each position: {owner.tolist()}")
