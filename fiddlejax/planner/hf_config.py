"""A planner model from a Hugging Face ``config.json``: plan the model a user downloaded.

``fiddlejax plan predict --model path/to/checkpoint`` (the directory or its ``config.json``)
builds the planner's analytic model of the families ``models.from_pretrained`` imports: the
dense decoders (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3) as :func:`workload.llama`, Mixtral
and Qwen3-MoE as :func:`experts.moe_llama`, DeepSeek-V3 and GPT-OSS with their own builders
(``planner.families``). Shapes, and how attention runs: Gemma 2's soft-capped scores as XLA's
attention with the cap's float32 copies (``attention.capped``); sliding windows of the dense
families as full attention (an upper bound on their attention FLOPs), GPT-OSS's as it runs
them. The training sequence is ``seq``, else the config's ``max_position_embeddings`` up
to :data:`DEFAULT_SEQ` (a checkpoint's context window is rarely its training length).
"""

from __future__ import annotations

import json
from pathlib import Path

from fiddlejax.planner import attention, families
from fiddlejax.planner.experts import moe_llama
from fiddlejax.planner.workload import ModelSpec, llama

DEFAULT_SEQ = 4096
DENSE = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False, "phi3": False,
         "gemma": True, "gemma2": True, "gemma3_text": True}  # model_type: tied by default
MOE = ("mixtral", "qwen3_moe")
FAMILIES = (*DENSE, *MOE, "deepseek_v3", "gpt_oss")


def read(path: str | Path) -> dict:
    """The config of a checkpoint directory (its ``config.json``) or of a ``.json`` file."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"--model {path}: no config.json there; give a Hugging Face "
                         "checkpoint directory or its config.json, or a preset "
                         f"({', '.join(families.names())})")
    return json.loads(p.read_text())


def spec(cfg: dict, seq: int | None = None, name: str | None = None) -> ModelSpec:
    """The planner's model of the Hugging Face config ``cfg`` at sequence ``seq``."""
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"model_type {kind!r}: the planner reads {', '.join(FAMILIES)} "
                         "configs; describe other models with --model llama or gpt and "
                         "--layers/--hidden/--heads/--kv-heads/--ffn/--seq/--vocab")
    s = seq or min(cfg.get("max_position_embeddings") or DEFAULT_SEQ, DEFAULT_SEQ)
    layers, h, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    kv, vocab = cfg.get("num_key_value_heads") or heads, cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // heads
    tied = bool(cfg.get("tie_word_embeddings", DENSE.get(kind, False)))
    name = name or cfg.get("_name_or_path") or kind
    if kind in DENSE:
        dense = llama(layers, h, heads, kv, cfg["intermediate_size"], s, vocab,
                     head_dim=head_dim, tied=tied, name=name)
        return attention.capped(dense) if cfg.get("attn_logit_softcapping") else dense
    if kind in MOE:
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"{kind}: mlp_only_layers / decoder_sparse_step (dense layers "
                             "among the MoE ones) are not priced; the planner's MoE model "
                             "has every layer sparse")
        experts = cfg.get("num_local_experts") or cfg["num_experts"]
        ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        return moe_llama(layers, h, heads, kv, s, vocab, experts=experts,
                         top_k=cfg["num_experts_per_tok"], expert_ffn=ffn,
                         head_dim=head_dim, tied=tied, name=name)
    if kind == "gpt_oss":
        return families.gpt_oss(layers, h, heads, kv, s, vocab,
                                num_experts=cfg["num_local_experts"],
                                top_k=cfg["num_experts_per_tok"],
                                expert_ffn=cfg["intermediate_size"], head_dim=head_dim,
                                window=cfg.get("sliding_window"), tied=tied, name=name)
    return families.deepseek_v3(
        layers, h, heads, s, vocab, ffn=cfg["intermediate_size"],
        num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
        expert_ffn=cfg["moe_intermediate_size"], shared=cfg.get("n_shared_experts") or 0,
        dense_layers=cfg.get("first_k_dense_replace") or 0, q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"], rope_dim=cfg["qk_rope_head_dim"],
        nope_dim=cfg["qk_nope_head_dim"], v_dim=cfg["v_head_dim"],
        mtp=cfg.get("num_nextn_predict_layers") or 0, tied=tied, name=name)


def load(path: str | Path, seq: int | None = None) -> ModelSpec:
    """:func:`spec` of the config at ``path`` (named after its directory)."""
    p = Path(path)
    return spec(read(p), seq, name=(p if p.is_dir() else p.parent).name or None)


__all__ = ["DEFAULT_SEQ", "FAMILIES", "load", "read", "spec"]
