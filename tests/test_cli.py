"""`fiddlejax train`: config handling, and a short real run that learns the stdlib corpus."""

import json
import math
import re
import subprocess
import sys

import pytest

from fiddlejax.app import config


def test_overrides_parse_and_unknown_keys_fail():
    cfg = config.load(None, ["mesh.data=2", "mesh.pipe=1", "plan.schedule=null",
                             "optimizer.lr=1e-3"])
    assert cfg["mesh"]["data"] == 2 and cfg["plan"]["schedule"] is None
    assert cfg["optimizer"]["lr"] == 1e-3
    with pytest.raises(ValueError, match="unknown config key 'plan.shedule'"):
        config.load(None, ["plan.shedule=1f1b"])
    with pytest.raises(ValueError, match="must look like key=value"):
        config.load(None, ["train.steps"])


def test_cli_rejects_unknown_key_before_compiling():  # and `python -m fiddlejax` runs the CLI
    r = subprocess.run([sys.executable, "-m", "fiddlejax", "train", "modle.name=gpt"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown config key 'modle'" in r.stderr


def test_cli_rejects_bad_layout(capsys):
    # in-process (what `fiddlejax train` runs): the worker's 8 devices are run.cpu_devices' 8
    from fiddlejax.app import train

    assert train.main(None, ["mesh.data=3", "data.batch_size=48"]) == 2
    assert ("mesh.data=3 x mesh.pipe=2 x mesh.tensor=2 = 12 devices, but this run has 8 "
            "devices") in capsys.readouterr().err  # default pipe=2, tensor=2


@pytest.mark.slow
def test_short_training_run_learns(tmp_path):
    """40 steps of a small GPT on the stdlib corpus beat the uniform guess by a wide margin.

    Four steps per jitted call (``train.steps_per_call``): every step is still logged.
    """
    r = subprocess.run(
        [sys.executable, "-m", "fiddlejax.cli", "train", "train.steps=40", "train.eval_every=40",
         "train.steps_per_call=4",
         "mesh.data=4", "mesh.pipe=1", "plan.schedule=null", "plan.virtual_stages=1",
         "plan.microbatches=1",
         "train.eval_batches=4", "model.seq_len=64", "model.n_layers=2", "data.batch_size=16",
         f"run.dir={tmp_path}", f"run.compile_cache={tmp_path / 'xla'}"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the compiled step is kept for the next start, and the job says where
    assert f"compile cache: {tmp_path / 'xla'}" in r.stdout
    assert any(p.name.startswith("jit__init_impl-") for p in (tmp_path / "xla").iterdir())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_val_loss"] < math.log(256) - 1.5  # 5.55 nats -> below 4.05
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 40 and {"loss", "tokens_per_s", "tflops_per_device"} <= set(lines[-1])
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_topk_keys_reach_the_plan():
    """plan.topk_density and plan.topk_on reach fiddlejax.Plan (no compile, no training)."""
    import fiddlejax as fj
    from fiddlejax.app import build

    base = ["mesh.data=8", "mesh.pipe=1", "mesh.tensor=1", "plan.schedule=null",
            "plan.virtual_stages=1"]
    plan = build.make_plan(config.load(None, base + ["plan.grad_allreduce=topk",
                                                   "plan.topk_on=updates",
                                                   "plan.topk_density=0.05"]))
    assert (plan.grad_allreduce, plan.topk_on, plan.topk_density) == ("topk", "updates", 0.05)
    default = build.make_plan(config.load(None, base))
    assert (default.topk_density, default.topk_on) == (fj.Plan.topk_density, fj.Plan.topk_on)
    with pytest.raises(ValueError, match="topk_on='weights' must be 'gradients' or 'updates'"):
        build.make_plan(config.load(None, base + ["plan.topk_on=weights"]))


def test_fsdp_gather_key_reaches_the_plan():
    """plan.fsdp_gather reaches fiddlejax.Plan; 'step' without zero=3 is refused, naming it."""
    from fiddlejax.app import build

    base = ["mesh.data=4", "mesh.pipe=2", "mesh.tensor=1", "plan.schedule=1f1b",
            "plan.virtual_stages=1"]
    plan = build.make_plan(config.load(None, base + ["plan.zero=3", "plan.fsdp_gather=step"]))
    assert (plan.zero, plan.fsdp_gather) == (3, "step")
    assert build.make_plan(config.load(None, base)).fsdp_gather == "layer"
    with pytest.raises(ValueError, match="fsdp_gather='step' .* set zero=3"):
        build.make_plan(config.load(None, base + ["plan.fsdp_gather=step"]))


def test_optimizer_keys_build_the_named_optimizer():
    """optimizer.name / muon_lr / nesterov / stale_correction reach the optax optimizer."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fiddlejax.app import build

    params = {"blocks": {"w1": jnp.zeros((2, 4, 3)), "b1": jnp.zeros((2, 3))},
              "wte": jnp.zeros((5, 4))}  # zeros: no weight decay in the updates
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)

    def first_update(*keys):
        opt = build.make_optimizer(config.load(None, ["optimizer.clip=0", *keys]))
        # warm-up starts at lr 0: take the second update
        state = opt.init(params)
        _, state = opt.update(grads, state, params)
        return opt.update(grads, state, params)[0]

    adamw = first_update()
    muon = first_update("optimizer.name=muon")
    # Muon moves each layer's [4, 3] matrix along its gradient's polar factor U V^T (the same
    # gradient twice: the momentum points along it too).
    for layer, g in zip(np.asarray(muon["blocks"]["w1"]), np.asarray(grads["blocks"]["w1"])):
        u, _, vt = np.linalg.svd(g, full_matrices=False)
        cos = -np.sum(layer * (u @ vt)) / (np.linalg.norm(layer) * np.linalg.norm(u @ vt))
        assert cos > 0.95, cos
    nadamw = first_update("optimizer.nesterov=true")
    assert not np.allclose(nadamw["wte"], adamw["wte"])
    np.testing.assert_allclose(muon["wte"], nadamw["wte"], rtol=1e-6)  # (N)AdamW off the blocks
    corrected = first_update("optimizer.stale_correction=1")
    assert not np.allclose(corrected["wte"], adamw["wte"])
    with pytest.raises(ValueError, match="optimizer.name='sgd' must be 'adamw' or 'muon'"):
        build.make_optimizer(config.load(None, ["optimizer.name=sgd"]))


def _bert_data(process_index: int = 0, process_count: int = 1):
    """The CLI's BERT (train, validation) iterators for a small model."""
    from fiddlejax.app import build

    cfg = config.load(None, ["model.name=bert", "model.seq_len=32", "model.n_layers=1"])
    model = build.build_model(cfg["model"], cfg["train"]["seed"])
    data = build.build_data(cfg, model, process_index, process_count)
    return data.train, data.validation


def test_bert_data_resumes_with_the_same_batches_and_masks():
    """The masked-LM stream is checkpointable: after set_state it continues exactly, masks too
    (a resumed BERT run used to restart its data and re-count its mask seeds)."""
    import numpy as np

    train, val = _bert_data()
    for _ in range(3):
        next(train)
    next(val)  # validation draws do not move the training masks
    state = train.get_state()
    want = [next(train) for _ in range(2)]
    again, _ = _bert_data()
    again.set_state(state)
    for w, g in zip(want, [next(again) for _ in range(2)], strict=True):
        assert sorted(w) == sorted(g) and all(np.array_equal(w[k], g[k]) for k in w)
    assert not np.array_equal(want[0]["weights"], want[1]["weights"])  # fresh masks per batch


def test_bert_masks_do_not_depend_on_the_process_count():
    import numpy as np

    whole = next(_bert_data()[0])
    halves = [next(_bert_data(i, 2)[0]) for i in range(2)]
    for k in whole:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), whole[k])


@pytest.mark.slow
def test_default_run_saves_checkpoints_in_its_run_dir(tmp_path, capsys):
    """checkpoint.dir=auto (the default): a plain run can be resumed; a fresh run in the same
    run directory moves the earlier run's checkpoints aside instead of refusing to start."""
    from fiddlejax.app import train as run

    run_dir = tmp_path / "run"
    tiny = ["run.cpu_devices=0", "mesh.data=8", "mesh.pipe=1", "mesh.tensor=1",
            "plan.schedule=null", "plan.virtual_stages=1", "plan.microbatches=1",
            "model.seq_len=16", "model.d_model=32", "model.n_layers=2", "model.d_ff=64",
            "data.batch_size=8", "train.eval_every=0", "train.eval_batches=0",
            "run.progress=lines", f"run.dir={run_dir}"]
    assert run.main(None, [*tiny, "train.steps=2"]) == 0
    ckpts = run_dir / "checkpoints"
    out = capsys.readouterr().out
    assert f"checkpoints: {ckpts} (checkpoint.dir=auto" in out
    assert "step 0: no validation (train.eval_batches=0)" in out and "nan" not in out
    assert "none (train.eval_batches=0)" in out
    assert (ckpts / "2").is_dir()  # the last step is always saved
    assert run.main(None, [*tiny, "train.steps=3", "resume=auto"]) == 0
    assert f"resumed from {ckpts} at step 2" in capsys.readouterr().out
    assert run.main(None, [*tiny, "train.steps=2"]) == 0  # fresh: the earlier run moves aside
    out = capsys.readouterr().out
    assert f"a fresh run in {run_dir} (resume=null" in out and "steps [2, 3] moved to" in out
    (moved,) = (ckpts / "rolled_back").iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["2", "3"]
    assert sorted(p.name for p in ckpts.iterdir() if p.name.isdigit()) == ["2"]
    assert not (tmp_path / "off").exists()
    assert run.main(None, [*tiny, "train.steps=1", f"run.dir={tmp_path / 'off'}",
                           "checkpoint.dir=null"]) == 0
    assert not (tmp_path / "off" / "checkpoints").exists()


def test_vocabulary_error_names_the_key_that_decides_it():
    """The stdlib corpus needs 256 ids. From scratch model.vocab_size decides; a pretrained
    Llama's vocabulary is its checkpoint's, so the hint must not send the user to
    model.vocab_size (which it ignores)."""
    from pathlib import Path

    from fiddlejax.app import build

    def data_error(*overrides):
        cfg = config.load(None, ["model.seq_len=16", *overrides])
        model = build.build_model(cfg["model"], 0)
        with pytest.raises(ValueError) as e:
            build.build_data(cfg, model)
        return str(e.value)

    fixture = Path(__file__).parent / "fixtures" / "llama_tiny"  # vocab_size 97
    err = data_error("model.name=llama", f"model.from_pretrained={fixture}")
    assert "the stdlib corpus holds token id" in err and "vocabulary is [0, 97)" in err
    assert f"comes from model.from_pretrained={fixture} (vocab_size=97 in its config.json; " \
           "model.vocab_size is not used)" in err
    assert re.search(r"fine-tune a checkpoint whose vocabulary holds at least \d+ ids, or train "
                     r"from scratch without model.from_pretrained", err)
    err = data_error("model.vocab_size=10", "model.n_layers=1")
    assert "vocabulary is [0, 10)" in err and "set model.vocab_size=" in err
    assert "from_pretrained" not in err


def test_cnn_run_reports_examples_per_second_and_accuracy(tmp_path, capsys):
    """An image classifier's job lines count examples, not tokens, and validation reports
    accuracy (also in metrics.jsonl and summary.json), on a pipeline layout."""
    from fiddlejax.app import train as run

    run_dir = tmp_path / "cnn"
    assert run.main(None, [
        "model.name=cnn", "model.channels=8", "model.n_layers=2", "run.cpu_devices=0",
        "mesh.data=4", "mesh.pipe=2", "mesh.tensor=1", "plan.schedule=1f1b",
        "plan.virtual_stages=1", "plan.microbatches=2", "data.batch_size=16",
        "train.steps=2", "train.eval_every=2", "train.eval_batches=2", "train.log_every=1",
        "run.progress=lines", "checkpoint.dir=null", f"run.dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"step 0: validation loss \d+\.\d+ \(uniform guess: 2\.3026\), "
                     r"accuracy \d+\.\d%", out), out
    step2 = next(x for x in out.splitlines() if x.startswith("step     2 |"))
    assert " ex/s | " in step2 and "tok/s" not in step2 and re.search(r"val acc \d+\.\d%", step2)
    rec = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert "examples_per_s" in rec and "tokens_per_s" not in rec
    assert 0 <= rec["val_accuracy"] <= 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_val_accuracy"] == rec["val_accuracy"]
    assert 0 <= summary["initial_val_accuracy"] <= 1 and "examples_per_s" in summary


def _layout_fixes(message: str) -> list[list[str]]:
    """The override sets an error's "set A (why), or B C (why), or D or more" offers."""
    offers = message.split("; set ", 1)[1].split(", or ")
    return [[w for w in re.sub(r"\([^)]*\)", "", offer).split() if "=" in w] for offer in offers]


@pytest.mark.parametrize("overrides,fixes", [
    (["model.n_layers=2"], 3), (["model.n_layers=1"], 2),
    (["model.n_layers=3", "plan.schedule=zb-v"], 3),
    (["model.n_layers=2", "mesh.data=1", "mesh.pipe=4", "plan.schedule=1f1b"], 2)])
def test_a_layout_that_does_not_fit_the_model_names_the_keys(overrides, fixes):
    """More pipeline chunks than layers fails before the trainer is built, in the job's own
    keys, and every fix it offers builds."""
    from fiddlejax.app import build

    cfg = config.load(None, ["model.seq_len=16", *overrides])
    model = build.build_model(cfg["model"], 0)
    with pytest.raises(config.ConfigError) as e:
        build.check_layout(cfg, model, build.make_plan(cfg))
    msg = str(e.value)
    layers = cfg["model"]["n_layers"]
    assert msg.startswith(f"model.n_layers={layers} cannot be split over mesh.pipe=")
    offers = _layout_fixes(msg)
    assert len(offers) == fixes, msg
    for fix in offers:
        fixed = config.load(None, ["model.seq_len=16", *overrides, *fix])
        build.check_layout(fixed, build.build_model(fixed["model"], 0), build.make_plan(fixed))


def test_a_pretrained_model_too_shallow_for_the_layout_names_its_checkpoint(tmp_path, capsys):
    """A 2-layer Hugging Face Llama on an interleaved layout the user asked for (pipe=2, 2
    virtual stages: 4 chunks): the error names the checkpoint's layer count and only layout
    keys (model.n_layers does not apply), as one line with exit status 2, before anything
    compiles. (Left to the defaults, the job fits the layout instead: test_finetune_ux.)"""
    from flax import nnx

    from fiddlejax.app import build
    from fiddlejax.app import train as run
    from fiddlejax.models.llama import Llama, LlamaConfig

    hf = tmp_path / "hf"
    Llama(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2),
          rngs=nnx.Rngs(0)).save_pretrained(hf)
    job = ["model.name=llama", f"model.from_pretrained={hf}", "model.seq_len=16"]
    assert run.main(None, [*job, "plan.virtual_stages=2", "run.cpu_devices=0",
                           f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (f"the model of model.from_pretrained={hf} has 2 layers (num_hidden_layers in its "
            "config.json), which cannot be split over mesh.pipe=2 x plan.virtual_stages=2 "
            "= 4 pipeline chunks") in err
    assert not (tmp_path / "run").exists()  # refused: nothing left behind
    assert "set plan.virtual_stages=1 (2 chunks), or mesh.pipe=1 mesh.data=4" in err
    assert "model.n_layers" not in err
    for fix in _layout_fixes(err.strip()):
        fixed = config.load(None, [*job, *fix])
        build.check_layout(fixed, build.build_model(fixed["model"], 0), build.make_plan(fixed))
