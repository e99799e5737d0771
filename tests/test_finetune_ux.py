"""Fine-tuning as users do it: the tokenizer travels with the model (export, save_pretrained,
generate), the default layout fits a shallow model, and the job explains itself (help, hints,
data and progress lines, learning rate and memory, whole-run summaries, no leftovers)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from flax import nnx

from fiddlejax.app import build, config, logs
from tests.fixtures import make_finetune_fixture as ft

FIXTURES = Path(__file__).parent / "fixtures"


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@pytest.mark.slow
def test_export_of_a_fine_tune_generates_what_transformers_generated(tmp_path):
    """`fiddlejax train model.from_pretrained=DIR` (its tokenizer found by data.tokenizer=auto),
    `fiddlejax export`, then fiddlejax's greedy continuation on the export equals what
    transformers' AutoTokenizer + AutoModelForCausalLM + generate gave on the same recipe
    (recorded offline by tests/fixtures/make_finetune_fixture.py), token for token."""
    recorded = json.loads(ft.RECORD.read_text())
    out = ft.fine_tune(tmp_path)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= files, files
    assert ft.ours(out) == {k: recorded[k] for k in ("prompt_ids", "continuation")}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == recorded["eos_token_id"] == 0
    # the Qwen3 source's own keys survive (transformers writes max_window_layers 28)
    assert cfg["max_window_layers"] == 28 and cfg["layer_types"] == ["full_attention"] * 2
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == _umask_mode()


def test_save_pretrained_writes_the_tokenizer_and_keeps_the_source_keys(tmp_path):
    from fiddlejax import models
    from fiddlejax.data import tokenizer

    model = models.from_pretrained(FIXTURES / "hf_qwen3_tok")
    model.save_pretrained(tmp_path / "a")
    tok = tokenizer.load(str(tmp_path / "a"))
    assert tok.eos_id == 0 and tok.vocab_size == 320 and "<|im_start|>" in tok.chat_template
    assert json.loads((tmp_path / "a" / "generation_config.json").read_text())[
        "eos_token_id"] == 0
    assert stat.S_IMODE((tmp_path / "a" / "model.safetensors").stat().st_mode) == _umask_mode()
    # a bf16 Qwen3 from transformers: max_window_layers 28 and layer_types kept, not 2 / dropped
    src = json.loads((FIXTURES / "hf_qwen3" / "config.json").read_text())
    models.from_pretrained(FIXTURES / "hf_qwen3").save_pretrained(tmp_path / "b")
    out = json.loads((tmp_path / "b" / "config.json").read_text())
    for key in ("max_window_layers", "layer_types", "initializer_range", "bos_token_id"):
        assert out[key] == src[key], key
    assert not (tmp_path / "b" / "tokenizer.json").exists()  # the source had none


def test_the_byte_tokenizer_exports_as_a_byte_level_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer

    from fiddlejax.data import tokenizer, tokenizer_files

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    ids = tokenizer_files.save(tmp_path, "bytes", 64)
    assert ids["eos_token_id"] == 0 and json.loads((tmp_path / "config.json").read_text())[
        "eos_token_id"] == 0
    text = "def f(x):\n    return 'héllo' \x00"
    theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert theirs.encode(text).ids == tokenizer.Tokenizer().encode(text).tolist()
    assert theirs.decode(theirs.encode(text).ids) == text
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["model_max_length"] == 64


def test_a_byte_tokenizer_for_a_larger_vocabulary_is_refused(tmp_path, capsys):
    """A from_pretrained directory without a tokenizer and a 300-id vocabulary: train and
    generate refuse bytes (naming data.tokenizer), unless data.tokenizer=bytes says so."""
    from fiddlejax.app import inference
    from fiddlejax.models.llama import Llama, LlamaConfig

    hf = tmp_path / "hf"
    Llama(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1), rngs=nnx.Rngs(0)
          ).save_pretrained(hf)
    cfg = config.load(None, [f"model.from_pretrained={hf}"])
    with pytest.raises(ValueError, match=r"has no tokenizer .* holds 300 ids.* data\.tokenizer="
                                         r"PATH .* or data\.tokenizer=bytes to use bytes anyway"):
        build.resolve_data(cfg)
    build.resolve_data(config.load(None, [f"model.from_pretrained={hf}", "data.tokenizer=bytes"]))
    assert inference.main("generate", [f"model.from_pretrained={hf}", "prompt=hi"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("overrides,picked", [
    (["model.n_layers=2"], {"plan.virtual_stages": 1, "plan.schedule": "1f1b"}),
    (["model.n_layers=1"], {"mesh.pipe": 1, "mesh.data": 4, "plan.schedule": None}),
    (["model.n_layers=2", "plan.schedule=interleaved-1f1b"],  # the user's kind, v automatic
     {"plan.virtual_stages": 1, "plan.schedule": "interleaved-1f1b"}),
    (["model.n_layers=3", "plan.schedule=zb-v"], None),  # explicit zb-v needs 2 chunks a stage
    (["model.n_layers=2", "plan.virtual_stages=2"], None),  # the user's own choice: refused
    (["model.n_layers=1", "mesh.pipe=2"], None),
    (["model.n_layers=4"], {}),  # fits as it is
])
def test_the_default_layout_fits_a_shallow_model(overrides, picked):
    cfg = config.load(None, ["model.seq_len=16", *overrides])
    note = build.fit_layout(cfg, build.explicit_keys(None, overrides))
    model = build.build_model(cfg["model"], 0)
    if picked is None:
        assert note is None
        with pytest.raises(config.ConfigError, match="cannot be split"):
            build.check_layout(cfg, model, build.make_plan(cfg))
        return
    assert (note is None) == (not picked)
    for key, value in picked.items():
        section, name = key.split(".")
        assert cfg[section][name] == value, key
    if picked:
        assert f"has {cfg['model']['n_layers']} layers, too few" in note and "instead" in note
    build.check_layout(cfg, model, build.make_plan(cfg))  # runs as picked
    assert logs.schedule_ran({"schedule": "interleaved-1f1b", "virtual_stages": 1}) == \
        "schedule=interleaved-1f1b x1 virtual stage"
    assert logs.schedule_ran({"schedule": None, "virtual_stages": None}) == \
        "schedule=null (no pipeline)"


def test_help_hints_and_the_seq_len_error(capsys):
    from fiddlejax import cli

    for command in ("eval", "generate"):
        assert cli.main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: fiddlejax {command} ") and "run.dir=DIR" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0 and "model.from_pretrained=DIR" in capsys.readouterr().out
    for typo in ("lerning_rate", "learning_rate"):
        with pytest.raises(config.ConfigError, match="did you mean 'optimizer.lr'"):
            config.load(None, [f"optimizer.{typo}=1e-4"])
    from fiddlejax import models

    hf = FIXTURES / "hf_qwen3"  # max_position_embeddings 64
    cfg = config.load(None, [f"model.from_pretrained={hf}"])
    with pytest.raises(config.ConfigError, match=r"model.seq_len=128 is beyond the 64 positions"
                                                 r" .* set model.seq_len=64 or less"):
        build.check_seq_len(cfg, models.from_pretrained(hf))


TINY = ["run.cpu_devices=0", "mesh.data=8", "mesh.pipe=1", "mesh.tensor=1",
        "plan.schedule=null", "plan.microbatches=1", "model.seq_len=16", "model.d_model=32",
        "model.n_layers=2", "model.d_ff=64", "data.batch_size=8", "train.eval_every=2",
        "train.eval_batches=1", "train.log_every=1", "run.progress=lines",
        "optimizer.warmup_steps=1"]


@pytest.mark.slow
def test_a_run_explains_itself_and_a_refused_one_leaves_nothing(tmp_path, capsys):
    from fiddlejax.app import train

    run = tmp_path / "run"
    assert train.main(None, [*TINY, "train.steps=2", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    for line in ("# data: the bundled stdlib corpus", "# building the model",
                 "# compiling step 1"):
        assert line in out, line
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["lr"] == 0.0 and recs[1]["lr"] == pytest.approx(3e-3)  # warm-up: 1 step
    assert all(r["peak_memory_bytes"] > 0 for r in recs)
    first = float(out.split("step 0: validation loss ")[1].split()[0])
    assert recs[0]["initial_val_loss"] == pytest.approx(first, abs=1e-4)

    # resumed to step 4: summary.json covers steps 1-4, from the first run's validation loss
    assert train.main(None, [*TINY, "train.steps=4", "resume=auto", f"run.dir={run}"]) == 0
    capsys.readouterr()
    summary = json.loads((run / "summary.json").read_text())
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and [r["step"] for r in recs] == [1, 2, 3, 4]
    assert summary["initial_val_loss"] == recs[0]["initial_val_loss"]
    assert summary["final_loss"] == recs[-1]["loss"]

    # refused before its first step: no run directory left behind, and an existing one's
    # config.yaml is what it was
    other = tmp_path / "other"
    ckpt = f"checkpoint.dir={run / 'checkpoints'}"  # holds checkpoints: a fresh run is refused
    assert train.main(None, [*TINY, "train.steps=2", f"run.dir={other}", ckpt]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert not other.exists()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert train.main(None, [*TINY, "train.steps=2", "model.d_model=64", f"run.dir={run}",
                             ckpt]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
