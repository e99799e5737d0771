"""``fiddlejax plan predict --model <checkpoint>``: the planner's model from a Hugging Face
config.json (``fiddlejax/planner/hf_config.py``) is the preset built from the same shapes."""

import dataclasses
import json
from pathlib import Path

import pytest

from fiddlejax.planner import families, hf_config
from fiddlejax.planner.command import plan_command

# The published config.json shapes (the keys the planner reads, as the Hub spells them).
QWEN3_30B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
             "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
GPT_OSS_120B = {"model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
                "vocab_size": 201088, "sliding_window": 128, "max_position_embeddings": 131072,
                "tie_word_embeddings": False}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
               "num_attention_heads": 128, "vocab_size": 129280, "intermediate_size": 18432,
               "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
               "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "num_nextn_predict_layers": 1,
               "max_position_embeddings": 163840}
LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
             "vocab_size": 128256, "max_position_embeddings": 8192,
             "tie_word_embeddings": False}


@pytest.mark.parametrize("cfg,preset,seq", [(QWEN3_30B, "qwen3-30b-a3b", None),
                                            (GPT_OSS_120B, "gpt-oss-120b", None),
                                            (DEEPSEEK_V3, "deepseek-v3", None),
                                            (LLAMA3_8B, "llama3-8b", 8192)])
def test_config_gives_the_preset(cfg, preset, seq):
    """Every field (parameters, FLOPs, activations per policy) equals the preset's; the
    sequence defaults to max_position_embeddings up to 4,096."""
    want = families.preset(preset, seq=seq)
    got = hf_config.spec(cfg, seq=seq)
    assert dataclasses.replace(got, name=want.name) == want
    assert hf_config.spec(cfg).seq_len == 4096


# Parameters the planner leaves out, as the checkpoint holds them: Qwen2's q/k/v biases,
# Qwen3's q/k norms, Gemma 2/3's extra norms (vectors, under 2% of these tiny models).
UNCOUNTED = {"hf_qwen2": 192, "hf_qwen3": 32, "hf_qwen3_moe": 32, "hf_gemma2": 128,
             "hf_gemma3_text": 192}


@pytest.mark.parametrize("family", ["llama_tiny", "llama_tiny_llama3", "hf_mistral", "hf_qwen2",
                                    "hf_qwen3", "hf_gemma", "hf_gemma2", "hf_gemma3_text",
                                    "hf_phi3", "hf_mixtral", "hf_qwen3_moe", "hf_deepseek_v3",
                                    "hf_gpt_oss"])
def test_every_imported_family_counts_the_checkpoints_parameters(family):
    """The tiny checkpoints of tests/fixtures (every family models.from_pretrained imports):
    the planner's parameters are the tensors the checkpoint holds, less ``UNCOUNTED``;
    DeepSeek-V3's fixture, written by transformers, holds no MTP module (the planner counts
    one: fiddlejax trains it), so it is compared without."""
    import math

    from safetensors import safe_open

    d = Path(__file__).parent / "fixtures" / family
    cfg = json.loads((d / "config.json").read_text())
    held = 0
    for path in d.glob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            held += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    m = hf_config.load(d)
    assert m.seq_len == cfg["max_position_embeddings"] and m.name == family
    if family == "hf_deepseek_v3":
        assert m.params > held
        m = hf_config.spec({**cfg, "num_nextn_predict_layers": 0})
    assert m.params == held - UNCOUNTED.get(family, 0)


def test_unknown_family_and_missing_config_are_refused(tmp_path):
    with pytest.raises(ValueError, match="model_type 'bert'.*--model llama"):
        hf_config.spec({"model_type": "bert"})
    with pytest.raises(ValueError, match="no config.json there"):
        hf_config.read(tmp_path)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        hf_config.spec({**QWEN3_30B, "mlp_only_layers": [0]})


def test_plan_predict_reads_a_checkpoint_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B))
    assert plan_command(["predict", "--model", str(tmp_path), "--global-batch", "64",
                         "--expert", "8", "--remat", "full", "--dispatch", "dropless",
                         "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == tmp_path.name


def test_soft_capped_scores_run_xla_attention_with_two_more_float32_copies():
    """Gemma 2's attn_logit_softcapping: no fused kernel (refused by name, auto runs XLA's),
    and, without remat, the capped scores before and after the tanh kept per head (two
    float32 s x s arrays: ``saved_residuals`` of ``models.common.capped_attention``)."""
    import jax.numpy as jnp
    from jax._src.ad_checkpoint import saved_residuals

    from fiddlejax import planner
    from fiddlejax.models.common import capped_attention
    from fiddlejax.planner import attention

    cfg = json.loads((Path(__file__).parent / "fixtures/hf_gemma2/config.json").read_text())
    capped, plain = hf_config.spec(cfg), hf_config.spec({**cfg, "attn_logit_softcapping": None})
    square = capped.heads * capped.seq_len ** 2
    assert capped.softcap and not plain.softcap
    assert capped.act["none"][0] - plain.act["none"][0] == 2 * square
    assert capped.act["full"] == plain.act["full"]
    lo = planner.Layout(data=8, global_batch=8, precision="bf16-mixed")
    assert attention.kind(capped, lo) == "xla" and attention.kind(plain, lo) == "fused"
    with pytest.raises(ValueError, match="soft-capped scores have no fused kernel"):
        attention.check("fused", "bf16-mixed", capped, None)

    q = jnp.ones((1, 16, 4, 8), jnp.bfloat16)
    kv = jnp.ones((1, 16, 2, 8), jnp.bfloat16)

    def squares(cap):
        f = lambda q, k, v: capped_attention(  # noqa: E731
            q, k, v, causal=True, segment_ids=None, window=None, softcap=cap,
            scale=None).astype(jnp.float32).sum()
        return sorted(str(r[0].dtype) for r in saved_residuals(f, q, kv, kv)
                      if r[0].size == 4 * 16 * 16)

    more = list(squares(50.0))
    for d in squares(None):
        more.remove(d)
    assert more == ["float32", "float32"] == ["float32"] * attention.CAPPED_COPIES["none"]
