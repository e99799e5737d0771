"""DeepSeek-V3 (``deepseek_v3``) through ``fiddlejax.models.from_pretrained``: logits and router
logits against transformers' (a recorded tiny fixture, no torch; see
fixtures/make_hf_families.py), each DeepSeek feature shown to matter, the bit-exact export round
trip, the refusals, and training on expert=2 x data=2 x tensor=2 and on data=2 x pipe=2 x tensor=2
(1F1B) equal to one device."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    assert_close,
    assert_exact_on_context_layouts,
    assert_loss_and_grads,
    reference_loss_and_grads,
    rel_err,
    tokens,
    with_config,
)

import fiddlejax as fj
from fiddlejax import models
from fiddlejax.models.deepseek import DeepseekV3
from fiddlejax.models.deepseek_config import DeepseekV3Config
from fiddlejax.models.hf import read_safetensors

FIXTURE = Path(__file__).parent / "fixtures" / "hf_deepseek_v3"


def load(**kw) -> DeepseekV3:
    return models.from_pretrained(FIXTURE, **kw)


def test_logits_and_router_logits_match_transformers():
    """Latent attention (low-rank queries, value width 5 != query/key width 14), YaRN with
    both mscale factors, grouped top-k steered by the selection bias, shared experts, scaled
    gates, one dense layer: logits and the MoE layers' router logits equal transformers'."""
    ref = np.load(FIXTURE.with_suffix(".npz"))
    model = load()
    assert type(model) is DeepseekV3 and model.config.first_k_dense_replace == 1
    logits, router = nnx.jit(lambda m, t: m(t, output_router_logits=True))(model, ref["tokens"])
    assert rel_err(np.asarray(logits), ref["logits"]) < 1e-5  # measured 6.0e-7
    assert rel_err(np.stack(router), ref["router_logits"]) < 1e-5  # measured 4.8e-7
    assert ref["logits"].std() > 0.5
    # Each feature matters: YaRN, the groups, the bias steering the choice, the scaling.
    run = nnx.jit(lambda m, t: m(t))  # one compile per variant, not op-by-op dispatch
    for change in ({"rope_scaling": None}, {"n_group": 1, "topk_group": 1},
                   {"routed_scaling_factor": 1.0}, {"rope_interleave": False}):
        assert rel_err(np.asarray(run(with_config(model, **change), ref["tokens"])),
                       ref["logits"]) > 1e-3, change
    unbiased = with_config(model)
    unbiased.blocks.moe.bias[...] = 0 * unbiased.blocks.moe.bias[...]
    assert rel_err(np.asarray(run(unbiased, ref["tokens"])), ref["logits"]) > 1e-3


# DeepSeek-V3's config.json as the Hub has it (less quantization_config: its FP8 weights are
# refused; dequantized copies drop the key), and Kimi K2's differences.
V3 = {"architectures": ["DeepseekV3ForCausalLM"], "aux_loss_alpha": 0.001, "bos_token_id": 0,
      "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
      "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
      "max_position_embeddings": 163840, "model_type": "deepseek_v3",
      "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
      "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
      "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
      "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                       "type": "yarn"},
      "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
      "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
      "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280}
K2 = {**V3, "n_group": 1, "topk_group": 1, "n_routed_experts": 384, "num_attention_heads": 64,
      "num_nextn_predict_layers": 0,
      "num_key_value_heads": 64, "first_k_dense_replace": 1, "routed_scaling_factor": 2.827,
      "vocab_size": 163840, "rope_theta": 50000.0, "max_position_embeddings": 131072,
      "rope_scaling": {**V3["rope_scaling"], "factor": 32.0}}


@pytest.mark.parametrize("hf, billions, mtp", [(V3, 671.0, 11.6), (K2, 1026.4, 0.0)])
def test_hub_configs_read_with_their_parameter_counts(hf, billions, mtp):
    """The released configs read (abstract weights): DeepSeek-V3's 671B plus its MTP module
    (11.6B of its own; the Hub's 14B count its copies of the embedding and head), Kimi K2's
    1.03T (no MTP)."""
    cfg = DeepseekV3.config_from_hf(hf)
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, rngs=nnx.Rngs(0)))
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    params = nnx.state(model, nnx.Param)
    own = count(params["mtp"]) if "mtp" in params else 0
    assert round((count(params) - own) / 1e9, 1) == billions
    assert round(own / 1e9, 1) == mtp


def test_export_round_trip_is_bit_exact(tmp_path):
    """save_pretrained writes transformers' names (dense and MoE layers, per-expert tensors,
    the selection bias, shared experts) and bits; the config reads back the same."""
    model = load()
    model.save_pretrained(tmp_path)
    theirs, ours = read_safetensors(FIXTURE), read_safetensors(tmp_path)
    assert sorted(ours) == sorted(theirs)
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["rope_parameters"]["rope_type"] == "yarn"
    again = models.from_pretrained(tmp_path)
    assert again.config == model.config


def test_queries_without_low_rank_round_trip(tmp_path):
    """``q_lora_rank`` None: one query projection (``q_proj``), written and read back."""
    cfg = DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=24,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                           qk_nope_head_dim=6, v_head_dim=8, num_experts=4, n_group=2,
                           topk_group=1, num_experts_per_tok=2, moe_intermediate_size=8,
                           seq_len=8)
    model = DeepseekV3(cfg, rngs=nnx.Rngs(0))
    model.save_pretrained(tmp_path)
    names = read_safetensors(tmp_path)
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert not any("q_a_proj" in k for k in names)
    again = models.from_pretrained(tmp_path)
    t = tokens(0, 2, 8, 32)["tokens"]
    run = nnx.jit(lambda m, t: m(t))
    assert np.array_equal(np.asarray(run(again, t)), np.asarray(run(model, t)))


@pytest.mark.parametrize("change, match", [
    ({"quantization_config": {"quant_method": "fp8"}}, "dequantize the FP8"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal"),
    ({"head_dim": 8}, "head_dim=8"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
    ({"n_group": 3}, "n_group=3"),
    ({"sliding_window": 4}, r"\['sliding_window'\]"),
])
def test_refusals_name_the_key(change, match, tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(tmp_path / "m", abstract=True)


@pytest.mark.slow  # two layouts of an 8-device mesh: the longest test here
def test_training_matches_one_device_on_expert_and_pipeline_layouts():
    """expert=2 x data=2 x tensor=2: the routed experts over ``expert``, heads (wq_b, wkv_b,
    wo), the dense and shared MLPs and every expert's matrices over ``tensor``; then
    data=2 x pipe=2 x tensor=2 with 1F1B (the dense layer in the first stage's prologue, the
    MoE layers over the stages). Loss and gradients (the router's; none for the selection
    bias) equal one device's, float32 rel < 1e-5 (measured: loss 2.1e-7, worst gradient
    leaf 1.7e-6 and 1.8e-6)."""
    model = load(seq_len=8)
    batch = {"tokens": 1 + tokens(5, 8, 8, model.config.vocab_size - 1)["tokens"]}
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    assert not np.any(np.asarray(ref_grads["blocks"]["moe"]["bias"][...]))
    trainer = fj.parallelize(model, optax.sgd(0.1),
                             fj.Plan(mesh=fj.make_mesh(data=2, expert=2, tensor=2)))
    state = trainer.init()
    spec = {jax.tree_util.keystr(p): v.sharding.spec
            for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
    assert spec["['blocks']['moe']['w_gate'].value"][1:] == ("expert", None, "tensor")
    assert spec["['blocks']['attn']['wkv_b'].value"][2] == "tensor"
    assert spec["['dense']['w1'].value"][2] == "tensor"
    assert_loss_and_grads(trainer.loss_and_grads(state, batch), (ref_loss, ref_grads))
    trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(
        mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule="1f1b", microbatches=2))
    assert_loss_and_grads(trainer.loss_and_grads(trainer.init(), batch), (ref_loss, ref_grads))


def reference_bias(model, batch, speed):
    """One step's loss-free update on one device, from transformers-style routing: each MoE
    layer's loads over the batch, ``bias + speed * sign(mean - load)``."""
    from fiddlejax.models.deepseek_moe import group_route

    _, router = nnx.jit(lambda m, t: m(t, output_router_logits=True))(
        model, batch["tokens"][:, :-1])
    bias = np.asarray(model.blocks.moe.bias[...])
    e = model.config.num_experts
    out = []
    for layer, logits in enumerate(router):
        experts = np.asarray(group_route(logits, bias[layer], model.config.moe)[1])
        loads = np.bincount(experts.reshape(-1), minlength=e)
        out.append(bias[layer] + speed * np.sign(loads.mean() - loads))
    return np.stack(out).astype(np.float32)


@pytest.mark.slow  # two 8-device layouts
def test_router_bias_moves_by_the_loads_not_the_optimizer():
    """Auxiliary-loss-free balancing: after one adamw step (weight decay on) the router bias
    equals the one-device update from the batch's loads, on data=2 x expert=2 x tensor=2 and
    data=2 x pipe=2 (1F1B, 2 microbatches); the optimizer moved every other weight."""
    speed = 0.01
    model = load(seq_len=8, overrides={"bias_update_speed": speed})
    assert model.blocks.moe.bias.get_metadata()["speed"] == speed
    batch = {"tokens": 1 + tokens(5, 8, 8, model.config.vocab_size - 1)["tokens"]}
    want = reference_bias(model, batch, speed)
    old = np.asarray(model.blocks.moe.bias[...])
    assert np.any(want != old)
    opt = optax.adamw(0.1, weight_decay=0.5)
    for plan in (fj.Plan(mesh=fj.make_mesh(data=2, expert=2, tensor=2)),
                 fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule="1f1b",
                         microbatches=2)):
        trainer = fj.parallelize(model, opt, plan)
        state, metrics = trainer.step(trainer.init(), batch)
        assert "router_loads" not in metrics
        params = trainer.params(state)
        got = np.asarray(params["blocks"]["moe"]["bias"][...])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
        assert rel_err(np.asarray(params["blocks"]["moe"]["router"][...]),
                       np.asarray(model.blocks.moe.router[...])) > 1e-3


def test_bias_moves_are_exact_signs():
    """``sign(mean - load)`` from integers: ties stay (0), a fractional mean breaks them."""
    from fiddlejax.parallel.balance import moves

    loads = np.array([[3, 3, 3, 3], [5, 3, 2, 2], [4, 3, 3, 3], [7, 0, 0, 1], [0, 0, 0, 0]],
                     np.int32)
    want = np.sign(loads.mean(-1, keepdims=True) - loads)
    np.testing.assert_array_equal(np.asarray(moves(jax.numpy.asarray(loads))), want)
    with pytest.raises(ValueError, match="no field"):
        load(abstract=True, overrides={"bias_speed": 0.1})
    with pytest.raises(ValueError, match="bias_update_speed"):
        load(abstract=True, overrides={"bias_update_speed": -1.0})


@pytest.mark.slow  # two 8-device layouts, several minutes on 2 cores
def test_training_matches_one_device_on_fsdp_sp_context_and_interleaved_layouts():
    """zero=3 + sequence parallelism + context=2 (the ring; latent attention's padded
    per-head K/V travel, the dense layer's attention in the prologue joins the shards too) on
    data=2 x context=2 x tensor=2; then interleaved 1F1B (2 virtual stages) on
    pipe=2 x context=2 x tensor=2 (the all-gathered K/V). The fixture's config with 5 layers
    (4 MoE layers: 2 per stage and chunk), random weights. Loss and gradients equal one
    device's, float32 rel < 1e-5 (measured: worst leaf 3.3e-7 and 4.0e-7)."""
    import dataclasses

    base = load(seq_len=8)
    cfg = dataclasses.replace(base.config, num_hidden_layers=5,
                              layer_types=("full_attention",) * 5)
    model = DeepseekV3(cfg, rngs=nnx.Rngs(1))
    batch = {"tokens": 1 + tokens(5, 8, 8, cfg.vocab_size - 1)["tokens"]}
    assert_exact_on_context_layouts(model, batch)


def test_lora_dropout_is_refused_by_name():
    """DeepSeek-V3's layers count only its MoE layers, so no per-layer dropout keys: LoRA
    dropout is refused before anything is traced, naming the key."""
    from fiddlejax.finetune import lora

    with pytest.raises(ValueError, match=r"DeepseekV3.*plan\.lora\.dropout=0"):
        lora.add(load(), lora.LoRA(rank=2, dropout=0.1))


def test_lora_adapts_the_latent_attention_and_the_dense_mlp():
    """LoRA names MLA's kernels (ours or Hugging Face's: q_a_proj ... kv_b_proj, o_proj) and
    the dense layers' MLP; on data=2 the adapters' gradients equal one device's and nothing
    flows into the base."""
    from fiddlejax.finetune import lora

    cfg = DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=24,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                           qk_nope_head_dim=6, v_head_dim=8, num_experts=4, n_group=2,
                           topk_group=1, num_experts_per_tok=2, moe_intermediate_size=8,
                           first_k_dense_replace=1, seq_len=8)
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "w1",
               "w3", "w2")
    model = lora.add(DeepseekV3(cfg, rngs=nnx.Rngs(0)), lora.LoRA(rank=2, targets=targets))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = {str(p[-1]) for p, _ in flat if str(p[-1]).endswith("_lora_b")}
    assert names == {f"{k}_lora_b" for k in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w1",
                                            "w3", "w2")}
    for path, var in flat:  # B not zero, so A's gradients are not
        if str(path[-1]).endswith("_lora_b"):
            var.set_value(0.05 * np.ones(var.shape, var.dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    batch = tokens(0, 4, 8, 32)
    ref_loss, ref = reference_loss_and_grads(model, batch)
    t = fj.parallelize(model, optax.adamw(1e-2), fj.Plan(
        mesh=fj.make_mesh(data=2, devices=jax.devices()[:2])))
    loss, grads = t.loss_and_grads(t.init(), batch)
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    only = lambda tree: {jax.tree_util.keystr(p): np.asarray(x)  # noqa: E731
                         for p, x in jax.tree_util.tree_leaves_with_path(tree)
                         if lora.is_adapter(p)}
    assert len(only(grads)) == 2 * (5 * 2 + 3)  # A and B: five in both layers, three dense
    assert_close(only(grads), only(ref))
    for p, g in jax.tree_util.tree_leaves_with_path(grads):
        assert bool(np.any(np.asarray(g))) == lora.is_adapter(p), jax.tree_util.keystr(p)
