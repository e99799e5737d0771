"""The config schema: every bad value of `fiddlejax train` is one line naming the key, the value,
what is expected and a fix, with exit status 2 and no traceback (`--debug` shows it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fiddlejax import models
from fiddlejax.app import build, config, train

# (overrides, words the one-line error must hold). All fail before any device work.
BAD = [
    (["optimizer.lr=abc"], ["optimizer.lr='abc'", "a number > 0", "optimizer.lr=0.003"]),
    (["optimizer.lr=-1"], ["optimizer.lr=-1", "> 0"]),
    (["data.batch_size=-4"], ["data.batch_size=-4", "an integer >= 1"]),
    (["data.batch_size=0"], ["data.batch_size=0", "an integer >= 1"]),
    (["data.batch_size=1.5"], ["data.batch_size=1.5", "an integer"]),
    (["plan.microbatches=3"], ["data.batch_size=32", "mesh.data=2 x plan.microbatches=3 = 6",
                               "data.batch_size=30"]),
    (["train.steps=-5"], ["train.steps=-5", ">= 1"]),
    (["checkpoint.every=0"], ["checkpoint.every=0", "'auto'", "checkpoint.every=100"]),
    (["model.name=gtp"], ["model.name='gtp'", "did you mean model.name=gpt"]),
    (["plan.schedule=1fb1"], ["plan.schedule='1fb1'", "did you mean plan.schedule=1f1b"]),
    (["plan.remat=sometimes"], ["plan.remat='sometimes'", "'dots'"]),
    (["plan.grad_allreduce=carrier-pigeon"], ["plan.grad_allreduce='carrier-pigeon'", "'ring'"]),
    (["plan.shedule=1f1b"], ["unknown config key 'plan.shedule'", "did you mean 'plan.schedule'"]),
    (["mesh.pipe=1"], ["plan.schedule=interleaved-1f1b needs a pipeline", "plan.schedule=null"]),
    (["resume=abc"], ["resume='abc'", "resume=auto"]),
    (["resume=4", "checkpoint.dir=null"], ["resume=4 needs checkpoints", "checkpoint.dir=auto"]),
    (["resume=200"], ["resume=200 is after train.steps=150"]),  # checkpoint.dir=auto: resumable
    (["plan.memory_budget=lots"], ["plan.memory_budget='lots'", "2GiB"]),
    (["run.progress=fancy"], ["run.progress='fancy'", "'lines'"]),
    (["train"], ["override 'train' must look like key=value"]),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_is_one_line_naming_key_and_fix(overrides, words, capsys):
    assert train.main(None, overrides) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fiddlejax train: "), err
    for w in words:
        assert w in err, (w, err)


def test_config_file_errors_name_the_file(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert train.main(str(missing), []) == 2
    assert f"--config {missing} does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1\n")
    assert train.main(str(bad), []) == 2
    err = capsys.readouterr().err
    assert f"--config {bad} is not valid YAML" in err and "line 3" in err
    assert "<unicode string>" not in err
    bad.write_text("- 1\n- 2\n")
    assert train.main(str(bad), []) == 2
    assert "must hold a mapping" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  steps: 7\nmesh: {pipe: 1}\nplan: {schedule: null}\n")
    assert config.load(good, ["train.steps=9"])["train"]["steps"] == 9


def test_every_default_is_valid_and_every_spec_names_a_key():
    """The schema is the source of truth: its defaults pass their own specs, no spec is stale,
    and default.yaml is the schema's, every key with its meaning on the same line (the docs'
    reference is made from it)."""
    from importlib import resources

    from fiddlejax.app import schema

    keys = config.leaves(config.defaults())
    config.validate(config.defaults())
    assert set(config.SPECS) <= set(keys), set(config.SPECS) - set(keys)
    text = resources.files("fiddlejax").joinpath("configs/default.yaml").read_text()
    assert text == schema.default_yaml(), "stale: run python docs/hooks/build.py --write"
    assert yaml.safe_load(text) == config.defaults()
    leaf_lines = [x for x in text.splitlines() if x.strip() and not x.strip().startswith("#")
                  and not x.rstrip().endswith(":")]
    assert len(leaf_lines) == len(keys)
    assert not [x for x in leaf_lines if "#" not in x]


def test_a_key_is_declared_once_and_read_everywhere():
    """One declaration gives a key its default, its check, its fix and its Plan field: the
    schema's accepts and fix reach validate's error, typed() reads a loaded config into the
    sections, and every plan key named like a Plan field reaches the Plan unchanged."""
    import dataclasses

    import fiddlejax as fj
    from fiddlejax.app import schema

    with pytest.raises(config.ConfigError, match=r"train.dpo_beta=0 must be a number > 0"):
        config.load(None, ["train.dpo_beta=0"])
    with pytest.raises(config.ConfigError, match="CheckFreq picks it"):  # the declared fix
        config.load(None, ["checkpoint.every=0"])
    cfg = config.load(None, ["train.steps=7", "checkpoint.async=false", "plan.lora.rank=4"])
    job = schema.typed(cfg)
    assert (job.train.steps, job.checkpoint.async_, job.plan.lora) == (7, False, {"rank": 4})
    assert isinstance(job.plan, schema.PlanSection) and job.resume is None
    assert config.MAPPINGS == ("plan.rules", "plan.lora")
    fresh = config.defaults()
    fresh["train"]["steps"] = -1  # a caller's copy: the next job's defaults are untouched
    assert config.defaults()["train"]["steps"] == 150
    cfg = config.load(None, ["mesh.pipe=1", "mesh.data=4", "plan.schedule=null",
                             "plan.microbatches=2",
                             "plan.partition=params", "plan.sequence_parallel=true",
                             "plan.topk_on=updates", "plan.check_inputs=true"])
    plan = build.make_plan(cfg)
    same = {f.name for f in dataclasses.fields(fj.Plan)} & {
        f.name for f in dataclasses.fields(schema.PlanSection)}
    assert {"microbatches", "partition", "sequence_parallel", "check_inputs"} <= same
    for name in same - {"zero", "virtual_stages", "encodings", "memory_budget",
                        "compute_dtype", "rules"}:  # converted by make_plan, tested apart
        assert getattr(plan, name) == cfg["plan"][name], name


def test_names_come_from_their_modules():
    """Schedule kinds come from the schedule registry: a registered kind is accepted."""
    from fiddlejax.pipeline import schedules

    assert config.specs()["plan.schedule"].choices == tuple(schedules.kinds())
    ok = config.load(None, ["plan.schedule=zb-h1", "plan.remat=dots", "plan.grad_allreduce=ring"])
    assert ok["plan"]["schedule"] == "zb-h1"


def test_zero_auto_is_fsdp_over_context_replicas_without_a_pipeline():
    """plan.zero=auto (the default): 3 when sequences are split over context and no pipeline
    runs (context replicas would each hold whole weights and AdamW moments), else 0; a
    number is kept as given."""
    flat = ["mesh.pipe=1", "plan.schedule=null", "mesh.tensor=1"]
    assert config.load(None, [])["plan"]["zero"] == "auto"
    assert build.make_plan(config.load(None, [*flat, "mesh.data=2", "mesh.context=4"])).zero == 3
    assert build.make_plan(config.load(None, [*flat, "mesh.data=8"])).zero == 0
    assert build.make_plan(config.load(None, ["mesh.context=2", "mesh.data=1"])).zero == 0
    assert build.make_plan(config.load(None, [*flat, "mesh.data=2", "mesh.context=4",
                                             "plan.zero=1"])).zero == 1
    with pytest.raises(config.ConfigError, match=r"plan.zero.*0, 1, 2, 3 or 'auto'"):
        config.load(None, ["plan.zero=4"])


def test_null_schedule_ignores_the_default_virtual_stages():
    """The README's `mesh.pipe=1 plan.schedule=null mesh.data=4` must build a plan."""
    cfg = config.load(None, ["mesh.pipe=1", "plan.schedule=null", "mesh.data=4"])
    plan = build.make_plan(cfg)
    assert (plan.schedule, plan.virtual_stages) == (None, 1)
    assert build.make_plan(config.load(None, [])).virtual_stages == 2  # interleaved: 2 chunks
    assert build.make_plan(config.load(None, ["plan.schedule=1f1b"])).virtual_stages == 1


def test_remat_auto_takes_a_memory_budget():
    """plan.remat=auto was unusable from the CLI (no budget reached the Plan)."""
    base = ["plan.remat=auto", "plan.schedule=1f1b"]
    plan = build.make_plan(config.load(None, base + ["plan.memory_budget=64MiB"]))
    assert (plan.remat, plan.memory_budget) == ("auto", 64 << 20)
    assert config.parse_bytes("2GiB") == 2 << 30 and config.parse_bytes(1e9) == 10**9
    with pytest.raises(config.ConfigError, match="plan.remat=auto needs plan.memory_budget"):
        build.make_plan(config.load(None, base))  # CPU devices report no memory


def test_uniform_guess_is_the_models_own():
    """log(256) was printed for every model: the CNN has 10 classes, BERT 257 outputs."""
    import math

    for name, n in (("gpt", 256), ("bert", 257), ("cnn", 10)):
        cfg = config.load(None, [f"model.name={name}", "model.n_layers=1", "model.seq_len=16"])
        model = build.build_model(cfg["model"], 0)
        assert models.get(name).uniform_loss(model) == pytest.approx(math.log(n)), name


def test_debug_shows_the_traceback():
    cmd = [sys.executable, "-m", "fiddlejax.cli", "train", "data.batch_size=-4"]
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    assert quiet.stderr.strip().count("\n") == 0
    loud = subprocess.run(cmd[:3] + ["--debug"] + cmd[3:], capture_output=True, text=True,
                          timeout=120)
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "ConfigError" in loud.stderr


def test_resolved_config_round_trips(tmp_path):
    """The config.yaml a run writes loads back as a --config file unchanged."""
    cfg = config.load(None, ["mesh.pipe=1", "plan.schedule=null", "plan.memory_budget=1GiB",
                             "plan.rules={kv: tensor}"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert config.load(tmp_path / "config.yaml") == cfg


def test_model_names_are_the_registrys():
    """model.name accepts exactly the models the job can build (models.REGISTRY), and auto
    (gpt, or model.from_pretrained's family)."""
    assert set(config.specs()["model.name"].choices) == {"auto", *models.REGISTRY}


def test_precision_zero_and_rules_reach_the_plan():
    """plan.compute_dtype (auto: float32 on the CPU), plan.zero=3 and plan.rules reach
    fiddlejax.Plan; bad values fail in the config with the accepted ones."""
    base = ["mesh.pipe=1", "plan.schedule=null", "mesh.data=4"]
    plan = build.make_plan(config.load(None, base))
    assert (plan.compute_dtype, plan.zero, plan.rules) == ("float32", 0, ())  # auto on the CPU
    plan = build.make_plan(config.load(None, base + [
        "plan.compute_dtype=bfloat16", "plan.zero=3", "plan.rules={kv: tensor}",
        "plan.rules.fsdp=null", "plan.rules.wide=[data, tensor]"]))
    assert (plan.compute_dtype, plan.zero) == ("bfloat16", 3)
    assert dict(plan.rules) == {"kv": "tensor", "fsdp": None, "wide": ("data", "tensor")}
    for bad, words in (("plan.zero=4", "0, 1, 2, 3 or 'auto'"),
                       ("plan.compute_dtype=fp8", "'bfloat16'"),
                       ("plan.rules=tensor", "a mapping")):
        with pytest.raises(config.ConfigError, match=words):
            config.load(None, base + [bad])
    with pytest.raises(ValueError, match="names no mesh axis"):
        build.make_plan(config.load(None, base + ["plan.rules={kv: tensr}"]))


def test_default_yaml_lists_the_registrys_schedule_kinds():
    """default.yaml's comment on plan.schedule (the docs' config reference shows it) names
    every registered kind, so a new kind cannot be missing from the documented choices."""
    from importlib import resources

    from fiddlejax.pipeline import schedules

    text = resources.files("fiddlejax").joinpath("configs/default.yaml").read_text()
    line = next(x for x in text.splitlines() if x.strip().startswith("schedule:"))
    listed = [w.strip().split(" ")[0] for w in line.split("#", 1)[1].split("|")]
    assert sorted(listed) == sorted([*schedules.kinds(), "null"]), listed


def test_compile_cache_directory_follows_jax_then_the_default(monkeypatch, tmp_path):
    from fiddlejax.app import compile_cache

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compile_cache.directory("auto") == tmp_path / "jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert compile_cache.directory("auto") == Path("~/.cache/fiddlejax/xla").expanduser()
    assert compile_cache.directory(str(tmp_path / "mine")) == tmp_path / "mine"
    assert compile_cache.directory(None) is None
    cfg = config.load(None, ["run.compile_cache=null"])
    assert cfg["run"]["compile_cache"] is None
    with pytest.raises(config.ConfigError, match="run.compile_cache"):
        config.load(None, ["run.compile_cache="])
