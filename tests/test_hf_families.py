"""Every Hugging Face decoder family through ``fiddlejax.models.from_pretrained``: logits against
transformers' own (recorded fixtures, no torch), bit-exact export round trips in the
checkpoint's dtype, training on (2, 2, 2) equal to one device, and the refusals."""

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, assert_loss_and_grads, reference_loss_and_grads, rel_err, tokens

import fiddlejax as fj
from fiddlejax import models
from fiddlejax.models.decoder import Decoder, DecoderConfig
from fiddlejax.models.hf import read_safetensors

FIXTURES = Path(__file__).parent / "fixtures"  # made by fixtures/make_hf_families.py
FAMILIES = ("mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "mixtral",
            "qwen3_moe")
CLASSES = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
           "gemma": "Gemma", "gemma2": "Gemma2", "gemma3_text": "Gemma3", "mixtral": "Mixtral",
           "qwen3_moe": "Qwen3Moe"}
# Each family's own feature switched off (qwen3: its q/k norm weights reset): it must matter.
FEATURES = {"mistral": {"sliding_window": None, "layer_types": None},
            "qwen2": {"sliding_window": None, "layer_types": None}, "qwen3": {},
            "phi3": {"sliding_window": None, "layer_types": None},
            "gemma": {"scale_embeddings": False}, "gemma2": {"attn_logit_softcapping": None},
            "gemma3_text": {"local_rope_theta": None}}
DENSE = FAMILIES[:7]  # the mixtures' logits: tests/test_hf_moe.py (with their router logits)


def load(family, **kw):
    return models.from_pretrained(FIXTURES / f"hf_{family}", **kw)


def leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize("family", DENSE)
def test_logits_match_transformers(family):
    ref = np.load(FIXTURES / f"hf_{family}.npz")
    model = load(family)
    assert type(model).__name__ == CLASSES[family] and isinstance(model, Decoder)
    logits = np.asarray(model(ref["tokens"]))
    assert rel_err(logits, ref["logits"]) < 1e-4  # measured 3.5e-7 .. 5.3e-7
    assert ref["logits"].std() > 0.5  # far from uniform: the comparison has teeth
    # The family's own feature (window, bias, qk-norm, soft-cap, ...) changes the logits.
    cfg = DecoderConfig(**{**vars(model.config), **FEATURES[family]})
    without = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0)))
    nnx.update(without, nnx.state(model, nnx.Param))
    if family == "qwen3":
        without.blocks.q_norm.weight[...] = np.ones_like(without.blocks.q_norm.weight[...])
    assert rel_err(np.asarray(without(ref["tokens"])), ref["logits"]) > 1e-3


def test_gemma2_final_softcap_and_sequence_length_is_the_datas():
    """Gemma 2's final soft-cap matters too; a 9-token batch trains on a 64-position model
    (batch_spec follows the data), and a 65-token one is refused by name."""
    model = load("gemma2")
    ref = np.load(FIXTURES / "hf_gemma2.npz")
    assert model.config.final_logit_softcapping == 3.0
    assert np.abs(np.asarray(model(ref["tokens"]))).max() < 3.0
    trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(
        data=1, pipe=1, tensor=1, devices=jax.devices()[:1])))
    loss, _ = trainer.loss_and_grads(trainer.init(), tokens(0, 2, 9, 83))
    assert np.isfinite(float(loss))
    with pytest.raises(ValueError, match="65 positions .* beyond max_position_embeddings=64"):
        trainer.loss_and_grads(trainer.init(), tokens(0, 2, 65, 83))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_bit_exact(family, tmp_path):
    """from_pretrained -> save_pretrained writes transformers' own tensor names, bits and dtype
    (qwen3 is a bf16 checkpoint: float32 masters in memory, bf16 written back)."""
    src = FIXTURES / f"hf_{family}"
    model = load(family)
    model.save_pretrained(tmp_path)
    theirs, ours = read_safetensors(src), read_safetensors(tmp_path)
    assert sorted(ours) == sorted(theirs)  # phi3: fused qkv_proj and gate_up_proj again
    bf16 = family == "qwen3"
    assert {v.dtype for v in leaves(model)} == {np.dtype(np.float32)}
    for k, v in ours.items():
        assert v.dtype == (ml_dtypes.bfloat16 if bf16 else np.float32), k
        assert np.array_equal(v, theirs[k]), k
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["torch_dtype"] == ("bfloat16" if bf16 else "float32")
    assert cfg["model_type"] == family
    again = models.from_pretrained(tmp_path)
    assert again.config == model.config and type(again) is type(model)
    assert all(np.array_equal(a, b) for a, b in zip(leaves(again), leaves(model)))


def plan(data, pipe, tensor, **kw):
    mesh = fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])
    return fj.Plan(mesh=mesh, **kw)


# Grouped to keep compiles few: window + soft-caps + pre/post norms + mixed layer types
# (gemma2), fused checkpoint tensors + uniform window (phi3), biases + windows on some layers
# (qwen2), qk-norm + two RoPE bases (gemma3_text).
@pytest.mark.parametrize("family", ("gemma2", "phi3", "qwen2", "gemma3_text"))
def test_222_training_matches_single_device(family):
    """data=2 x pipe=2 x tensor=2, 1F1B: heads, KV heads, MLP and the odd vocabulary split over
    tensor, layers over two stages (the layer counter travels with the activation)."""
    model = load(family, seq_len=12)
    vocab = model.config.vocab_size
    # Ids from 1: the fixtures' pad row 0 is all zeros, and a zero vector through RMSNorm
    # scales gradients by rsqrt(eps) = 1000 per norm (1e25 after Gemma 2's 16), which would
    # make the relative error measure that one row alone.
    batch = {"tokens": 1 + tokens(3, 8, 12, vocab - 1)["tokens"]}
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    trainer = fj.parallelize(model, optax.adamw(1e-3),
                             plan(2, 2, 2, schedule="1f1b", microbatches=2))
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))


def test_packed_documents_with_layer_types():
    """Packed rows (segment ids) and the layer index travel in one message: each document
    of a packed row gets the logits it gets alone (Gemma 2: windows, soft-caps)."""
    model = load("gemma2")
    ids = np.asarray(tokens(4, 1, 11, 83)["tokens"])[:, :12]
    seg = np.array([[1] * 7 + [2] * 5], np.int32)
    packed = np.asarray(model(ids, segment_ids=seg))
    alone = np.concatenate([np.asarray(model(ids[:, :7])), np.asarray(model(ids[:, 7:]))], 1)
    assert_close(packed, alone)


@pytest.mark.parametrize("change,match", [
    ({"model_type": "falcon"}, "model_type='falcon', which fiddlejax does not implement; "
                               "supported: llama, mistral, qwen2, qwen3, phi3, gemma"),
    ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping=30.0, which fiddlejax's mistral"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "rope_scaling type 'yarn' is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"sliding_window_pattern": 3}, "sliding_window_pattern=3, which fiddlejax's mistral"),
    ({"mystery_feature": True}, r"sets \['mystery_feature'\], which fiddlejax's mistral"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'; mistral supports only silu"),
    ({"attention_bias": True}, "attention_bias=True; mistral supports only"),
])
def test_unsupported_features_are_refused_by_name(change, match, tmp_path):
    for f in (FIXTURES / "hf_mistral").iterdir():
        shutil.copy(f, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(tmp_path)


def test_family_specific_refusals():
    gemma3 = json.loads((FIXTURES / "hf_gemma3_text" / "config.json").read_text())
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        Decoder.config_from_hf({**gemma3, "use_bidirectional_attention": True})
    phi3 = json.loads((FIXTURES / "hf_phi3" / "config.json").read_text())
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4}
    with pytest.raises(ValueError, match="longrope"):
        Decoder.config_from_hf({**phi3, "rope_parameters": longrope})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        Decoder.config_from_hf({**phi3, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="model_type='mistral'; Llama reads"):
        models.llama.Llama.from_pretrained(FIXTURES / "hf_mistral")


def test_cli_fine_tunes_any_family_without_model_name_and_exports(tmp_path):
    """`fiddlejax train model.from_pretrained=DIR` with no model.name (the family comes from
    config.json): a DeepSeek-V3 (latent attention, dense first layer, shared experts, grouped
    routing) on data=2 x expert=2 x tensor=2, 16-token sequences, with the loss-free balancing
    speed set by `model.bias_update_speed`; then `fiddlejax export` writes the run as a
    deepseek_v3 directory that reloads equal to the run's checkpoint, the router bias moved
    by the speed only (2 steps from 0: multiples of it, at most 2 of them). The job's path is
    the same for every family: Llama on the default (2, 2, 2) interleaved 1F1B in
    tests/test_llama.py; every other family ran this way by hand (see the commit that added
    this test)."""
    import subprocess
    import sys

    from fiddlejax.app import runs

    hf = json.loads((FIXTURES / "hf_deepseek_v3" / "config.json").read_text())
    cls = models.family_class("deepseek_v3")
    src = tmp_path / "src"  # the bundled byte corpus needs 256 ids
    cls(cls.config_from_hf({**hf, "vocab_size": 256}), rngs=nnx.Rngs(3)).save_pretrained(src)
    run_dir, speed = tmp_path / "run", 0.25
    r = subprocess.run(
        [sys.executable, "-m", "fiddlejax.cli", "train", f"model.from_pretrained={src}",
         f"model.bias_update_speed={speed}", "mesh.pipe=1", "plan.schedule=null",
         "mesh.expert=2", "plan.microbatches=1", "model.seq_len=16", "data.batch_size=8",
         "train.steps=2",
         "train.eval_every=0", "train.eval_batches=0", "train.log_every=1",
         "run.progress=lines", "optimizer.warmup_steps=1", f"run.dir={run_dir}",
         f"checkpoint.dir={run_dir / 'ckpt'}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "name: deepseek_v3" in (run_dir / "config.yaml").read_text()
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "fiddlejax.cli", "export", str(run_dir), str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    tuned, before = models.from_pretrained(out), models.from_pretrained(src)
    assert type(tuned).__name__ == "DeepseekV3" and tuned.config == before.config
    assert 1e-4 < rel_err(leaves(tuned), leaves(before)) < 0.5  # trained from the source
    _, run, step = runs.restore(run_dir)
    assert step == 2 and all(np.array_equal(a, b) for a, b in zip(leaves(tuned), leaves(run),
                                                                     strict=True))
    moves = np.asarray(tuned.blocks.moe.bias[...]) / speed  # from 0: two steps of +-speed
    assert np.array_equal(moves, np.round(moves)) and np.abs(moves).max() == 2


def test_auto_model_name_refuses_an_unknown_family(tmp_path):
    from fiddlejax.app import config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(config.ConfigError, match="model_type='falcon', which fiddlejax does "
                                                 "not implement; supported: llama, mistral"):
        config.load(None, [f"model.from_pretrained={tmp_path}"])
    with pytest.raises(config.ConfigError, match="has no config.json"):
        config.load(None, [f"model.from_pretrained={tmp_path / 'nowhere'}"])
    assert config.load(None, [])["model"]["name"] == "gpt"


def test_generation_with_a_kv_cache_matches_full_recompute():
    """Gemma 2 through the KV cache (windows of 5, soft-caps, alternating layer types) past its
    window: the same greedy tokens as re-running the whole sequence, and the cache's logits
    are the model's."""
    from fiddlejax.models import generate

    model = load("gemma2")
    ref = np.load(FIXTURES / "hf_gemma2.npz")
    prompt = ref["tokens"][:, :5]
    cached = models.generate_text(model, prompt, 9)
    assert np.array_equal(cached, models.generate_text(model, prompt, 9, use_cache=False))
    logits, cache = generate._forward(model, ref["tokens"][:, :9],
                                      generate.empty_cache(model, 2, 16), 0)
    step, _ = generate._forward(model, ref["tokens"][:, 9:16], cache, 9)
    full = np.concatenate([np.asarray(logits), np.asarray(step)], axis=1)
    assert rel_err(full, ref["logits"]) < 1e-4


def test_generation_without_a_kv_cache_runs_the_full_forward():
    """DeepSeek-V3's latent attention has no K/V cache here: generation re-runs the whole
    sequence per token, and its first greedy token is transformers' argmax."""
    model = load("deepseek_v3")
    ref = np.load(FIXTURES / "hf_deepseek_v3.npz")
    out = models.generate_text(model, ref["tokens"][:, :5], 3)
    assert out.shape == (2, 8) and np.array_equal(out[:, :5], ref["tokens"][:, :5])
    assert np.array_equal(out[:, 5], ref["logits"][:, 4].argmax(-1))


def test_dtype_asked_at_load():
    """dtype="bfloat16" keeps the weights in bf16 (no float32 masters); the logits stay close."""
    model = load("qwen3", dtype="bfloat16")
    assert {v.dtype for v in leaves(model)} == {np.dtype(ml_dtypes.bfloat16)}
    ref = np.load(FIXTURES / "hf_qwen3.npz")
    assert rel_err(np.asarray(model(ref["tokens"]), np.float32), ref["logits"]) < 3e-2
