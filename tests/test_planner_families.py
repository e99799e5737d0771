"""The planner's DeepSeek-V3 / Kimi K2 and GPT-OSS (planner/families.py) against the library's
own models: parameter counts of every preset equal the model's (abstract weights, nothing
allocated), per-sample forward matmul FLOPs of a tiny config of each family equal the ones its
program runs, and ``fiddlejax plan predict`` prices the presets with expert parallelism."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import reference_loss_fn
from test_hf_deepseek import K2, V3

from fiddlejax import planner
from fiddlejax.models import gpt_oss, moe
from fiddlejax.models.deepseek import DeepseekV3
from fiddlejax.models.deepseek_config import DeepseekV3Config
from fiddlejax.models.gpt_oss import GptOss
from fiddlejax.models.gpt_oss_config import GptOssConfig
from fiddlejax.planner import experts, families
from fiddlejax.planner.command import plan_command

OSS_20B = {"model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
           "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
           "num_key_value_heads": 8, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_local_experts": 32, "sliding_window": 128, "vocab_size": 201088,
           "tie_word_embeddings": False}
OSS_120B = {**OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}
EXPERT_LEAVES = {"w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"}


def library_counts(model_cls, hub: dict) -> tuple[int, int, int]:
    """(total, active, MTP) parameters of the library's model, abstract: every leaf, the
    routed experts' leaves ([.., E, ..]) counted k/E for the active figure."""
    cfg = model_cls.config_from_hf(hub)
    model = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
    total = active = mtp = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        keys = [getattr(p, "key", None) for p in path]
        n = math.prod(leaf.shape)
        total += n
        mtp += n if keys[0] == "mtp" else 0
        routed = "moe" in keys and EXPERT_LEAVES & set(keys)
        active += n * cfg.num_experts_per_tok // cfg.num_experts if routed else n
    return total, active, mtp


@pytest.mark.parametrize("name, cls, hub", [
    ("deepseek-v3", DeepseekV3, V3), ("kimi-k2", DeepseekV3, K2),
    ("gpt-oss-20b", GptOss, OSS_20B), ("gpt-oss-120b", GptOss, OSS_120B)])
def test_preset_parameters_equal_the_library_model(name, cls, hub):
    """Total and active parameters of each preset equal the library's own model read from the
    family's Hub config.json, to the parameter (DeepSeek-V3: 671.0B + 11.6B MTP)."""
    total, active, mtp = library_counts(cls, hub)
    m = planner.preset(name)
    assert m.params == total
    assert experts.active_params(m) == active
    outer_mtp = m.moe.outer_params(m.hidden) + sum(m.epilogue_params) - m.hidden * (m.vocab + 1)
    assert outer_mtp == mtp
    expected = {"deepseek-v3": (682.6, 11.6), "kimi-k2": (1026.4, 0.0),
                "gpt-oss-20b": (20.9, 0.0), "gpt-oss-120b": (116.8, 0.0)}[name]
    assert (round(total / 1e9, 1), round(mtp / 1e9, 1)) == expected


def dot_flops(jaxpr) -> float:
    """Matmul FLOPs of a jaxpr: ``dot_general`` (2 x output x contracted) and ``ragged_dot``
    (2 x rows x in x out: the real rows, whatever blocks a backend pads them to), inside
    every sub-jaxpr, a ``scan`` body times its length (XLA's compiled ``cost_analysis`` counts
    a loop body once)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)
        elif name.startswith("ragged_dot"):
            rows, k = eqn.invars[0].aval.shape
            total += 2.0 * rows * k * eqn.outvars[0].aval.shape[-1]
        times = eqn.params.get("length", 1) if name == "scan" else 1
        for p in eqn.params.values():
            for sub in (p if isinstance(p, tuple | list) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += times * dot_flops(inner)
                    if name == "cond":
                        break  # one branch runs (the layer kinds have the same matmuls)
    return total


S = 64
TINY_DS = DeepseekV3Config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
    qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, num_experts=8, n_group=1,
    topk_group=1, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
    first_k_dense_replace=1, num_nextn_predict_layers=1, seq_len=S)
TINY_OSS = GptOssConfig(
    vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
    num_experts_per_tok=2, sliding_window=S, seq_len=S)


@pytest.mark.parametrize("family", ["deepseek", "gpt-oss"])
def test_tiny_forward_flops_equal_the_program(family, monkeypatch):
    """Forward matmul FLOPs of one sample through the loss (traced on abstract weights; the
    MTP module and its logits included) equal the planner's, within 1e-9: the planner leaves
    out only elementwise work (norms, RoPE, softmax, SiLU, the sinks' logits, the biases'
    adds, top-k), which XLA's ``cost_analysis`` adds on top. The jaxpr is counted, not the
    compiled program: ``cost_analysis`` counts a loop body once (the layer scan, the experts'
    blocks). The experts run ``ragged_dot`` here, as on a GPU (the CPU's blocked matmul runs
    a loop of data-dependent length: tests/test_grouped.py counts its blocks).
    Windows: at ``sliding_window = seq`` no key is cut, so the bound is the square here (its
    effect is checked by hand below)."""
    for module in (moe, gpt_oss):  # the experts as ragged_dot, whatever the backend
        monkeypatch.setattr(module, "grouped_kind", lambda grouped: "ragged_dot")
    if family == "deepseek":
        c = TINY_DS
        model = nnx.eval_shape(lambda: DeepseekV3(c, rngs=nnx.Rngs(0)))
        spec = families.deepseek_v3(
            c.num_hidden_layers, c.hidden_size, c.num_attention_heads, S, c.vocab_size,
            ffn=c.intermediate_size, num_experts=c.num_experts, top_k=c.num_experts_per_tok,
            expert_ffn=c.moe_intermediate_size, shared=c.n_shared_experts,
            dense_layers=c.first_k_dense_replace, q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
            nope_dim=c.qk_nope_head_dim, v_dim=c.v_head_dim, mtp=c.num_nextn_predict_layers)
    else:
        c = TINY_OSS
        model = nnx.eval_shape(lambda: GptOss(c, rngs=nnx.Rngs(0)))
        spec = families.gpt_oss(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                c.num_key_value_heads, S, c.vocab_size,
                                num_experts=c.num_experts, top_k=c.num_experts_per_tok,
                                expert_ffn=c.intermediate_size, head_dim=c.head_dim,
                                window=c.sliding_window)
    loss, params = reference_loss_fn(model)
    batch = {"tokens": jnp.zeros((1, S + 1), jnp.int32)}
    measured = dot_flops(jax.make_jaxpr(loss)(params, batch).jaxpr)
    priced = (spec.num_layers * spec.layer_flops + spec.prologue_flops + spec.epilogue_flops)
    assert priced == pytest.approx(measured, rel=1e-9)


def test_windows_bound_attention_and_latent_widths_by_hand():
    """gpt-oss: half the layers (the first of each pair) see at most 128 keys; MLA's attention
    runs at the padded head width max(192, 128) = 192 (the library pads values to it)."""
    full = families.gpt_oss(24, 2880, 64, 8, 4096, 201088, num_experts=32, top_k=4,
                            expert_ffn=2880, window=None)
    win = families.gpt_oss(24, 2880, 64, 8, 4096, 201088, num_experts=32, top_k=4,
                           expert_ffn=2880)
    q, s = 64 * 64, 4096
    assert full.layer_flops - win.layer_flops == pytest.approx(4.0 * s * (s - 128) * q / 2)
    v3 = planner.preset("deepseek-v3")
    assert v3.attn_width == 128 * 192 and v3.heads == 128
    assert v3.moe.outer_layers == 1 and v3.num_layers == 58
    with pytest.raises(ValueError, match="dense_layers=61"):
        families.deepseek_v3(61, 7168, 128, 4096, 129280, ffn=18432, num_experts=256,
                             top_k=8, expert_ffn=2048, dense_layers=61)


def test_plan_predict_prices_deepseek_with_expert_parallelism(capsys):
    """DeepSeek-V3 (682.6B with MTP) on 512 H100s as pipe=8 x expert=64 (the MTP experts
    split like the stack's) fits 80 GB; ``--context 2`` splits each sequence and halves the
    stashed activations."""
    argv = ["predict", "--model", "deepseek-v3", "--cluster", "h100", "--nodes", "64",
            "--pipe", "8", "--expert", "64", "--context", "1", "--zero", "1",
            "--global-batch", "1024", "--remat", "full", "--dispatch", "dropless", "--json"]
    assert plan_command(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["model"] == "deepseek-v3" and one["fits"]
    assert (one["layout"]["expert"], one["layout"]["pipe"], one["layout"]["data"]) == (64, 8, 1)
    argv[argv.index("--expert") + 1] = "32"
    argv[argv.index("--context") + 1] = "2"
    assert plan_command(argv) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["layout"]["context"] == 2 and two["layout"]["expert"] == 32
    assert two["memory"]["activations"] == pytest.approx(one["memory"]["activations"] / 2)


def test_unknown_preset_lists_the_families():
    with pytest.raises(ValueError, match="gpt-oss-120b"):
        planner.preset("gpt-oss-7b")
    assert np.isin(["deepseek-v3", "kimi-k2", "gpt-oss-20b", "mixtral-8x7b", "llama3-8b"],
                   families.names()).all()
