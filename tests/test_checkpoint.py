"""Checkpoints: layout portability (bit-exact), mismatches, corruption, crashes mid-save,
preservation, CheckFreq, and `fiddlejax train` resuming exactly after SIGKILL and SIGTERM."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax import canonical
from fiddlejax import checkpoint as ckpt
from fiddlejax.app import checkpoints as job_ckpt
from fiddlejax.models.gpt import GPT, GPTConfig
from fiddlejax.train import TrainState

CFG = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
# Pipeline layouts need a layer per chunk: 9 layers over 4 stages x 2 chunks is uneven (padded).
# PIPE_CFG: 2053 x 32 > 65,536 embedding elements, so pipelines split it over pipe x tensor
# (padded to 2056) while (8,1,1) keeps 2053 rows: restores cross both paddings and placements.
PIPE_CFG = GPTConfig(vocab_size=2053, seq_len=16, d_model=32, n_heads=4, n_layers=9, d_ff=64)
OPT = optax.adamw(1e-2)


@cache
def model(cfg: GPTConfig = CFG) -> GPT:
    return GPT(cfg, rngs=nnx.Rngs(0))


@cache
def trainer(data: int, pipe: int, tensor: int, zero: int = 0, schedule: str | None = None,
            virtual: int = 1, cfg: GPTConfig = CFG, opt=OPT) -> fj.Trainer:
    mesh = fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])
    plan = fj.Plan(mesh=mesh, schedule=schedule, virtual_stages=virtual, zero=zero,
                   microbatches=4 if pipe > 1 else 1)
    return fj.parallelize(model(cfg), opt, plan)


def random_canonical(cfg: GPTConfig = CFG, opt=OPT, seed: int = 0) -> TrainState:
    """A canonical TrainState with every leaf random and positive (Adam's ``nu`` too)."""
    params = nnx.state(model(cfg), nnx.Param)
    state = TrainState(jax.numpy.int32(7), params, opt.init(params))
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    out = [np.asarray(rng.integers(1, 1000, np.shape(x)), x.dtype)
           if np.issubdtype(x.dtype, np.integer)
           else np.asarray(rng.uniform(0.01, 0.2, np.shape(x)), x.dtype) for x in leaves]
    return jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in out])


def assert_bitwise_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


def dir_digest(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


# -- layout portability -------------------------------------------------------------------------
S = {"cfg": CFG}
P = {"cfg": PIPE_CFG}
PAIRS = {  # chosen so each trainer serves twice (compiles dominate the time)
    "(2,1,2)->(8,1,1)": ((2, 1, 2, 0, None, 1, S), (8, 1, 1, 0, None, 1, S)),
    "(4,1,2) ZeRO->(2,1,2) no ZeRO": ((4, 1, 2, 1, None, 1, S), (2, 1, 2, 0, None, 1, S)),
    "(1,4,2) interleaved->(2,2,2) 1f1b": ((1, 4, 2, 0, "interleaved-1f1b", 2, P),
                                          (2, 2, 2, 0, "1f1b", 1, P)),
    "(2,2,2) 1f1b->(8,1,1) ZeRO": ((2, 2, 2, 0, "1f1b", 1, P), (8, 1, 1, 1, None, 1, P)),
    "(8,1,1) ZeRO->(1,4,2) interleaved": ((8, 1, 1, 1, None, 1, P),
                                          (1, 4, 2, 0, "interleaved-1f1b", 2, P)),
}


def _trainer(spec) -> fj.Trainer:
    d, p, t, zero, schedule, virtual, kw = spec
    return trainer(d, p, t, zero, schedule, virtual, **kw)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_restore_onto_another_layout_is_bit_exact(pair, tmp_path):
    src_spec, dst_spec = PAIRS[pair]
    src, dst = _trainer(src_spec), _trainer(dst_spec)
    canonical = random_canonical(src_spec[-1]["cfg"])
    state = src.from_canonical_state(canonical)
    with ckpt.CheckpointManager(tmp_path, src) as m:
        assert m.save(3, state, data_state={"next_index": 3}, rng=jax.random.key(5),
                      extra={"note": pair})
    with ckpt.CheckpointManager(tmp_path, dst) as m:
        r = m.restore_all()
    assert_bitwise_equal(dst.to_canonical_state(r.state), canonical)
    for x, s in zip(jax.tree.leaves(r.state), jax.tree.leaves(dst.state_shardings)):
        assert x.sharding.is_equivalent_to(s, x.ndim)  # laid out as the target trains
    assert r.step == 3 and r.data_state == {"next_index": 3} and r.extra == {"note": pair}
    assert np.array_equal(jax.random.key_data(r.rng), jax.random.key_data(jax.random.key(5)))
    assert r.plan["mesh"] == dict(zip(("data", "pipe", "tensor"), src_spec[:3]), context=1,
                                  expert=1)



@pytest.mark.parametrize("mesh, zero, schedule, virtual", [
    ((1, 4, 2), 0, "1f1b", 1), ((1, 4, 2), 0, "interleaved-1f1b", 2), ((1, 4, 2), 0, "zb-v", 2),
    ((2, 2, 2), 1, "1f1b", 1)])
def test_canonical_state_keeps_the_layers_split_over_pipe(mesh, zero, schedule, virtual):
    """Saving and restoring never hold a whole model per device: the canonical layer stack
    stays split over `pipe` (an all-to-all for interleaved, chunks sent stage to stage for
    zb-v's V; ZeRO's optimizer state keeps its data split), with no replica of the layers,
    and converts back bit for bit."""
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_heads=4, n_layers=8, d_ff=256)
    tr = trainer(*mesh, zero, schedule, virtual, cfg=cfg)
    to_canonical, to_internal = jax.jit(tr.to_canonical_state), jax.jit(tr.from_canonical_state)
    abstract = tr.abstract_state()
    out = to_canonical.lower(abstract).compile()
    for path, s in jax.tree_util.tree_flatten_with_path(out.output_shardings.params)[0]:
        if "blocks" in jax.tree_util.keystr(path):
            assert s.spec[0] == "pipe", jax.tree_util.keystr(path)
    args = out.memory_analysis().argument_size_in_bytes
    canonical = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             jax.eval_shape(to_canonical, abstract), out.output_shardings)
    for compiled in (out, to_internal.lower(canonical).compile()):
        mem = compiled.memory_analysis()
        assert mem.output_size_in_bytes <= 1.01 * args  # was 4x: the layers on every stage
        assert mem.temp_size_in_bytes <= args  # was 4-7x: gathered layers
    canonical = random_canonical(cfg)
    assert_bitwise_equal(tr.to_canonical_state(tr.from_canonical_state(canonical)), canonical)
def test_muon_and_stale_correction_state_restores_onto_another_layout(tmp_path):
    """Muon's masked state (AdamW for non-matrices) and stale_correction's buffer are
    parameter-shaped where they should be, so they convert like Adam's moments."""
    from optax.contrib import muon

    from fiddlejax import models

    opt = fj.stale_correction(muon(1e-2, muon_weight_dimension_numbers=models.REGISTRY[
        "gpt"].muon_dims))
    src, dst = trainer(2, 1, 2, opt=opt), trainer(8, 1, 1, zero=1, opt=opt)
    canonical = random_canonical(opt=opt)
    with ckpt.CheckpointManager(tmp_path, src) as m:
        assert m.save(3, src.from_canonical_state(canonical))
    with ckpt.CheckpointManager(tmp_path, dst) as m:
        assert_bitwise_equal(dst.to_canonical_state(m.restore()), canonical)


# -- mismatches and corruption -------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint (steps 1 and 2) of the small model, copied per test before damaging it."""
    d = tmp_path_factory.mktemp("saved")
    tr = trainer(1, 1, 1)
    with ckpt.CheckpointManager(d, tr) as m:
        m.save(1, tr.from_canonical_state(random_canonical(seed=1)))
        m.save(2, tr.from_canonical_state(random_canonical(seed=2)))
    return d


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_different_model_fails_naming_the_array(saved, tmp_path):
    wide = GPTConfig(**{**CFG.__dict__, "d_ff": 128})
    with (ckpt.CheckpointManager(_copy(saved, tmp_path / "c"), trainer(1, 1, 1, cfg=wide)) as m,
          pytest.raises(ValueError, match=r"checkpoint has params\.blocks\.w1 of shape "
                                          r"\(2, 32, 64\) but the model has \(2, 32, 128\)")):
        m.restore()


def test_different_optimizer_fails(saved, tmp_path):
    sgd = trainer(1, 1, 1, opt=optax.sgd(0.1, momentum=0.9))
    with (ckpt.CheckpointManager(_copy(saved, tmp_path / "c"), sgd) as m,
          pytest.raises(ValueError, match="different optimizer.*opt_state")):
        m.restore()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "metadata"])
def test_corrupted_checkpoint_fails_clearly_and_nothing_is_overwritten(saved, tmp_path, damage):
    d = _copy(saved, tmp_path / "c")
    data = sorted((d / "2" / "state").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
    big = data[-1]
    if damage == "flip":  # silent for the storage layer: caught by the fingerprints
        b = bytearray(big.read_bytes())
        b[len(b) // 2] ^= 0x5A
        big.write_bytes(bytes(b))
    elif damage == "truncate":
        big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    elif damage == "delete":
        big.unlink()
    else:
        (d / "2" / "meta" / "metadata").write_text('{"format": 1, "arr')
    before = dir_digest(d)
    m = ckpt.CheckpointManager(d, trainer(1, 1, 1))
    with pytest.raises(ValueError, match=r"checkpoint step 2 in .* (is corrupted|is truncated or "
                                         r"corrupted|is unreadable).*earlier step: fiddlejax "
                                         r"train \.\.\. resume=1 .*earlier steps: \[1\]$"):
        m.restore()
    assert dir_digest(d) == before  # nothing rewritten, nothing deleted
    assert_bitwise_equal(trainer(1, 1, 1).to_canonical_state(m.restore(1)),
                         random_canonical(seed=1))  # the earlier step still restores
    m.close()


# -- crashes during a save -------------------------------------------------------------------------
CRASH = """
import os, sys
import jax, optax
from flax import nnx
import orbax.checkpoint._src.path.atomicity as atomicity
import fiddlejax as fj
from fiddlejax import checkpoint as ckpt
from fiddlejax.models.gpt import GPT, GPTConfig

cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
mesh = fj.make_mesh(data=1, pipe=1, tensor=1, devices=jax.devices()[:1])
tr = fj.parallelize(GPT(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-2), fj.Plan(mesh=mesh))
state = tr.init()
m = ckpt.CheckpointManager(sys.argv[1], tr)
m.save(1, state)
m.wait()
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def die(self):  # the process dies with step 2's arrays written but not committed
    if self.get_final().name == "2":
        print("crashing", flush=True)
        os._exit(7)
    return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = die
m.save(2, state)
m.wait()
"""


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    d = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, str(script), str(d)], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).parents[1])
    assert r.returncode == 7 and "crashing" in r.stdout, r.stderr[-2000:]
    leftovers = [p.name for p in d.iterdir() if "tmp" in p.name]
    assert leftovers and all(n.startswith("2.") for n in leftovers)  # the half-written step 2
    tr = trainer(1, 1, 1)
    with ckpt.CheckpointManager(d, tr) as m:
        assert m.latest_step() == 1 and m.all_steps() == [1]
        state = m.restore()
    assert_bitwise_equal(tr.to_canonical_state(state), tr.to_canonical_state(tr.init()))
    assert not [p for p in d.iterdir() if "tmp" in p.name]  # cleaned up on open


def test_failed_background_write_is_reported_and_previous_kept(tmp_path, monkeypatch):
    tr = trainer(1, 1, 1)
    state = tr.from_canonical_state(random_canonical())
    m = ckpt.CheckpointManager(tmp_path, tr)
    m.save(1, state)
    m.wait()
    import orbax.checkpoint._src.path.atomicity as atomicity

    async def fail(self):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", fail)
    m.save(2, state)
    with pytest.raises(RuntimeError, match=r"saving checkpoint step 2 .* failed.*step 1\) is "
                                           "intact"):
        m.wait()
    monkeypatch.undo()
    assert m.latest_step() == 1
    assert_bitwise_equal(tr.to_canonical_state(m.restore()), random_canonical())
    m.close()


# -- preservation, CheckFreq, preemption -----------------------------------------------------------
def test_keeps_latest_and_best(tmp_path):
    tr = trainer(1, 1, 1)
    state = tr.from_canonical_state(random_canonical())
    losses = {1: 3.0, 2: 1.0, 3: 2.5, 4: 2.0, 5: 2.2}
    with ckpt.CheckpointManager(tmp_path, tr, max_to_keep=2, best_metric="val_loss",
                                keep_best=1, async_save=False) as m:
        for step, v in losses.items():
            m.save(step, state, metrics={"val_loss": v})
        assert m.all_steps() == [2, 4, 5]  # best (val_loss 1.0) + latest two
        assert not m.save(5, state, force=True)  # already there: nothing overwritten
        with pytest.raises(ValueError, match="not after the latest checkpoint step 5"):
            m.save(3, state, force=True)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 4, 5]


def test_every_saves_on_multiples_only(tmp_path):
    tr = trainer(1, 1, 1)
    state = tr.from_canonical_state(random_canonical())
    with ckpt.CheckpointManager(tmp_path, tr, every=3, max_to_keep=None) as m:
        saved = [s for s in range(1, 8) if m.save(s, state)]
        assert saved == [3, 6] and m.save(7, state, force=True)
        assert m.all_steps() == [3, 6, 7] and m.latest_step() == 7


def test_checkfreq_interval_formula():
    cf = ckpt.CheckFreq(overhead=0.035, warmup=3)
    assert cf.interval() is None
    cf.steps.extend([0.1, 0.1, 0.1])
    cf.snapshots.append(0.05)
    assert cf.interval() == 15  # ceil(0.05 / (0.035 * 0.1)): snapshot-bound
    cf.persists.append(2.0)
    assert cf.interval() == 21  # the persist must end before the next snapshot
    cf.interference.append(0.1)
    assert cf.interval() == 43  # ceil((0.05 + 0.1) / 0.0035)
    with pytest.raises(ValueError, match="checkfreq_overhead=1.5 must be a fraction"):
        ckpt.CheckFreq(overhead=1.5)


def test_checkfreq_picks_interval_from_measurements(tmp_path):
    import time

    tr = trainer(1, 1, 1)
    state = tr.from_canonical_state(random_canonical())
    with ckpt.CheckpointManager(tmp_path, tr, every="auto", checkfreq_overhead=0.5,
                                max_to_keep=None) as m:
        m.warm_up(state)
        saved = []
        for step in range(1, 41):
            time.sleep(0.02)  # "a training step"
            if m.save(step, state):
                saved.append(step)
        stats = m.stats()
    assert saved[0] == 4  # after 3 measured steps: a profiling save, then a measured one
    assert len(saved) >= 2 and stats["ckpt_every"] == m.checkfreq.interval() >= 1
    assert len(saved) < 20  # spaced out by the measured costs, not every step
    assert 0 < stats["ckpt_overhead"] < 1 and stats["ckpt_snapshot_s"] > 0


def test_preemption_flag_from_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    p = ckpt.Preemption().install()
    try:
        assert not p.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.reached(2) and p.reached(2)
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGTERM) == previous


# -- fiddlejax train: refusing, resuming exactly after SIGKILL and SIGTERM -----------------------
def job_cfg(d: Path, **over) -> dict:
    from fiddlejax.app import config

    cfg = config.load(None, [f"checkpoint.dir={d}"])
    cfg.update(over)
    return cfg


def test_job_refuses_to_overwrite_and_to_resume_a_mismatch(saved, tmp_path):
    d = _copy(saved, tmp_path / "c")
    before = dir_digest(d)
    with pytest.raises(ValueError, match="already holds checkpoints .*latest step 2.*resume=auto"):
        job = job_ckpt.for_run(job_cfg(d), trainer(1, 1, 1), iter([]))
        try:
            job.start()
        finally:
            job.close()
    wide = trainer(1, 1, 1, cfg=GPTConfig(**{**CFG.__dict__, "d_ff": 128}))
    job = job_ckpt.for_run(job_cfg(d, resume="auto"), wide, iter([]))
    with pytest.raises(ValueError, match=r"params\.blocks\.w1 of shape \(2, 32, 64\)"):
        job.start()
    job.close()
    assert dir_digest(d) == before
    with pytest.raises(ValueError, match="resume='auto' needs checkpoint.dir"):
        cfg = job_cfg(d, resume="auto")
        cfg["checkpoint"]["dir"] = None
        job_ckpt.for_run(cfg, trainer(1, 1, 1), iter([]))


STEPS = 30
TINY = ["model.vocab_size=256", "model.seq_len=16", "model.d_model=32", "model.n_heads=4",
        "model.n_layers=2", "model.d_ff=64", "data.batch_size=8", "run.cpu_devices=2",
        "mesh.data=2", "mesh.pipe=1", "mesh.tensor=1", "plan.schedule=null",
        "plan.microbatches=1", "plan.virtual_stages=1", "train.eval_every=0",
        "train.eval_batches=0", "train.log_every=1", "run.progress=lines",
        "optimizer.warmup_steps=5", f"train.steps={STEPS}", "checkpoint.every=4"]


def train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fiddlejax.cli", "train", *TINY, f"run.dir={run_dir}",
            f"checkpoint.dir={run_dir / 'ckpt'}", *extra]


def run_until(cmd: list[str], step: int, sig: int) -> tuple[int, str]:
    """Start ``cmd``, send ``sig`` once it has logged ``step``, return (exit code, output)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith(f"step {step:5d} |"):
            p.send_signal(sig)
            break
    out += p.stdout.read()
    return p.wait(timeout=300), "".join(out)


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step, the last record winning (a resumed run repeats the steps after its save)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs}


def final_state(run_dir: Path):
    """The run's last checkpoint, restored through the CLI's own builders, canonical layout."""
    from fiddlejax.app import build, config

    cfg = config.load(None, TINY)
    mesh = fj.make_mesh(data=2, pipe=1, tensor=1, devices=jax.devices()[:2])
    tr = fj.parallelize(build.build_model(cfg["model"], 0), build.make_optimizer(cfg),
                        fj.Plan(mesh=mesh))
    with ckpt.CheckpointManager(run_dir / "ckpt", tr) as m:
        assert m.latest_step() == STEPS
        return tr.to_canonical_state(m.restore())


@pytest.mark.slow
def test_cli_resume_after_sigkill_and_sigterm_is_exact(tmp_path):
    """N steps straight == a run SIGKILLed, resumed, SIGTERMed (saves, exits 0), resumed to N."""
    straight = tmp_path / "straight"
    r = subprocess.run(train_cmd(straight), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    d = tmp_path / "interrupted"
    code, out = run_until(train_cmd(d), 10, signal.SIGKILL)
    assert code == -signal.SIGKILL, out[-3000:]
    killed_at = max(losses(d))
    assert killed_at < STEPS, "the run finished before the kill; test inconclusive"

    code, out = run_until(train_cmd(d, "resume=auto"), 20, signal.SIGTERM)
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    stopped = max(losses(d))
    assert killed_at < stopped < STEPS and f"preempted: saved step {stopped}" in out

    r = subprocess.run(train_cmd(d, "resume=auto"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"at step {stopped}" in r.stdout  # SIGTERM's checkpoint is the one resumed from
    assert losses(d) == losses(straight)  # every step, bitwise-equal float losses
    assert_bitwise_equal(final_state(d), final_state(straight))


def test_cli_rollback_sigint_nan_and_unusable_dirs(tmp_path):
    """`resume=N` to an earlier step continues exactly (newer steps moved to rolled_back/, an
    empty stray step directory removed, metrics.jsonl with each step once); Ctrl-C saves like
    SIGTERM; a NaN loss stops the run before it is saved, with exit 1 and the last good step."""
    short = ["train.steps=8"]
    a = tmp_path / "a"
    r = subprocess.run(train_cmd(a, *short), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = losses(a)
    (a / "ckpt" / "12").mkdir()  # a stray empty numbered directory must not block a resume
    r = subprocess.run(train_cmd(a, *short, "resume=4"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "an empty step directory, not a checkpoint" in r.stdout
    assert "rolled back: steps [8] moved to" in r.stdout and "config changed" not in r.stdout
    assert [p.name for p in (a / "ckpt" / job_ckpt.ROLLED_BACK).iterdir()][0]
    steps = [json.loads(x)["step"] for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # re-run steps replace their records
    assert losses(a) == want  # exact continuation from step 4

    b = tmp_path / "b"
    code, out = run_until(train_cmd(b), 2, signal.SIGINT)
    assert code == 0 and "preempted: saved step" in out, out[-3000:]

    c = tmp_path / "c"
    r = subprocess.run(train_cmd(c, *short, "optimizer.lr=1e30", "optimizer.warmup_steps=0",
                                 "checkpoint.every=1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    line = r.stderr.strip()
    assert line.count("\n") == 0 and "Traceback" not in line, line
    bad = int(line.split("step ")[1].split(":")[0])
    assert f"the loss is nan; stopped before saving it; the last checkpoint is step {bad - 1}" \
        in line and f"resume={bad - 1}" in line
    with ckpt.CheckpointManager(c / "ckpt", trainer(1, 1, 1)) as m:
        assert m.latest_step() == bad - 1  # the NaN state was never written


def test_unusable_checkpoint_dir_is_refused_before_the_first_step(tmp_path, capsys):
    from fiddlejax.app import train as run

    f = tmp_path / "file"
    f.write_text("x")
    base = ["run.cpu_devices=0", f"run.dir={tmp_path / 'run'}"]
    assert run.main(None, base + [f"checkpoint.dir={f}"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.dir={f} cannot be used: {f} is a regular file" in err
    assert err.count("\n") == 1
    assert run.main(None, base + [f"checkpoint.dir={f}/sub"]) == 2
    assert "is a regular file" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere; benchmarks/faults.py mounts a read-only disk
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        assert run.main(None, base + [f"checkpoint.dir={ro}"]) == 2
        assert f"checkpoint.dir={ro} is not writable" in capsys.readouterr().err


def test_resume_announces_config_changes():
    from fiddlejax.app import config

    said = job_ckpt.config_changes(
        config.load(None, ["train.steps=10"]),
        config.load(None, ["train.steps=20", "optimizer.lr=1e-3", "run.dir=elsewhere"]))
    assert any("train.steps 10 -> 20 (the learning-rate schedule" in s for s in said), said
    assert any("optimizer.lr 0.003 -> 0.001" in s for s in said), said
    assert not any("run.dir" in s for s in said)


def test_corrupt_message_suggests_resume_and_skips_the_bad_step(saved, tmp_path):
    d = _copy(saved, tmp_path / "c")
    for step in (1, 2):
        (d / str(step) / "meta" / "metadata").write_text('{"format": 1, "arr')
    with ckpt.CheckpointManager(d, trainer(1, 1, 1)) as m:
        assert m.all_steps() == [1, 2]
        with pytest.raises(ValueError) as e:
            m.restore(2)
        assert str(e.value).endswith("restore an earlier step: fiddlejax train ... resume=1 "
                                     "(Python: restore(step=1)); earlier steps: [1]")
        with pytest.raises(ValueError, match="no earlier checkpoint is left in"):
            m.restore(1)


def test_warm_up_compiles_the_save_path_without_running_it(tmp_path, monkeypatch):
    """Running the conversion and fingerprints at start held a copy of the whole state beside
    the step (issue 45): warm_up only compiles them, and the first save still works."""
    tr = trainer(1, 1, 1)
    state = tr.from_canonical_state(random_canonical())
    with ckpt.CheckpointManager(tmp_path, tr) as m:
        ran = []
        real = canonical.Forwarding.__call__
        monkeypatch.setattr(canonical.Forwarding, "__call__",
                            lambda self, s: ran.append(1) or real(self, s))
        m.warm_up(state)
        assert not ran
        assert m.save(1, state, force=True)
        assert ran
