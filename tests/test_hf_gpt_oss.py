"""GPT-OSS (``gpt_oss``) through ``fiddlejax.models.from_pretrained``: logits, router logits and
the load-balancing loss against transformers' (a recorded tiny fixture, no torch; see
fixtures/make_hf_families.py), each GPT-OSS feature shown to matter, the bit-exact export round
trip, the refusals, and training on expert=2 x data=2 x tensor=2 and on data=2 x pipe=2 x
tensor=2 (1F1B) equal to one device."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    assert_exact_on_context_layouts,
    assert_loss_and_grads,
    reference_loss_and_grads,
    rel_err,
    tokens,
    with_config,
)

import fiddlejax as fj
from fiddlejax import models
from fiddlejax.models.common import scan_layers
from fiddlejax.models.gpt_oss import GptOss
from fiddlejax.models.gpt_oss_config import GptOssConfig
from fiddlejax.models.hf import read_safetensors

FIXTURE = Path(__file__).parent / "fixtures" / "hf_gpt_oss"


def load(**kw) -> GptOss:
    return models.from_pretrained(FIXTURE, **kw)


def test_logits_router_logits_and_aux_loss_match_transformers():
    """Sinks, windows of 4 on alternate layers, biases everywhere, YaRN (truncate false, its
    cos/sin factor), the router bias, top-2 softmax gates, the SwiGLU clamped at 1.0: logits,
    every layer's router logits and the load-balancing loss equal transformers'."""
    ref = np.load(FIXTURE.with_suffix(".npz"))
    model = load()
    c = model.config
    assert type(model) is GptOss and c.layer_types == ("sliding_attention", "full_attention") * 2
    assert (c.sliding_window, c.swiglu_limit, c.router_aux_loss_coef) == (4, 1.0, 0.02)
    batch = {"tokens": ref["tokens"][:1]}

    @nnx.jit
    def run(model, t, batch):
        outputs = model.head(scan_layers(model.blocks, model.prologue(batch)))
        return model(t, output_router_logits=True), model.router_losses(outputs, batch)

    (logits, router), per_seq = run(model, ref["tokens"], batch)
    assert rel_err(np.asarray(logits), ref["logits"]) < 1e-4  # measured 3.0e-7
    assert rel_err(np.stack(router), ref["router_logits"]) < 1e-4  # measured 2.6e-7
    chosen = lambda r: np.argsort(-np.asarray(r), -1)[..., :2]  # noqa: E731
    assert np.array_equal(chosen(np.stack(router)), chosen(ref["router_logits"]))
    assert abs(float(per_seq.aux[0]) / float(ref["aux_loss"]) - 1) < 1e-5
    assert ref["logits"].std() > 0.5
    # Each feature matters: the window, YaRN, the clamp, the sinks, the biases.
    logits_of = nnx.jit(lambda m, t: m(t))
    for change in ({"layer_types": ("full_attention",) * 4}, {"rope_scaling": None},
                   {"swiglu_limit": 7.0}):
        assert rel_err(np.asarray(logits_of(with_config(model, **change), ref["tokens"])),
                       ref["logits"]) > 1e-3, change
    for leaf in ("sinks", "bo", "moe.router_bias", "moe.b_gate", "moe.b_up", "moe.b_down"):
        other = with_config(model)
        *path, name = ("blocks." + leaf).split(".")
        owner = other
        for p in path:
            owner = getattr(owner, p)
        getattr(owner, name)[...] = 0 * getattr(owner, name)[...]
        assert rel_err(np.asarray(logits_of(other, ref["tokens"])), ref["logits"]) > 1e-3, leaf


def test_blocked_experts_equal_ragged_dot_with_their_biases():
    """Off GPU and TPU the experts run as blocks of one expert's rows (``grouped="blocked"``,
    what ``auto`` picks there: ``ragged_dot`` is a dense masked matmul over every expert on
    the CPU); its output and its gradients, biases included, equal ``ragged_dot``'s, padding
    rows and empty experts included."""
    import jax.numpy as jnp

    from fiddlejax.models import gpt_oss, moe

    keys = iter(jax.random.split(jax.random.key(0), 8))
    e, d, f, m = 5, 8, 6, 37
    ws = tuple(0.3 * jax.random.normal(next(keys), s) for s in
               ((e, d, f), (e, d, f), (e, f, d), (e, f), (e, f), (e, d)))
    xs = jax.random.normal(next(keys), (m, d))
    sizes = jnp.array([10, 0, 20, 7, 0], jnp.int32)
    assert moe.grouped_kind("auto") == "blocked"  # the CPU
    loss = {g: jax.value_and_grad(lambda xs, ws, g=g: jnp.sum(jnp.sin(gpt_oss.experts(
        xs, sizes, ws, 1.702, 7.0, g))), argnums=(0, 1)) for g in ("ragged_dot", "blocked")}
    (va, ga), (vb, gb) = (loss[g](xs, ws) for g in ("ragged_dot", "blocked"))
    np.testing.assert_allclose(vb, va, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_export_round_trip_is_bit_exact(tmp_path):
    """save_pretrained writes transformers' names (fused interleaved ``gate_up_proj`` and its
    bias, sinks, router bias) and bits (bf16, as read); the config reads back the same."""
    model = load()
    model.save_pretrained(tmp_path)
    theirs, ours = read_safetensors(FIXTURE), read_safetensors(tmp_path)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].dtype == theirs[k].dtype and np.array_equal(ours[k], theirs[k])
               for k in ours)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["rope_parameters"]["rope_type"] == "yarn"
    assert cfg["layer_types"] == list(model.config.layer_types)
    again = models.from_pretrained(tmp_path)
    assert again.config == model.config


def test_generation_with_a_kv_cache_matches_transformers():
    """Through the KV cache (sinks, output bias, windows of 4 past the window, the MoE): the
    cache's logits are transformers', and greedy tokens equal re-running the sequence."""
    from fiddlejax.models import generate

    model = load()
    ref = np.load(FIXTURE.with_suffix(".npz"))
    logits, cache = generate._forward(model, ref["tokens"][:, :9],
                                      generate.empty_cache(model, 2, 16), 0)
    step, _ = generate._forward(model, ref["tokens"][:, 9:16], cache, 9)
    full = np.concatenate([np.asarray(logits), np.asarray(step)], axis=1)
    assert rel_err(full, ref["logits"]) < 1e-4
    prompt = ref["tokens"][:, :5]
    cached = models.generate_text(model, prompt, 6)
    assert np.array_equal(cached, models.generate_text(model, prompt, 6, use_cache=False))


def test_mxfp4_experts_dequantize_at_load(tmp_path):
    """A checkpoint whose experts are MXFP4 (``*_blocks`` e2m1 codes, ``*_scales`` powers of
    two, as the Hub's): dequantized as read, bit-equal to transformers' own dequantization,
    logits and router logits equal transformers'; saved back dequantized (bf16, no
    quantization_config), it reloads the same."""
    path = FIXTURE.with_name("hf_gpt_oss_mxfp4")
    ref = np.load(path.with_suffix(".npz"))
    model = models.from_pretrained(path)
    gate_up = ref["model_layers_0_mlp_experts_gate_up_proj"]  # [E, d, 2f], gate even
    assert np.array_equal(np.asarray(model.blocks.moe.w_gate[...][0]), gate_up[..., ::2])
    assert np.array_equal(np.asarray(model.blocks.moe.w_up[...][0]), gate_up[..., 1::2])
    assert np.array_equal(np.asarray(model.blocks.moe.w_down[...][0]),
                          ref["model_layers_0_mlp_experts_down_proj"])
    run = nnx.jit(lambda m, t: m(t, output_router_logits=True))
    logits, router = run(model, ref["tokens"])
    assert rel_err(np.asarray(logits), ref["logits"]) < 1e-4  # measured 3.8e-7
    assert rel_err(np.stack(router), ref["router_logits"]) < 1e-4  # measured 2.5e-7
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    names = read_safetensors(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(k.endswith(("_blocks", "_scales")) for k in names)
    again = run(models.from_pretrained(tmp_path), ref["tokens"])[0]
    assert np.array_equal(np.asarray(again), np.asarray(logits))  # MXFP4 values are bf16's


def test_hub_config_reads_with_its_parameter_count():
    """gpt-oss-20b's config.json (its MXFP4 quantization_config included) reads: 20.9B."""
    hub = {"architectures": ["GptOssForCausalLM"], "attention_bias": True,
           "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
           "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "initializer_range": 0.02,
           "intermediate_size": 2880, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
           "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
           "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                            "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
           "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
           "vocab_size": 201088, "quantization_config": {
               "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                          "model.embed_tokens", "lm_head"],
               "quant_method": "mxfp4"}}
    cfg = GptOss.config_from_hf(hub)
    assert cfg.layer_types[:2] == ("sliding_attention", "full_attention")
    model = nnx.eval_shape(lambda: GptOss(cfg, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert round(n / 1e9, 1) == 20.9


@pytest.mark.parametrize("change, match", [
    ({"quantization_config": {"quant_method": "fp8"}}, "only MXFP4 experts"),
    ({"attention_bias": False}, "attention_bias=False"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"experts_per_token": 3}, "experts_per_token=3"),
    ({"qk_norm": True}, r"\['qk_norm'\]"),
])
def test_refusals_name_the_key(change, match, tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(tmp_path / "m", abstract=True)


def test_config_refusals():
    with pytest.raises(ValueError, match="dropless"):
        GptOssConfig(moe_dispatch="capacity", capacity_factor=1.25)
    with pytest.raises(ValueError, match="num_experts=0"):
        GptOssConfig(num_experts=0)


@pytest.mark.slow  # two layouts of an 8-device mesh: the longest test here
def test_training_matches_one_device_on_expert_and_pipeline_layouts():
    """expert=2 x data=2 x tensor=2: the experts (and their biases) over ``expert``, heads and
    their sinks and every expert's matrices over ``tensor``; then data=2 x pipe=2 x tensor=2
    with 1F1B (a sliding and a full layer per stage). Loss (with the router loss) and
    gradients equal one device's, float32 rel < 1e-5 (measured: worst leaf 6.5e-7 and 8.4e-7)."""
    model = load(seq_len=8)
    batch = {"tokens": 1 + tokens(5, 8, 8, model.config.vocab_size - 1)["tokens"]}
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    assert np.any(np.asarray(ref_grads["blocks"]["sinks"][...]))
    trainer = fj.parallelize(model, optax.sgd(0.1),
                             fj.Plan(mesh=fj.make_mesh(data=2, expert=2, tensor=2)))
    state = trainer.init()
    spec = {jax.tree_util.keystr(p): v.sharding.spec
            for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
    assert spec["['blocks']['moe']['w_gate'].value"][1:] == ("expert", None, "tensor")
    assert spec["['blocks']['moe']['b_gate'].value"][1:] == ("expert", "tensor")
    assert spec["['blocks']['sinks'].value"][1] == "tensor"
    assert_loss_and_grads(trainer.loss_and_grads(state, batch), (ref_loss, ref_grads))
    trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(
        mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule="1f1b", microbatches=2))
    assert_loss_and_grads(trainer.loss_and_grads(trainer.init(), batch), (ref_loss, ref_grads))


@pytest.mark.slow  # two 8-device layouts, several minutes on 2 cores
def test_training_matches_one_device_on_fsdp_sp_context_and_interleaved_layouts():
    """zero=3 + sequence parallelism + context=2 (the ring: the sinks join its softmax once,
    the windows of 4 mask by global places) on data=2 x context=2 x tensor=2; then
    interleaved 1F1B (2 virtual stages) on pipe=2 x context=2 x tensor=2 (the all-gathered
    K/V). Loss and gradients equal one device's, float32 rel < 1e-5 (measured: worst leaf
    1.1e-6 and 7.8e-7), the per-sequence router loss off (its pooling under context: below)."""
    model = load(seq_len=8, overrides={"router_aux_loss_coef": 0.0})
    batch = {"tokens": 1 + tokens(5, 8, 8, model.config.vocab_size - 1)["tokens"]}
    assert_exact_on_context_layouts(model, batch)


@pytest.mark.parametrize("fixture", ["hf_gpt_oss", "hf_mixtral"])
def test_context_pools_per_sequence_router_losses(fixture):
    """A context split cuts sequences into chunk rows; the per-sequence router loss
    (GPT-OSS's and Mixtral's ``router_aux_loss_coef``) pools each sequence's rows
    (``ops.context.sequences``), so loss and gradients on data=4 x context=2 equal one
    device's (float32, per leaf rel < 1e-5), the reported ``moe_aux_loss`` too."""
    model = models.from_pretrained(FIXTURE.with_name(fixture), seq_len=8)
    assert model.config.router_aux_loss_coef > 0
    batch = {"tokens": 1 + tokens(6, 4, 8, model.config.vocab_size - 1)["tokens"]}
    split = fj.parallelize(model, optax.sgd(0.1),
                           fj.Plan(mesh=fj.make_mesh(data=4, context=2)))
    assert_loss_and_grads(split.loss_and_grads(split.init(), batch),
                          reference_loss_and_grads(model, batch))
    one = fj.parallelize(model, optax.sgd(0.1),
                         fj.Plan(mesh=fj.make_mesh(data=1, devices=jax.devices()[:1])))
    want, got = (float(t.step(t.init(), batch)[1]["moe_aux_loss"]) for t in (one, split))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_context_refuses_router_losses_a_loss_cannot_join(monkeypatch):
    """A model whose loss takes no ``ops`` cannot pool a sequence's rows: its per-sequence
    router loss is refused by name under context; switched off, the layout is accepted."""
    from fiddlejax.parallel import context

    monkeypatch.setattr(context, "joins_sequences", lambda staged: False)
    path = FIXTURE.with_name("hf_mixtral")
    plan = fj.Plan(mesh=fj.make_mesh(data=4, context=2))
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.02.*takes no `ops`.*sequences="):
        fj.parallelize(models.from_pretrained(path, seq_len=8, abstract=True), optax.sgd(0.1),
                       plan)
    fj.parallelize(models.from_pretrained(path, seq_len=8, abstract=True,
                                          overrides={"router_aux_loss_coef": 0.0}),
                   optax.sgd(0.1), plan)
