"""Multi-process start-up: find this process's place in the job, check it, start JAX's runtime.

``initialize()`` finds the coordinator address, the number of processes and this process's id
from explicit arguments, ``FIDDLEJAX_*`` environment variables, SLURM, Open MPI or a Kubernetes
indexed Job / JobSet (in that order of precedence), then calls ``jax.distributed.initialize``.
With nothing detected it is a no-op: single-process runs need no set-up.

Before JAX connects, the processes meet once over a plain TCP socket on the coordinator's port
(the "preflight"). JAX's own runtime reports an unreachable coordinator, a duplicate process id
or a wrong process count by aborting in C++ with a message that blames another task; the
preflight turns each of those into a Python error that names the bad value and the fix.

The parts, one idea each: :mod:`.cluster_env` (detection from the environment),
:mod:`.preflight` (the handshake), :mod:`.liveness` (a dead peer ends the job in seconds),
:mod:`.placement` (which batch rows a process loads), :mod:`.wire` (their messages).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from fiddlejax.distributed import preflight
from fiddlejax.distributed.cluster_env import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_INIT_TIMEOUT_S,
    DEFAULT_K8S_PORT,
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PORT,
    ENV_PROCESS_ID,
    ENV_PROCESSES_PER_JOB,
    Cluster,
    cluster_from,
    detect,
    detected_fields,
    env_int,
    first_slurm_host,
    split_address,
)
from fiddlejax.distributed.liveness import PEER_GRACE_S, goodbye
from fiddlejax.distributed.placement import data_shard, describe

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S", "DEFAULT_INIT_TIMEOUT_S", "DEFAULT_K8S_PORT",
    "ENV_COORDINATOR", "ENV_CPU_DEVICES", "ENV_HEARTBEAT_TIMEOUT", "ENV_INIT_TIMEOUT",
    "ENV_LOCAL_DEVICE_IDS", "ENV_NUM_PROCESSES", "ENV_PORT", "ENV_PROCESS_ID",
    "ENV_PROCESSES_PER_JOB", "PEER_GRACE_S", "Cluster", "current", "data_shard", "describe",
    "detect", "first_slurm_host", "goodbye", "initialize", "rendezvous", "split_address",
]

_current: Cluster | None = None

# How long a joining process waits for process 0's first acknowledgement (tests shorten it).
_ACK_TIMEOUT_S = 10.0


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

    cpu_devices = cpu_devices if cpu_devices is not None else env_int(os.environ, ENV_CPU_DEVICES)
    if jax.distributed.is_initialized():
        return _already_initialized(num_processes)
    cluster = _requested(coordinator, num_processes, process_id, local_device_ids)

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


def _already_initialized(num_processes: int | None) -> Cluster:
    """The layout when JAX's runtime is up already (by us, or by the caller directly)."""
    global _current
    import jax

    if _current is None or not _current.is_multiprocess:  # the caller initialized JAX
        _current = Cluster("jax", jax.process_count(), jax.process_index())
    if num_processes is not None and num_processes != _current.num_processes:
        raise RuntimeError(f"JAX is already initialized with {_current.num_processes} "
                           f"processes, not num_processes={num_processes}")
    return _current


def _requested(coordinator, num_processes, process_id, local_device_ids) -> Cluster:
    """The detected layout with the explicit arguments laid over it, validated."""
    source, fields = detected_fields(os.environ)
    explicit = {"coordinator": coordinator, "num_processes": num_processes,
                "process_id": process_id, "local_device_ids": local_device_ids}
    if any(v is not None for v in explicit.values()):
        fields.update({k: v for k, v in explicit.items() if v is not None})
        if source == "single" and (num_processes is not None or process_id is not None):
            source = "explicit"
    return cluster_from(source, fields)


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


def rendezvous(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Meet every process once on the coordinator's port, before JAX's runtime starts there.

    Process 0 listens, the others connect and say who they are; process 0 answers every one
    "ok" once all ``num_processes`` distinct ids have arrived, or sends everyone the error
    (duplicate id, disagreeing process counts, missing processes). Then the port is free again
    for JAX's coordination service. The protocol is :mod:`fiddlejax.distributed.preflight`.
    """
    host, port = split_address(coordinator)
    me = {"process_id": process_id, "num_processes": num_processes,
          "host": socket.gethostname(), "pid": os.getpid()}
    if process_id == 0:
        preflight.serve(port, me, timeout_s)
    else:
        preflight.join(host, port, me, timeout_s, coordinator, _ACK_TIMEOUT_S)
