"""Reliability, round three (issue 36), in-process: inputs refused before training with their key
named, non-finite steps skipped in-graph, non-finite states never saved, a donated state named,
the checkpoint directory lock, and clear messages from bad files.

The job-level faults (two concurrent jobs, a NaN run, a frozen peer, a full disk) run the real
command in subprocesses: tests/test_reliability_jobs.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax import checkpoint as ckpt
from fiddlejax.app import train
from fiddlejax.checkpoint.lock import LOCK_NAME, DirectoryInUse, DirectoryLock
from fiddlejax.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)

# (overrides, words the one-line error must hold): each was accepted silently before.
SILENT = [
    (["optimizer.lr=nan"], ["optimizer.lr=nan", "a finite number > 0"]),
    (["optimizer.lr=inf"], ["optimizer.lr=inf", "a finite number"]),
    (["optimizer.clip=.inf"], ["optimizer.clip=inf", "a finite number >= 0"]),
    (["optimizer.weight_decay=nan"], ["optimizer.weight_decay=nan", "a finite number"]),
    (["plan.rules={kv: tensor}"], ["plan.rules", "unknown logical axis 'kv'", "'kv_heads'"]),
    (["plan.rules={mlp: pipes}"], ["plan.rules.mlp='pipes'", "names no mesh axis"]),
    (["checkpoint.best_metric=val_los"], ["checkpoint.best_metric='val_los'", "'val_loss'"]),
    (["checkpoint.best_metric=val_loss", "train.eval_every=0"],
     ["checkpoint.best_metric=val_loss needs validation", "train.eval_every=0"]),
    (["checkpoint.dir="], ["checkpoint.dir=''", "a non-empty string", "checkpoint.dir=null"]),
    (["run.dir="], ["run.dir=''", "a non-empty string", "run.dir=runs/default"]),
    # resources: refused before any allocation (they hung, or crashed, before)
    (["data.batch_size=1099511627776"], ["data.batch_size=1099511627776 is too large",
                                         "more than this machine's", "data.batch_size=32"]),
    (["run.cpu_devices=100000"], ["run.cpu_devices=100000", "<= 4096"]),
    (["plan.compute_dtype=float16"], ["plan.compute_dtype=float16 does not run on the CPU",
                                      "bfloat16"]),
    # a mesh problem is named as one, not as a batch size to change
    (["mesh.data=3"], ["mesh.data=3 x mesh.pipe=2 x mesh.tensor=2 = 12 devices",
                       "this run has 8 devices (run.cpu_devices=8)", "mesh.data=2"]),
    (["mesh.data=0"], ["mesh.data=0", "mesh.data=-1"]),
]


@pytest.mark.parametrize("overrides,words", SILENT, ids=[" ".join(o) for o, _ in SILENT])
def test_silent_inputs_are_refused_naming_the_key(overrides, words, tmp_path, capsys):
    assert train.main(None, [f"run.dir={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fiddlejax train: "), err
    for w in words:
        assert w in err, (w, err)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_bad_config_file_bytes_are_named(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"\xff\xfe\x00train: {}")
    assert train.main(str(f), []) == 2
    err = capsys.readouterr().err
    assert f"--config {f} is not text: byte 0xff at offset 0 is not UTF-8" in err, err
    assert "codec" not in err


@cache
def trainer(opt=None, loss=None, check_inputs=False) -> fj.Trainer:
    plan = fj.Plan(mesh=fj.make_mesh(data=2, devices=jax.devices()[:2]), check_inputs=check_inputs)
    return fj.parallelize(GPT(CFG, rngs=nnx.Rngs(0)), opt or optax.adamw(1e-2), plan, loss=loss)


def batch(seed: int = 0, poison: float = 0.0) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, CFG.vocab_size, (4, CFG.seq_len + 1)).astype(np.int32),
            "poison": np.full((4,), poison, np.float32)}


def poisoned_loss(logits, b):
    """Next-token cross-entropy, plus a term worth 0 whose gradient is NaN when ``poison`` is 1:
    a finite loss with non-finite gradients, the case that used to be applied and saved."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:]).mean()
    p = b["poison"][0]
    return ce + p * jnp.sqrt(jnp.abs(logits - jax.lax.stop_gradient(logits)) + (1 - p)).sum()


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_nonfinite_gradients_are_skipped_in_graph_and_never_saved(tmp_path):
    t = trainer(loss=poisoned_loss)
    state, m = t.step(t.init(), batch(0))
    assert int(m["nonfinite_skipped"]) == 0
    before = leaves(t.to_canonical_state(state))
    skipped, m = t.step(state, batch(1, poison=1.0))
    assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    assert int(m["nonfinite_skipped"]) == 1 and int(skipped.step) == 2
    after = leaves(t.to_canonical_state(skipped))  # params and optimizer state untouched
    assert all(np.array_equal(a, b) for a, b in zip(before[1:], after[1:]))
    # Training goes on from the last good parameters, as if the batch had not been there.
    go_on, m = t.step(skipped, batch(2))
    assert int(m["nonfinite_skipped"]) == 0 and np.isfinite(float(m["grad_norm"]))

    with ckpt.CheckpointManager(tmp_path, t, async_save=False) as mgr:
        assert mgr.save(3, go_on, force=True)
        bad = t.to_canonical_state(go_on)
        bad = bad.__class__(bad.step, jax.tree.map(lambda x: x * jnp.nan, bad.params),
                            bad.opt_state)
        with pytest.raises(ckpt.NonFiniteState, match=r"step 4: the state is not finite "
                           r"\(params\.\S+ holds \d+ NaN/inf values .*not saved to .*the "
                           r"previous checkpoint \(step 3\) is intact .*resume=3"):
            mgr.save(4, t.from_canonical_state(bad), force=True)
        assert mgr.all_steps() == [3]


def test_check_inputs_keeps_the_last_good_state_with_the_error():
    from fiddlejax.checks import NonFiniteLoss

    t = trainer(loss=poisoned_loss, check_inputs=True)
    state, _ = t.step(t.init(), batch(0))
    want = leaves(t.params(state))
    with pytest.raises(NonFiniteLoss, match="step 2: the gradient norm is nan") as e:
        t.step(state, batch(1, poison=1.0))
    assert all(np.array_equal(a, b) for a, b in zip(want, leaves(t.params(e.value.state))))


def test_negative_token_ids_are_refused_by_default():
    t = trainer()
    state = t.init()
    bad = batch(0)
    bad["tokens"][1, 3] = -5  # a finite, meaningless loss before
    match = r"batch\['tokens'\] holds id -5 at \[1, 3\], outside \[0, 32\) .*; fix the data \("
    with pytest.raises(ValueError, match=match):
        t.loss_and_grads(state, bad)
    with pytest.raises(ValueError, match=match):
        t.step(state, bad)
    # On the device the check would cost a sync: the step counts them in-graph and skips the
    # update, as a non-finite step's (issue 49: it was applied, on a finite meaningless loss)
    before = leaves(t.to_canonical_state(state))
    state, m = t.step(state, {k: jnp.asarray(v) for k, v in bad.items()})
    assert int(m["bad_ids"]) == 1 and int(m["nonfinite_skipped"]) == 1
    assert not np.isfinite(float(m["loss"])) and int(state.step) == 1
    after = leaves(t.to_canonical_state(state))  # [0]: the step counter
    assert all(np.array_equal(a, b) for a, b in zip(before[1:], after[1:]))
    state, m = t.step(state, {k: jnp.asarray(v) for k, v in batch(1).items()})  # good: applied
    assert int(m["bad_ids"]) == 0 and int(m["nonfinite_skipped"]) == 0 and int(state.step) == 2


def test_a_donated_state_is_named_not_a_crash():
    """Reusing the state given to trainer.step crashed the interpreter (exit 139)."""
    code = f"""
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np, optax
from flax import nnx
import fiddlejax as fj
from fiddlejax.models.gpt import GPT, GPTConfig
t = fj.parallelize(GPT(GPTConfig(**{dataclasses.asdict(CFG)!r}), rngs=nnx.Rngs(0)), optax.sgd(.1),
                   fj.Plan(mesh=fj.make_mesh(data=2)))
s = t.init()
b = {{"tokens": np.zeros((4, 9), np.int32)}}
t.step(s, b)
try:
    t.step(s, b)
except ValueError as e:
    print(e)
"""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "this TrainState was consumed by an earlier trainer.step" in r.stdout
    assert "use the state that call returned" in r.stdout


def test_directory_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    with DirectoryLock(tmp_path, run_dir="runs/a"):
        with pytest.raises(DirectoryInUse, match=rf"{tmp_path} is in use by another fiddlejax "
                           rf"job \(host \S+ pid {os.getpid()}, run.dir=\S+runs/a, since"):
            DirectoryLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_NAME).exists()  # released: the holder file is gone
    # A job killed while holding it leaves its record (the kernel released the flock).
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid,
                                                  "run_dir": "old", "since": 0}))
    lock = DirectoryLock(tmp_path)
    assert "was left behind (it was killed)" in lock.acquire()
    lock.release()


def test_directory_lock_without_flock_checks_the_pid(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with DirectoryLock(tmp_path):
        with pytest.raises(DirectoryInUse, match=f"delete {tmp_path / LOCK_NAME}"):
            DirectoryLock(tmp_path).acquire()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 7}))
    lock = DirectoryLock(tmp_path)
    assert "no longer runs" in lock.acquire()
    lock.release()


def test_a_job_is_refused_while_another_holds_the_directory(tmp_path, capsys):
    """Also resume=auto, which ended in a traceback when two started at once."""
    ck = tmp_path / "ckpt"
    ck.mkdir()
    with DirectoryLock(ck, run_dir=tmp_path / "other"):
        assert train.main(None, [f"run.dir={tmp_path / 'mine'}", f"checkpoint.dir={ck}",
                                 "resume=auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint.dir={ck} is in use by another fiddlejax job " \
        f"(host {os.uname().nodename} pid {os.getpid()}, run.dir={tmp_path / 'other'}" in err, err


def test_damaged_pretrained_files_are_named(tmp_path, capsys):
    from fiddlejax.models.llama import Llama, LlamaConfig

    hf = tmp_path / "hf"
    Llama(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, seq_len=8),
          rngs=nnx.Rngs(0)).save_pretrained(hf)
    args = [f"run.dir={tmp_path / 'run'}", "model.name=llama", f"model.from_pretrained={hf}",
            "model.seq_len=8", "checkpoint.dir=null"]
    weights = next(hf.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    assert train.main(None, args) == 2
    err = capsys.readouterr().err
    assert f"model.from_pretrained={hf}: {weights.name} is damaged or truncated" in err, err
    (hf / "config.json").write_text('{"vocab_size": 64, "hidden')
    assert train.main(None, args) == 2
    err = capsys.readouterr().err
    assert f"model.from_pretrained={hf}: config.json is damaged (its JSON is cut off" in err, err


def test_a_truncated_checkpoint_names_the_array(tmp_path):
    t = trainer()
    with ckpt.CheckpointManager(tmp_path, t, async_save=False) as mgr:
        state = t.init()
        mgr.save(1, state, force=True)
        mgr.save(2, state, force=True)
    # every data file of the step cut short: which one holds an array depends on its chunks
    # (small ones sit inline in the merged B-tree's file, larger in the process's own)
    for data in (tmp_path / "2" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with ckpt.CheckpointManager(tmp_path, t) as mgr:
        with pytest.raises(ValueError, match=r"checkpoint step 2 in .* is truncated or corrupted: "
                           r"(step|params|opt_state)\S* cannot be read \(a data file is shorter "
                           r"than the checkpoint recorded .*resume=1"):
            mgr.restore()
