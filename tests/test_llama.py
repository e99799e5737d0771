"""Llama: Hugging Face import/export against transformers' own logits (recorded fixtures, no torch),
every parallel layout against single-device float32, and the CLI's fine-tune and export."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads, reference_loss_and_grads, rel_err, tokens

import fiddlejax as fj
from fiddlejax.models.llama import Llama, LlamaConfig, parse_size, read_safetensors

FIXTURES = Path(__file__).parent / "fixtures"  # made by fixtures/make_llama_fixture.py
VARIANTS = ("llama_tiny", "llama_tiny_llama3")


@pytest.fixture(scope="module")
def imported():
    return Llama.from_pretrained(FIXTURES / "llama_tiny", seq_len=16)


def leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize("name", VARIANTS)
def test_import_matches_transformers_logits(name):
    """4 layers, GQA 4/2, head_dim 8 != hidden/heads, random RMSNorm weights, odd vocabulary;
    the second variant: tied head and Llama 3 RoPE scaling over all three frequency bands."""
    ref = np.load(FIXTURES / f"{name}.npz")
    model = Llama.from_pretrained(FIXTURES / name)
    logits = np.asarray(model(ref["tokens"]))
    assert logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) < 1e-4  # measured 4.3e-7 and 4.7e-7
    assert ref["logits"].std() > 0.5  # far from uniform: the comparison has teeth


@pytest.mark.parametrize("name", VARIANTS)
def test_export_round_trip_is_bit_exact(name, tmp_path):
    """import -> save_pretrained -> import gives the same bits; the written tensors, their names,
    the shard index and the config are transformers' own (the fixture transformers wrote)."""
    src = FIXTURES / name
    model = Llama.from_pretrained(src)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    theirs, ours = read_safetensors(src), read_safetensors(tmp_path)
    assert sorted(ours) == sorted(theirs)  # tied: no lm_head.weight, as transformers writes
    for k, v in ours.items():
        assert v.dtype == np.float32 and np.array_equal(v, theirs[k]), k
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(p.stat().st_size < 20_000 + 4_096 for p in tmp_path.glob("model-*.safetensors"))
    cfg_theirs = json.loads((src / "config.json").read_text())
    cfg_ours = json.loads((tmp_path / "config.json").read_text())
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "rope_parameters", "model_type",
              "architectures", "hidden_act"):
        assert cfg_ours[k] == cfg_theirs[k], k
    again = Llama.from_pretrained(tmp_path)
    assert again.config == model.config
    assert all(np.array_equal(a, b) for a, b in zip(leaves(again), leaves(model)))


def test_single_file_and_bfloat16_export(imported, tmp_path):
    imported.save_pretrained(tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json",
                                                                     "model.safetensors"]
    imported.save_pretrained(tmp_path / "bf16", dtype="bfloat16", max_shard_size=10**9)
    raw = read_safetensors(tmp_path / "bf16")
    assert {v.dtype for v in raw.values()} == {np.dtype(ml_dtypes.bfloat16)}
    back = Llama.from_pretrained(tmp_path / "bf16")  # bf16 checkpoints load as float32
    for a, b in zip(leaves(back), leaves(imported)):
        assert np.array_equal(a, b.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert parse_size("2GiB") == 2**31 and parse_size("20KB") == 20_000 and parse_size(7) == 7
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        parse_size("lots")
    with pytest.raises(ValueError, match="dtype='float16'"):
        imported.save_pretrained(tmp_path / "x", dtype="float16")


def plan(data, pipe, tensor, **kw):
    mesh = fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])
    return fj.Plan(mesh=mesh, **kw)


def check(model, p, batch):
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    trainer = fj.parallelize(model, optax.adamw(1e-3), p)
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    return trainer, state


def test_imported_model_on_222_1f1b_matches_single_device(imported):
    """data=2, pipe=2, tensor=2: heads, KV heads, MLP and the 97-word vocabulary (padded to 98)
    split over tensor, 4 layers on 2 stages; canonical parameters come back unpadded."""
    trainer, state = check(imported, plan(2, 2, 2, schedule="1f1b", microbatches=2),
                           tokens(0, 8, 16, 97))
    params = trainer.params(state)
    assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape,
                                                          nnx.state(imported, nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), leaves(imported)))


# Every schedule and every remat policy at least once, on the imported model.
LAYOUTS = [
    ("gpipe", (1, 2, 2), 2, 1, "full"),
    ("interleaved-1f1b", (2, 2, 1), 2, 2, "dots"),
    ("zb-h1", (1, 2, 2), 2, 1, "minimal"),
    ("2bw", (2, 2, 1), 2, 1, "dots_no_batch"),
    (None, (2, 1, 2), 1, 1, "offload"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,mesh,m,v,remat", LAYOUTS)
def test_schedules_and_remat_match_single_device(imported, kind, mesh, m, v, remat):
    p = plan(*mesh, schedule=kind, microbatches=m, virtual_stages=v, remat=remat)
    check(imported, p, tokens(1, 4 * mesh[0], 16, 97))


def test_tensor_axis_must_divide_heads_and_kv_heads():
    gqa = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                            seq_len=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_key_value_heads=1 on dimension 2, not divisible "
                                         r"by the tensor axis of size 2"):
        fj.parallelize(gqa, optax.sgd(0.1), plan(4, 1, 2))


@pytest.mark.parametrize("change,match", [
    ({"num_key_value_heads": 3}, "num_attention_heads=4 must be a multiple of "
                                 "num_key_value_heads=3"),
    ({"attention_bias": True}, "attention_bias=True; Llama supports only attention_bias=False"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "rope_scaling type 'yarn' is not supported"),
])
def test_config_json_errors(change, match):
    hf = json.loads((FIXTURES / "llama_tiny" / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_config({**hf, **change})


def test_legacy_transformers_4_config_keys():
    """transformers 4.x writes rope_theta and rope_scaling apart; both layouts give one config."""
    hf = json.loads((FIXTURES / "llama_tiny_llama3" / "config.json").read_text())
    rope = dict(hf.pop("rope_parameters"))
    legacy = {**hf, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    assert LlamaConfig.from_hf_config(legacy) == LlamaConfig.from_hf_config(
        json.loads((FIXTURES / "llama_tiny_llama3" / "config.json").read_text()))


def test_missing_and_unexpected_tensors(tmp_path):
    hf = json.loads((FIXTURES / "llama_tiny" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 5}))
    import shutil

    for f in (FIXTURES / "llama_tiny").glob("model*"):
        shutil.copy(f, tmp_path)
    with pytest.raises(ValueError, match="lacks 'model.layers.4.input_layernorm.weight'"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="tensors this Llama does not use: .*layers.3"):
        Llama.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        Llama.from_pretrained(tmp_path / "nowhere")


def test_cli_builds_llama_from_the_config():
    from fiddlejax.app import build, config

    cfg = config.load(None, ["model.name=llama", "model.n_kv_heads=1", "model.d_model=64",
                             "model.n_layers=1", "model.d_ff=32"])
    model = build.build_model(cfg["model"], 0)
    c = model.config
    assert (type(model), c.hidden_size, c.num_key_value_heads, c.num_attention_heads,
            c.vocab_size, c.seq_len) == (Llama, 64, 1, 4, 256, 128)
    with pytest.raises(ValueError, match="model.from_pretrained='x' needs model.name=llama"):
        build.build_model(config.load(None, ["model.name=gpt", "model.from_pretrained=x"]
                                      )["model"], 0)


def test_export_refuses_a_run_without_a_hugging_face_twin(tmp_path):
    from fiddlejax.app import config
    from fiddlejax.app.export import export

    (tmp_path / "config.yaml").write_text(json.dumps(config.load(None, ["model.name=bert"])))
    with pytest.raises(ValueError, match="model.name='bert', which has no Hugging Face twin"):
        export(tmp_path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="has no config.yaml"):
        export(tmp_path / "missing", tmp_path / "out")


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> tuple[Path, Path]:
    """``(src, run_dir)``: a Hugging Face directory and a two-step `fiddlejax train` run of it
    on the default (2, 2, 2) interleaved 1F1B layout, its checkpoint in ``run_dir/ckpt``."""
    tmp_path = tmp_path_factory.mktemp("fine_tuned")
    src = tmp_path / "src"
    cfg = LlamaConfig(vocab_size=256, hidden_size=24, intermediate_size=40, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    Llama(cfg, rngs=nnx.Rngs(3)).save_pretrained(src)
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "fiddlejax.cli", "train", "model.name=llama",
         f"model.from_pretrained={src}", "model.seq_len=16", "data.batch_size=8",
         "plan.microbatches=2", "train.steps=2", "train.eval_every=0", "train.eval_batches=0",
         "train.log_every=1", "run.progress=lines", "optimizer.warmup_steps=1",
         f"run.dir={run_dir}", f"checkpoint.dir={run_dir / 'ckpt'}"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return src, run_dir


def test_cli_fine_tunes_from_a_directory_and_exports(fine_tuned, tmp_path):
    """`fiddlejax train model.name=llama model.from_pretrained=DIR` on the default (2, 2, 2)
    interleaved 1F1B layout: the dims come from DIR's config.json (not the YAML's); then
    `fiddlejax export` writes the trained checkpoint as a Hugging Face directory."""
    src, run_dir = fine_tuned
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "fiddlejax.cli", "export", str(run_dir), str(out),
                        "--max-shard-size", "50KB"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported step 2" in r.stdout and (out / "model.safetensors.index.json").is_file()
    tuned, before = Llama.from_pretrained(out), Llama.from_pretrained(src)
    # hidden 24, not the YAML's d_model=128; the byte tokenizer's EOS (0) filled in
    assert dict(tuned.config.token_ids)["eos_token_id"] == 0
    assert dataclasses.replace(tuned.config, token_ids=before.config.token_ids) == before.config
    assert (out / "tokenizer.json").is_file()  # the job's tokenizer: bytes, byte-level
    change = rel_err(leaves(tuned), leaves(before))
    assert 1e-4 < change < 0.5  # trained two steps from the source weights, not from scratch


@pytest.mark.slow
def test_export_from_two_processes_writes_the_same_files(fine_tuned, tmp_path):
    """`fiddlejax export` under launch/local.py (2 processes x 2 devices, gloo) joins the job:
    each process restores its shards, process 0 writes, and the files equal one process's
    export byte for byte."""
    from test_distributed import LAUNCH, clean_env

    from fiddlejax.app.export import export

    _, run_dir = fine_tuned
    one, two = tmp_path / "one", tmp_path / "two"
    export(run_dir, one, max_shard_size="50KB")
    r = subprocess.run([sys.executable, str(LAUNCH), "--nproc", "2", "--devices-per-process",
                        "2", "--", sys.executable, "-m", "fiddlejax.cli", "export", str(run_dir),
                        str(two), "--max-shard-size", "50KB"],
                       env=clean_env(PYTHONPATH=":".join(sys.path)), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[0] exported step 2" in r.stdout and "[1] exported" not in r.stdout, r.stdout
    names = sorted(p.name for p in one.iterdir() if not p.name.startswith("."))  # the record
    assert names == sorted(p.name for p in two.iterdir() if not p.name.startswith("."))
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
