"""Multi-process runs on this machine: the real JAX runtime (coordination service, gloo), small.

Two processes x 2 CPU devices train a tiny GPT with ``fiddlejax train``; their losses must equal
a single-process run of the same 4-device layout. Killing one process must end the other with a
clear message within 60 s, and restarting resumes from the last checkpoint. The rest are quick
unit tests: detection from fake SLURM / Open MPI / Kubernetes environments, the preflight's
errors, the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fiddlejax import distributed as dist

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "local.py"
TINY = ["model.seq_len=16", "model.n_layers=2", "model.d_model=32", "model.n_heads=2",
        "model.d_ff=64", "data.batch_size=8", "train.eval_every=0", "train.eval_batches=0",
        "run.progress=lines", "train.log_every=1000"]
CLUSTER_VARS = ("FIDDLEJAX_", "SLURM_", "OMPI_", "JOB_COMPLETION_INDEX", "JOBSET_", "JOB_INDEX",
                "REPLICATED_JOB_", "JAX_COORDINATOR", "JAX_NUM_CPU_DEVICES")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without cluster variables or pytest's 8-device XLA flag."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS)}
    env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def train_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "fiddlejax.cli", "train", *TINY, f"run.dir={run_dir}",
            *overrides]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a resumed run's later line for a step wins."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def single_process(tmp: Path, *overrides: str) -> dict[int, float]:
    r = subprocess.run(train_cmd(tmp, "run.cpu_devices=4", *overrides), env=clean_env(),
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(tmp)


def assert_same_losses(got: dict[int, float], want: dict[int, float]) -> float:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    diff = max(abs(got[s] - want[s]) for s in want)
    assert diff < 1e-5, (got, want)
    return diff


# -- the real thing: two processes ---------------------------------------------------------------

@pytest.mark.slow
def test_pipe_axis_across_processes_equals_single_process(tmp_path):
    """pipe=2 across the two processes (tensor=2 inside each): same losses as one process."""
    layout = ["mesh.data=1", "mesh.pipe=2", "mesh.tensor=2", "plan.schedule=1f1b",
              "plan.virtual_stages=1", "plan.microbatches=2", "train.steps=3"]
    want = single_process(tmp_path / "one", *layout)
    r = subprocess.run(
        [sys.executable, str(LAUNCH), "--nproc", "2", "--devices-per-process", "2", "--",
         *train_cmd(tmp_path / "two", *layout)],
        env=clean_env(), capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # Device order: tensor pairs inside a process, the pipeline crosses processes.
    # (positions indexed data, pipe, context, expert, tensor)
    assert "process of each position: [[[[[0, 0]]], [[[1, 1]]]]]" in r.stdout, r.stdout[-3000:]
    diff = assert_same_losses(losses(tmp_path / "two"), want)
    print(f"pipe across processes: max |loss difference| = {diff:.2e}")


@pytest.mark.slow
def test_data_axis_across_processes_kill_and_resume(tmp_path):
    """data=4 over two processes: losses equal one process; a killed peer ends the job within
    60 s with a clear message; a restart with resume=auto continues with nothing lost."""
    steps = 16
    layout = ["mesh.data=4", "mesh.pipe=1", "mesh.tensor=1", "plan.schedule=null",
              "plan.virtual_stages=1", "plan.microbatches=1", f"train.steps={steps}"]
    want = single_process(tmp_path / "one", *layout)
    run_dir, ckpt = tmp_path / "two", tmp_path / "ckpt"
    cmd = train_cmd(run_dir, *layout, f"checkpoint.dir={ckpt}", "checkpoint.every=2",
                    "resume=auto")
    port = _free_port()

    def start(rank: int, logs: Path) -> subprocess.Popen:
        env = clean_env(FIDDLEJAX_COORDINATOR=f"127.0.0.1:{port}", FIDDLEJAX_NUM_PROCESSES="2",
                        FIDDLEJAX_PROCESS_ID=str(rank), FIDDLEJAX_CPU_DEVICES="2",
                        # the restarted job reuses the first one's compiled programs
                        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
                        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        return subprocess.Popen(cmd, env=env, stdout=open(logs / f"out{rank}", "w"),  # noqa: SIM115
                                stderr=open(logs / f"err{rank}", "w"), cwd=ROOT)  # noqa: SIM115

    logs1 = tmp_path / "logs1"
    logs1.mkdir()
    procs = [start(r, logs1) for r in range(2)]
    try:
        # Wait until training is under way and a checkpoint exists, then kill process 1.
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                pytest.fail("a process ended early:\n" + (logs1 / "err0").read_text()[-3000:]
                            + (logs1 / "err1").read_text()[-3000:])
            done = losses(run_dir) if (run_dir / "metrics.jsonl").exists() else {}
            if len(done) >= 4:
                break
            time.sleep(0.05)
        else:
            pytest.fail("training did not start in time")
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code = procs[0].wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err0 = (logs1 / "err0").read_text()
    assert code != 0, err0[-3000:]
    assert took < 60, f"the survivor took {took:.1f}s to exit"
    lines = [x for x in err0.splitlines() if "lost process 1" in x]
    assert len(lines) == 1, err0[-3000:]  # one line naming the lost peer
    assert "killed, or crashed" in lines[0] and "resume=auto" in lines[0]
    assert "Check failure" not in err0 and "*** " not in err0, err0[-3000:]  # no C++ dump
    first = losses(run_dir)
    assert len(first) < steps, "the run finished before the kill; the test proves nothing"
    print(f"survivor exited with status {code} {took:.1f}s after its peer was killed, "
          f"after step {max(first)}")

    # Restart both processes: resume=auto continues from the last checkpoint.
    logs2 = tmp_path / "logs2"
    logs2.mkdir()
    port = _free_port()
    procs = [start(r, logs2) for r in range(2)]
    codes = [p.wait(timeout=500) for p in procs]
    assert codes == [0, 0], (logs2 / "err0").read_text()[-3000:]
    out0 = (logs2 / "out0").read_text()
    assert "resumed from" in out0, out0[-2000:]
    diff = assert_same_losses(losses(run_dir), want)
    print(f"data across processes (killed at step {max(first)}, resumed): "
          f"max |loss difference| over {steps} steps = {diff:.2e}")


# -- detection from the environment (no network, no JAX runtime) ---------------------------------

def test_nothing_detected_is_single_process():
    assert dist.detect({}) == dist.Cluster("single")
    assert dist.detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_PROCID": "0"}).source \
        == "single"  # a batch script outside srun: no step, so no peers to wait for


def test_explicit_environment_variables():
    c = dist.detect({"FIDDLEJAX_COORDINATOR": "10.0.0.5:1234", "FIDDLEJAX_NUM_PROCESSES": "4",
                     "FIDDLEJAX_PROCESS_ID": "3", "FIDDLEJAX_LOCAL_DEVICE_IDS": "0,1"})
    assert c == dist.Cluster("env", 4, 3, "10.0.0.5:1234", (0, 1))
    assert dist.detect({"FIDDLEJAX_NUM_PROCESSES": "1", "FIDDLEJAX_PROCESS_ID": "0"}).source \
        == "single"


def test_slurm():
    env = {"SLURM_JOB_ID": "4099", "SLURM_STEP_NODELIST": "gpu[007-009,012],cpu1",
           "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    c = dist.detect(env)
    assert (c.source, c.num_processes, c.process_id) == ("slurm", 16, 9)
    assert c.coordinator == f"gpu007:{4099 % 4096 + 61440}"
    assert c.local_device_ids == (1,)  # 8 tasks per node share its GPUs: one GPU each
    one_per_node = dict(env, SLURM_STEP_TASKS_PER_NODE="1(x16)", SLURM_LOCALID="0")
    assert dist.detect(one_per_node).local_device_ids is None  # a node's process sees all GPUs
    per_task = dict(env, CUDA_VISIBLE_DEVICES="3")  # srun --gpus-per-task=1 narrowed it already
    assert dist.detect(per_task).local_device_ids is None
    assert dist.detect(dict(env, FIDDLEJAX_COORDINATOR_PORT="5555")).coordinator == "gpu007:5555"


@pytest.mark.parametrize("nodelist,host", [
    ("node001", "node001"), ("node001,node002", "node001"), ("n[01-04]", "n01"),
    ("n[3,5-9]", "n3"), ("rack1-n[01-04]-ib,x", "rack1-n01-ib"), ("a[1-2]b[3-4]", "a1b3")])
def test_first_slurm_host(nodelist, host):
    assert dist.first_slurm_host(nodelist) == host


def test_openmpi():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
           "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    c = dist.detect(env)
    port = (1531576320 // 4096) % 4096 + 61440
    assert c == dist.Cluster("openmpi", 4, 2, f"10.96.0.1:{port}", None)
    no_uri = {k: v for k, v in env.items() if k != "OMPI_MCA_orte_hnp_uri"}  # Open MPI 5
    with pytest.raises(ValueError, match="Open MPI detected: the coordinator address is unknown; "
                                         "set FIDDLEJAX_COORDINATOR=HOST:PORT"):
        dist.detect(no_uri)
    assert dist.detect(dict(no_uri, FIDDLEJAX_COORDINATOR="head:9000")).coordinator == "head:9000"


def test_kubernetes_indexed_job_and_jobset():
    job = {"JOB_COMPLETION_INDEX": "3", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX is set.*set "
                                         "FIDDLEJAX_NUM_PROCESSES=N"):
        dist.detect(job)
    c = dist.detect(dict(job, FIDDLEJAX_NUM_PROCESSES="4",
                         FIDDLEJAX_COORDINATOR="train-0.train:8476"))
    assert c == dist.Cluster("kubernetes", 4, 3, "train-0.train:8476", None)

    js = {"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "llm", "REPLICATED_JOB_NAME": "workers",
          "JOB_INDEX": "2", "FIDDLEJAX_NUM_PROCESSES": "8", "FIDDLEJAX_PROCESSES_PER_JOB": "2"}
    c = dist.detect(js)
    assert c == dist.Cluster("jobset", 8, 5, "llm-workers-0-0.llm:8476", None)


def _container_env(pod_spec: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod_spec["containers"][0]["env"]}


def _mesh_devices(pod_spec: dict) -> int:
    args = dict(a.split("=", 1) for a in pod_spec["containers"][0]["args"])
    return int(args["mesh.data"]) * int(args["mesh.pipe"]) * int(args["mesh.tensor"])


def test_kubernetes_templates_agree_with_detection():
    """The manifests' numbers fit together, and every pod finds the same coordinator."""
    yaml = pytest.importorskip("yaml")
    svc, job = yaml.safe_load_all((ROOT / "launch/k8s/indexed-job.yaml").read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    env = _container_env(pod)
    n = spec["completions"]
    assert spec["parallelism"] == n and int(env["FIDDLEJAX_NUM_PROCESSES"]) == n
    assert pod["subdomain"] == svc["metadata"]["name"]
    pod0 = f"{job['metadata']['name']}-0.{pod['subdomain']}:"  # pod 0's DNS name
    assert env["FIDDLEJAX_COORDINATOR"].startswith(pod0)
    gpus = pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert _mesh_devices(pod) == n * gpus
    for i in range(n):
        c = dist.detect(dict(env, JOB_COMPLETION_INDEX=str(i)))
        assert (c.process_id, c.num_processes) == (i, n)

    (js,) = yaml.safe_load_all((ROOT / "launch/k8s/jobset.yaml").read_text())
    (rj,) = js["spec"]["replicatedJobs"]
    jspec, pod = rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]
    env = _container_env(pod)
    n = rj["replicas"] * jspec["parallelism"]
    assert int(env["FIDDLEJAX_NUM_PROCESSES"]) == n
    assert _mesh_devices(pod) == n * pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    ids = set()
    for j in range(rj["replicas"]):
        for i in range(jspec["parallelism"]):
            c = dist.detect(dict(env, JOBSET_NAME=js["metadata"]["name"],
                                 REPLICATED_JOB_NAME=rj["name"], JOB_INDEX=str(j),
                                 JOB_COMPLETION_INDEX=str(i)))
            assert c.coordinator == f"{js['metadata']['name']}-{rj['name']}-0-0." \
                                    f"{js['metadata']['name']}:8476"
            ids.add(c.process_id)
    assert ids == set(range(n))


def test_slurm_template_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(ROOT / "launch/slurm.sbatch")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_detection_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"process_id=4 is outside 0\.\.3"):
        dist.detect({"FIDDLEJAX_NUM_PROCESSES": "4", "FIDDLEJAX_PROCESS_ID": "4",
                     "FIDDLEJAX_COORDINATOR": "h:1"})
    with pytest.raises(ValueError, match="must look like HOST:PORT"):
        dist.detect({"FIDDLEJAX_NUM_PROCESSES": "2", "FIDDLEJAX_PROCESS_ID": "0",
                     "FIDDLEJAX_COORDINATOR": "localhost"})
    with pytest.raises(ValueError, match="FIDDLEJAX_NUM_PROCESSES='two' must be an integer"):
        dist.detect({"FIDDLEJAX_NUM_PROCESSES": "two"})


def test_initialize_without_a_job_is_a_no_op(monkeypatch):
    for k in list(os.environ):
        if k.startswith(CLUSTER_VARS[:-1]):
            monkeypatch.delenv(k)
    assert dist.initialize() == dist.Cluster("single")


def test_initialize_after_devices_were_touched_is_a_clear_error(monkeypatch):
    import jax

    jax.devices()  # the backend starts here
    for k in list(os.environ):
        if k.startswith(CLUSTER_VARS[:-1]):
            monkeypatch.delenv(k)
    with pytest.raises(RuntimeError, match="JAX's backend already started.*call initialize"):
        dist.initialize("127.0.0.1:1234", 2, 1)


# -- the preflight rendezvous (sockets only) ------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meet(ids: list[int], n: int | list[int], timeout_s: float = 10.0) -> list[str | None]:
    """Run rendezvous for each id in a thread; each entry: None (ok) or the error text."""
    port, out = _free_port(), [None] * len(ids)
    counts = n if isinstance(n, list) else [n] * len(ids)

    def one(i: int) -> None:
        try:
            dist.rendezvous(f"127.0.0.1:{port}", counts[i], ids[i], timeout_s)
        except RuntimeError as e:
            out[i] = str(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ids))]
    for i, t in enumerate(threads):
        t.start()
        if i == 0:
            time.sleep(0.2)  # process 0 first, so later duplicates have someone to talk to
    for t in threads:
        t.join(timeout_s + 15)
    return out


def test_rendezvous_ok():
    assert _meet([0, 1, 2], 3) == [None, None, None]


def test_rendezvous_duplicate_process_id():
    errors = _meet([0, 1, 1], 3)
    assert all(e and "process_id=1 is claimed by two processes" in e for e in errors), errors


def test_rendezvous_disagreeing_counts():
    errors = _meet([0, 1], [2, 3])
    assert all(e and "processes disagree on the job size" in e for e in errors), errors


def test_rendezvous_missing_processes():
    errors = _meet([0, 1], 3, timeout_s=1.5)
    assert all(e and "missing process ids [2]" in e for e in errors), errors


def test_unreachable_coordinator():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"process 1 could not reach the coordinator at "
                                           r"127\.0\.0\.1:\d+ within 2s"):
        dist.rendezvous(f"127.0.0.1:{_free_port()}", 2, 1, timeout_s=1.5)
    assert time.monotonic() - t0 < 10


def test_train_with_unreachable_coordinator_exits_with_the_address():
    env = clean_env(FIDDLEJAX_COORDINATOR=f"127.0.0.1:{_free_port()}",
                    FIDDLEJAX_NUM_PROCESSES="2", FIDDLEJAX_PROCESS_ID="1",
                    FIDDLEJAX_INIT_TIMEOUT_S="2")
    r = subprocess.run([sys.executable, "-m", "fiddlejax.cli", "train"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "fiddlejax train: process 1 could not reach the coordinator at 127.0.0.1:" in r.stderr


def test_silent_port_is_not_mistaken_for_the_coordinator(monkeypatch):
    """Something else on the port (a previous job's JAX service) that never answers: retry,
    then time out with the address, instead of waiting forever."""
    monkeypatch.setattr(dist, "_ACK_TIMEOUT_S", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        with pytest.raises(RuntimeError, match="could not reach the coordinator"):
            dist.rendezvous(f"127.0.0.1:{port}", 2, 1, timeout_s=1.5)


# -- data placement -------------------------------------------------------------------------------

def _fake_mesh(owner: list, axes=("data", "pipe", "tensor")):
    devices = np.vectorize(lambda p: SimpleNamespace(process_index=p), otypes=[object])(
        np.array(owner))
    return SimpleNamespace(axis_names=axes, devices=devices)


def test_data_shard():
    # 2 processes x 2 devices, data=4: each process loads its own half of every batch.
    mesh = _fake_mesh([[[0]], [[0]], [[1]], [[1]]])
    assert [dist.data_shard(mesh, process_index=p) for p in (0, 1)] == [(0, 2), (1, 2)]
    # pipe across processes: both processes sit on the one data slice and load the same rows.
    mesh = _fake_mesh([[[0, 0], [1, 1]]])
    assert [dist.data_shard(mesh, process_index=p) for p in (0, 1)] == [(0, 1), (0, 1)]
    # a non-contiguous device order is refused with the fix
    mesh = _fake_mesh([[[0]], [[1]], [[0]], [[1]]])
    with pytest.raises(ValueError, match=r"owns data slices \[0, 2\] of 4.*host by host"):
        dist.data_shard(mesh, process_index=0)


# -- the launcher (no JAX) ------------------------------------------------------------------------

def _launch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCH), *args], env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_launcher_sets_ranks_and_prefixes_output():
    code = ("import os; print(os.environ['FIDDLEJAX_PROCESS_ID'], "
            "os.environ['FIDDLEJAX_NUM_PROCESSES'], os.environ['FIDDLEJAX_CPU_DEVICES'], "
            "os.environ['FIDDLEJAX_COORDINATOR'].startswith('127.0.0.1:'))")
    r = _launch("--nproc", "3", "--devices-per-process", "2", "--", sys.executable, "-c", code)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] 0 3 2 True", "[1] 1 3 2 True",
                                             "[2] 2 3 2 True"]


def test_launcher_ends_the_others_when_one_fails():
    code = ("import os, sys, time; r = int(os.environ['FIDDLEJAX_PROCESS_ID']); "
            "time.sleep(0.5); sys.exit(3) if r == 1 else time.sleep(120)")
    t0 = time.monotonic()
    r = _launch("--nproc", "3", "--grace", "2", "--", sys.executable, "-c", code)
    assert r.returncode == 3
    assert time.monotonic() - t0 < 30
    assert "[launch] process 1 exited with status 3; ending processes [0, 2]" in r.stderr


def test_launcher_forwards_sigterm():
    code = ("import os, signal, sys, time\n"
            "def bye(s, f):\n"
            "    print('got', signal.Signals(s).name, flush=True); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, str(LAUNCH), "--nproc", "2", "--", sys.executable,
                          "-c", code], env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    ready = 0
    while ready < 2:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        ready += "ready" in line
    p.send_signal(signal.SIGTERM)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired as e:  # say which process hung, then clean up
        tree = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,args"],
                              capture_output=True, text=True).stdout
        p.kill()
        pytest.fail(f"launcher still running 60 s after SIGTERM\nstdout: {e.stdout!r}\n"
                    f"stderr: {e.stderr!r}\nprocesses:\n{tree}")
    assert p.returncode == 0  # both handled it and exited 0: a clean stop, not 143
    assert sorted(x for x in out.splitlines() if "got" in x) == ["[0] got SIGTERM",
                                                                 "[1] got SIGTERM"]
    assert "received SIGTERM; forwarding it to every process" in err


def test_launcher_needs_a_command():
    r = _launch("--nproc", "2")
    assert r.returncode == 2 and "give the command after --" in r.stderr


def test_backend_probe_is_pinned():
    """distributed._backends_started uses a private JAX function (no public one exists): it
    must still exist and tell a fresh process (False) from one that touched a device (True)."""
    code = ("from jax._src.xla_bridge import backends_are_initialized\n"
            "from fiddlejax import distributed as d\n"
            "import jax\n"
            "before = d._backends_started()\n"
            "jax.devices()\n"
            "print(before, d._backends_started(), backends_are_initialized())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True", "True"]
