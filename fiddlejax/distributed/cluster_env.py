"""Where this process sits in a multi-process job, read from its environment; no network, no JAX.

Explicit ``FIDDLEJAX_*`` variables, SLURM, Open MPI and Kubernetes (indexed Job or JobSet) each
describe the job differently; :func:`detect` turns any of them into one :class:`Cluster`, or a
``ValueError`` that names the variable to set.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

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


# -- detection (pure: reads only the mapping it is given) ------------------------------------------

def detect(environ: Mapping[str, str] | None = None) -> Cluster:
    """The job layout described by ``environ`` (default ``os.environ``); no network, no JAX.

    Cluster variables (SLURM, Open MPI, Kubernetes) come first; ``FIDDLEJAX_*`` variables override
    single fields, so a manifest can supply what the cluster does not (e.g. the process count of
    a Kubernetes Job). Raises ``ValueError`` when a cluster is found but a field is missing.
    """
    return cluster_from(*detected_fields(os.environ if environ is None else environ))


def detected_fields(env: Mapping[str, str]) -> tuple[str, dict]:
    """``(source, fields)`` before validation, so :func:`~fiddlejax.distributed.initialize` can
    lay its explicit arguments over them first."""
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
        "num_processes": env_int(env, ENV_NUM_PROCESSES),
        "process_id": env_int(env, ENV_PROCESS_ID),
        "local_device_ids": _env_ids(env, ENV_LOCAL_DEVICE_IDS),
    }
    if source == "single" and (overlay["num_processes"] is not None
                               or overlay["process_id"] is not None):
        source = "env"
    fields.update({k: v for k, v in overlay.items() if v is not None})
    if fields.get("coordinator") is None and env.get("JAX_COORDINATOR_ADDRESS"):
        fields["coordinator"] = env["JAX_COORDINATOR_ADDRESS"]
    return source, fields


def cluster_from(source: str, fields: dict) -> Cluster:
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


def env_int(env: Mapping[str, str], key: str) -> int | None:
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
    return env_int(env, ENV_PORT) or env_int(env, "JAX_COORDINATOR_PORT")


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
    n = env_int(env, "SLURM_STEP_NUM_TASKS") or env_int(env, "SLURM_NTASKS")
    port = _port(env) or int(env["SLURM_JOB_ID"]) % 2**12 + (65535 - 2**12 + 1)  # as JAX does
    local = env_int(env, "SLURM_LOCALID") or 0
    per_node = _slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                                    or env.get("SLURM_TASKS_PER_NODE"),
                                    env_int(env, "SLURM_NODEID") or 0)
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
    local = env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0
    return {"num_processes": int(env["OMPI_COMM_WORLD_SIZE"]),
            "process_id": int(env["OMPI_COMM_WORLD_RANK"]), "coordinator": coord,
            "local_device_ids": _one_gpu_per_process(
                env, local, env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"))}


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
        per_job = env_int(env, ENV_PROCESSES_PER_JOB) or 1
        job = env_int(env, "JOB_INDEX") or 0
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
