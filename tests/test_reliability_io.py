"""Reliability, round four (issue 49), in-process: ``trainer.step`` composes under a user's
``jax.jit``/``lax.scan``, readers never delete a writer's files, export never loses the user's
files or the previous export, and the lock file is never followed through a symlink.

The readers-during-training and failed-export faults run the real commands:
``benchmarks/faults.py`` (``readers``, ``export``)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)


@pytest.mark.parametrize("layout", ["pipelined", "zero3"])
def test_trainer_step_composes_under_jit_and_scan(layout):
    """The donated-state check called ``is_deleted()`` on tracers: a user's jitted, scanned
    loop over ``trainer.step`` failed with ConcretizationTypeError."""
    if layout == "pipelined":
        plan = fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, devices=jax.devices()[:4]),
                       schedule="1f1b", microbatches=2)
    else:
        plan = fj.Plan(mesh=fj.make_mesh(data=2, devices=jax.devices()[:2]), zero=3)
    t = fj.parallelize(GPT(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-2), plan)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 4, 9), 0, 32), np.int32)

    @jax.jit
    def two_steps(state, batches):
        def body(s, batch):
            s, m = t.step(s, batch)
            return s, m["loss"]

        return jax.lax.scan(body, state, batches)

    state, losses = two_steps(t.init(), {"tokens": tokens})
    eager, want = t.init(), []
    for i in range(2):
        eager, m = t.step(eager, {"tokens": tokens[i]})
        want.append(float(m["loss"]))
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    got, ref = t.params(state), t.params(eager)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# -- readers beside a writer ---------------------------------------------------------------------
TINY = ["run.cpu_devices=0", "mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "plan.schedule=null",
        "plan.virtual_stages=1", "plan.microbatches=1", "model.vocab_size=256",
        "model.seq_len=16", "model.d_model=32", "model.n_heads=4", "model.n_layers=2",
        "model.d_ff=64", "data.batch_size=8", "train.eval_every=0", "train.eval_batches=0",
        "run.progress=lines", "train.steps=2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `fiddlejax train` leaves it: config.yaml and checkpoints/2."""
    from fiddlejax.app import config

    run = tmp_path_factory.mktemp("run")
    (run / "config.yaml").write_text(json.dumps(config.load(None, [*TINY, f"run.dir={run}"])))
    t = _trainer()
    with fj.CheckpointManager(run / "checkpoints", t, async_save=False) as m:
        m.save(2, t.init(), force=True)
    return run


def _digest(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


def test_readers_never_delete_a_writers_save_in_progress(run_dir, capsys):
    """eval, generate and export opened the checkpoints with a manager that cleaned temporary
    directories on open: a live trainer's save in progress vanished and the trainer stopped."""
    from fiddlejax.app import inference
    from fiddlejax.app.export import export
    from fiddlejax.checkpoint.lock import DirectoryLock

    ckpts = run_dir / "checkpoints"
    for name in ("6.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1795833279"):
        (ckpts / name / "state").mkdir(parents=True)
        (ckpts / name / "state" / "blob").write_bytes(b"a save in progress")
    before = _digest(ckpts)
    with DirectoryLock(ckpts, run_dir=run_dir):  # the writer holds the lock: readers need none
        assert inference.main("eval", [f"run.dir={run_dir}", "batches=1"]) == 0
        assert "step 2: validation loss" in capsys.readouterr().out
        assert export(run_dir, run_dir.parent / "hf") == 2
    after = _digest(ckpts)
    after.pop(".fiddlejax-lock", None)
    assert after == before  # nothing removed, nothing written
    reader = fj.CheckpointManager(ckpts, _trainer(), read_only=True)
    try:
        with pytest.raises(ValueError, match="opened read_only=True"):
            reader.save(3, None, force=True)
    finally:
        reader.close()
    assert _digest(ckpts) == before


def _trainer():
    from fiddlejax.app import build, config

    c = config.load(None, TINY)
    return fj.parallelize(build.build_model(c["model"], 0), build.make_optimizer(c),
                          fj.Plan(mesh=fj.make_mesh(data=1, devices=jax.devices()[:1])))


# -- export: the user's files and the previous export ---------------------------------------------
USER = {"model-backup.safetensors": b"the user's backup", "model_v1.safetensors": b"v1",
        "README.md": b"# my model\n"}


def test_export_keeps_the_users_files_and_refuses_to_replace_theirs(run_dir, capsys):
    """Export deleted every model*.safetensors in the target and replaced its config.json."""
    from fiddlejax.app import export_dir
    from fiddlejax.app.export import export, export_command

    out = run_dir.parent / "with-user-files"
    out.mkdir()
    for name, data in USER.items():
        (out / name).write_bytes(data)
    export(run_dir, out)
    assert {n: (out / n).read_bytes() for n in USER} == USER  # byte-identical
    ours = export_dir.recorded(out)
    assert "model.safetensors" in ours and "config.json" in ours and not set(USER) & set(ours)
    export(run_dir, out, max_shard_size="40KB")  # a re-export replaces exactly its own files
    assert {n: (out / n).read_bytes() for n in USER} == USER
    assert not (out / "model.safetensors").exists()  # the earlier export's, not rewritten
    assert (out / "model.safetensors.index.json").is_file()
    # A config.json that no export wrote: refused before anything is read, unless --overwrite.
    theirs = run_dir.parent / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_bytes(b'{"model_type": "mine"}')
    before = _digest(theirs)
    assert export_command([str(run_dir), str(theirs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{theirs} holds config.json, which this export would " \
        "replace and no earlier fiddlejax export wrote" in err and "--overwrite" in err, err
    assert _digest(theirs) == before
    assert export_command([str(run_dir), str(theirs), "--overwrite"]) == 0
    assert (theirs / "config.json").read_bytes() != b'{"model_type": "mine"}'


def test_a_failed_re_export_leaves_the_previous_one_intact(run_dir, monkeypatch, capsys):
    """A failed export deleted the old shards before writing new ones (only config.json was
    left) and printed a 25-line traceback."""
    import errno

    from fiddlejax.app.export import export_command
    from fiddlejax.data import tokenizer_files

    def disk_full(directory, *args):
        (Path(directory) / "tokenizer.json").write_bytes(b"{half")
        raise OSError(errno.ENOSPC, "No space left on device")

    for user_files in (False, True):  # a directory swap; file-by-file beside the user's files
        out = run_dir.parent / f"again-{user_files}"
        assert export_command([str(run_dir), str(out)]) == 0
        if user_files:
            (out / "README.md").write_bytes(USER["README.md"])
        before = _digest(out)
        with monkeypatch.context() as m:
            m.setattr(tokenizer_files, "save", disk_full)
            assert export_command([str(run_dir), str(out), "--max-shard-size", "40KB"]) == 1
        err = capsys.readouterr().err
        assert err == (f"fiddlejax export: writing the export to {out} failed (No space left on "
                       "device: the disk is full); the earlier export there is intact\n"), err
        assert _digest(out) == before
        assert sorted(p.name for p in out.parent.iterdir() if "fiddlejax-" in p.name) == []
        from fiddlejax.models.hf import read_safetensors

        assert read_safetensors(out)  # loadable


def test_save_pretrained_removes_only_the_weights_it_writes(tmp_path):
    from fiddlejax.models import hf_io

    for name in ("model_v1.safetensors", "model-backup.safetensors",
                 "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (tmp_path / name).write_bytes(b"x")
    hf_io.write(tmp_path, [("w", (2, 2))], [("w", np.ones((2, 2), np.float32))], 2**30,
                np.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-backup.safetensors", "model.safetensors", "model_v1.safetensors"]


# -- the lock file ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flock", [True, False])
def test_the_lock_file_is_never_followed_through_a_link(tmp_path, monkeypatch, flock):
    """A symlink planted as .fiddlejax-lock had the lock's JSON written into its target."""
    import errno
    import fcntl
    import os

    from fiddlejax.checkpoint.lock import LOCK_NAME, DirectoryInUse, DirectoryLock

    if not flock:
        def no_flock(fd, op):
            raise OSError(errno.EOPNOTSUPP, "not supported")

        monkeypatch.setattr(fcntl, "flock", no_flock)
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"do not truncate")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / LOCK_NAME).symlink_to(precious)
    with pytest.raises(DirectoryInUse, match=rf"its lock file {ck / LOCK_NAME} is a symbolic "
                       rf"link \(to {precious}\); fiddlejax never writes through a link"):
        DirectoryLock(ck).acquire()
    (ck / LOCK_NAME).unlink()
    os.link(precious, ck / LOCK_NAME)
    with pytest.raises(DirectoryInUse, match="is a hard link to another file"):
        DirectoryLock(ck).acquire()
    assert precious.read_bytes() == b"do not truncate"


def test_a_step_deleted_while_read_is_read_from_a_snapshot(run_dir, tmp_path):
    """A job saving every step deletes a step within a few steps (max_to_keep): a reader
    failed on it as "truncated or corrupted"."""
    import shutil

    from fiddlejax.app import beside_writer

    ck = tmp_path / "ck"
    for s in ("2", "3"):
        shutil.copytree(run_dir / "checkpoints" / "2", ck / s)
    seen = []

    def read(m, s):
        seen.append((m.directory, s))
        if len(seen) == 1:  # the job deletes the step being read
            shutil.rmtree(ck / str(s))
            raise ValueError("checkpoint step 3 is truncated or corrupted")
        return m.restore_all(s).step

    m = fj.CheckpointManager(ck, _trainer(), read_only=True)
    try:
        assert beside_writer.read(m, None, read) == 2
        assert seen[1][0].name.startswith(".fiddlejax-reader-") and seen[1][1] == 2
        assert sorted(p.name for p in ck.iterdir()) == ["2"]  # the snapshot is gone
        seen.clear()
        shutil.copytree(ck / "2", ck / "3")
        with pytest.raises(FileNotFoundError, match=r"checkpoint step 3 in .* was deleted while "
                           r"it was read, by the job saving there .*its steps now: \[2\]"):
            beside_writer.read(m, 3, read)  # a named step is not replaced by another
    finally:
        m.close()
