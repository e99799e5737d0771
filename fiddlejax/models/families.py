"""Hugging Face ``config.json`` of each decoder family, read into :class:`.decoder.DecoderConfig`
fields and written back.

Every key a family's config may set is either implemented, checked against the one value
fiddlejax implements, or harmless metadata (token ids, dtype, versions); any other key is
refused by name, so nothing is silently ignored (a Mistral ``sliding_window`` read by a
Llama reader would otherwise change the model without a word). transformers 4.x
(``rope_theta`` + ``rope_scaling``, ``rope_local_base_freq``) and 5.x (``rope_parameters``,
per layer type for Gemma 3) layouts both read. Mixtral and Qwen3-MoE add the mixture of
experts' keys; Qwen3-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are
refused by name: every layer of the shared stack is the same MoE block.
"""

from __future__ import annotations

import json
from typing import Any

ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}
SUPPORTED = tuple(ARCHITECTURES)
GEMMAS = ("gemma", "gemma2", "gemma3_text")
MOES = ("mixtral", "qwen3_moe")
QWENS = ("qwen2", "qwen3", "qwen3_moe")  # use_sliding_window gates their sliding_window
# The mixtures of experts' keys (Hugging Face names), read by _experts.
MOE_KEYS = {"num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "router_aux_loss_coef", "router_z_loss_coef",
            "router_jitter_noise", "output_router_logits", "decoder_sparse_step",
            "mlp_only_layers"}

# Shapes and options every family reads (DecoderConfig's names).
DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings")
# Metadata: no effect on the function the model computes.
METADATA = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
            "use_cache", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
            "_name_or_path", "auto_map", "cache_implementation", "tokenizer_class",
            "return_dict", "output_attentions", "output_hidden_states", "id2label", "label2id",
            "pretraining_tp", "_attn_implementation_autoset", "is_decoder", "tie_encoder_decoder",
            "use_bidirectional_attention", "max_window_layers", "use_sliding_window",
            "original_max_position_embeddings", "layer_types", "sliding_window",
            "attention_bias", "mlp_bias", "hidden_act", "hidden_activation", "rope_theta",
            "rope_scaling", "rope_parameters", "rope_local_base_freq", "sliding_window_pattern",
            "_sliding_window_pattern",
            "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
            "attention_dropout", "resid_pdrop", "embd_pdrop", "partial_rotary_factor",
            "num_hidden_layers", *DIMS, *MOE_KEYS}
# Per family: keys that must hold the one value implemented (absent counts as that value).
NO_BIAS = {"attention_bias": False, "mlp_bias": False}
FIXED: dict[str, dict[str, Any]] = {
    "llama": NO_BIAS, "mistral": NO_BIAS, "qwen2": {"attention_bias": True, "mlp_bias": False},
    "qwen3": NO_BIAS, "phi3": {**NO_BIAS, "partial_rotary_factor": 1.0},
    "gemma": NO_BIAS, "gemma2": NO_BIAS, "gemma3_text": NO_BIAS,
    "mixtral": {**NO_BIAS, "router_jitter_noise": 0.0},
    "qwen3_moe": {**NO_BIAS, "decoder_sparse_step": 1},
}
# Keys only some families read: set (not null) in another family's config, they are refused.
OWN = {"rope_local_base_freq": ("gemma3_text",), "sliding_window_pattern": ("gemma3_text",),
       "_sliding_window_pattern": ("gemma3_text",), "use_sliding_window": QWENS,
       "max_window_layers": QWENS, "use_bidirectional_attention": (),
       "hidden_activation": GEMMAS, "router_jitter_noise": ("mixtral",),
       **dict.fromkeys(("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                        "mlp_only_layers"), ("qwen3_moe",)),
       **dict.fromkeys(("num_local_experts", "num_experts", "num_experts_per_tok",
                        "router_aux_loss_coef", "router_z_loss_coef", "output_router_logits"),
                       MOES)}
ZERO = ("attention_dropout", "resid_pdrop", "embd_pdrop")  # dropout: fiddlejax trains without


def refuse(key: str, value, family: str, fix: str = "") -> ValueError:
    return ValueError(f"config.json has {key}={value!r}, which fiddlejax's {family} does not "
                      f"implement{fix}")


def _rope(hf: dict, family: str, mpe: int) -> dict:
    """``rope_theta``, ``rope_scaling`` and (Gemma 3) ``local_rope_theta``."""
    params = hf.get("rope_parameters")
    if family == "gemma3_text":
        params = dict(params or {})
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if hf.get("rope_scaling"):
            full.update(hf["rope_scaling"])
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        if local.get("rope_type", "default") != "default" or set(local) - {"rope_type",
                                                                           "rope_theta"}:
            raise refuse("rope_parameters.sliding_attention", local, family,
                         " (the local layers' RoPE is plain, with its own base)")
        return {"rope_theta": float(full.pop("rope_theta")), "rope_scaling": full or None,
                "local_rope_theta": float(local["rope_theta"])}
    scaling = {("rope_type" if k == "type" else k): v
               for k, v in (hf.get("rope_scaling") or {}).items()}
    if params and any(params.get(k) != v for k, v in scaling.items()):
        raise ValueError(f"config.json has rope_parameters={params!r} and rope_scaling="
                         f"{hf['rope_scaling']!r}, which disagree (rope_parameters wins, the "
                         "scaling would be ignored); keep one: move the scaling into "
                         "rope_parameters, or remove rope_scaling")
    rope = dict(params or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse("partial_rotary_factor", rope.get("partial_rotary_factor",
                                                       hf.get("partial_rotary_factor")), family)
    rope.pop("partial_rotary_factor", None)
    if family == "phi3" and rope.get("rope_type", rope.get("type")) in ("longrope", "su",
                                                                         "yarn"):
        raise refuse("rope_scaling", rope, family, " (Phi-3's longrope: use a 4k checkpoint)")
    return {"rope_theta": float(theta), "rope_scaling": rope or None}


def _layers(hf: dict, family: str, n: int) -> dict:
    """``sliding_window`` and ``layer_types`` as transformers derives them per family."""
    window, types = hf.get("sliding_window"), hf.get("layer_types")
    if family in QWENS and not hf.get("use_sliding_window", False):
        window = None  # transformers ignores the window unless use_sliding_window
        types = None if types is None or "sliding_attention" not in types else types
        if types:
            raise refuse("layer_types", types, family, " with use_sliding_window=false")
    if family in ("llama", "gemma"):
        if window is not None or (types and "sliding_attention" in types):
            raise refuse("sliding_window", window, family)
        return {"sliding_window": None, "layer_types": None}
    if window is None:
        if types and "sliding_attention" in types:
            raise refuse("layer_types", types, family, " without a sliding_window")
        return {"sliding_window": None, "layer_types": None}
    if types is None:
        if family in ("qwen2", "qwen3"):
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        elif family == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        elif family == "gemma3_text":
            every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention"
                     for i in range(n)]
        else:  # mistral, phi3, mixtral, qwen3_moe (transformers 5): every layer
            types = ["sliding_attention"] * n
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def _experts(hf: dict, family: str) -> dict:
    """The mixture of experts' fields (:class:`~.decoder.DecoderConfig`'s names)."""
    if family not in MOES:
        return {}
    if hf.get("mlp_only_layers"):
        raise refuse("mlp_only_layers", hf["mlp_only_layers"], family,
                     " (dense layers among the MoE ones); use a checkpoint with every layer "
                     "an MoE (mlp_only_layers=[], decoder_sparse_step=1)")
    a, b = hf.get("num_local_experts"), hf.get("num_experts")
    if a is not None and b is not None and a != b:
        raise ValueError(f"config.json has num_local_experts={a!r} and num_experts={b!r}; "
                         "keep one of them")
    mixtral = family == "mixtral"
    return {"num_experts": a or b or (8 if mixtral else 128),
            "num_experts_per_tok": hf.get("num_experts_per_tok", 2 if mixtral else 8),
            "moe_intermediate_size": None if mixtral else hf.get("moe_intermediate_size", 768),
            "norm_topk_prob": True if mixtral else bool(hf.get("norm_topk_prob", False)),
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
            "router_z_loss_coef": float(hf.get("router_z_loss_coef") or 0.0)}


def read(hf: dict, seq_len: int | None = None, *, expect: str | None = None) -> dict:
    """:class:`~.decoder.DecoderConfig` fields of a ``config.json``; ``expect``: the one
    ``model_type`` the caller reads (a Llama class refuses a Mistral file)."""
    family = hf.get("model_type", "llama")
    if expect is not None and family != expect:
        raise ValueError(f"config.json has model_type={family!r}; {expect.capitalize()} reads "
                         f"model_type={expect!r} checkpoints (fiddlejax.models.from_pretrained "
                         f"reads any of {', '.join(SUPPORTED)})")
    if family not in SUPPORTED:
        raise ValueError(f"config.json has model_type={family!r}, which fiddlejax does not "
                         f"implement; supported: {', '.join(SUPPORTED)}")
    unknown = sorted(k for k in hf if k not in METADATA and not k.endswith("_token_id"))
    if unknown:
        raise ValueError(f"config.json sets {unknown}, which fiddlejax's {family} does not "
                         "implement; remove the keys if they are metadata")
    for key, owners in OWN.items():
        if hf.get(key) not in (None, False) and family not in owners:
            raise refuse(key, hf[key], family)
    for key, ok in FIXED[family].items():
        if hf.get(key, ok) != ok:
            what = "Llama" if family == "llama" else family
            raise ValueError(f"config.json has {key}={hf[key]!r}; {what} supports only "
                             f"{key}={ok!r}")
    for key in ZERO:
        if hf.get(key) not in (None, 0, 0.0):
            raise refuse(key, hf[key], family, " (fiddlejax's decoders train without dropout)")
    gemma = family in GEMMAS
    act = hf.get("hidden_activation") or hf.get("hidden_act") or (
        "gelu_pytorch_tanh" if gemma else "silu")
    if family == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # the legacy value of Gemma's releases, as transformers reads it
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"config.json has hidden_act={act!r}; {family} supports only "
                         f"{'gelu_pytorch_tanh' if gemma else 'silu'}")
    if family not in ("gemma2", "gemma3_text"):
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                raise refuse(key, hf[key], family)
    out = {k: hf[k] for k in DIMS if hf.get(k) is not None}
    defaults = {"gemma": 256, "gemma2": 256, "gemma3_text": 256, "qwen3": 128}
    out.setdefault("head_dim", defaults.get(family))
    out.setdefault("tie_word_embeddings", gemma)
    if "num_key_value_heads" not in out:
        out["num_key_value_heads"] = out.get("num_attention_heads", 32)
    mpe = out.setdefault("max_position_embeddings", 2048)
    out.update(_rope(hf, family, mpe))
    out.update(_layers(hf, family, out.get("num_hidden_layers", 32)))
    out.update(model_type=family, hidden_act=act, seq_len=seq_len or mpe,
               attention_bias=family == "qwen2",
               qk_norm=family in ("qwen3", "gemma3_text", "qwen3_moe"),
               norm_plus_one=gemma, sandwich_norms=family in ("gemma2", "gemma3_text"),
               scale_embeddings=gemma, checkpoint_dtype=_dtype(hf),
               token_ids=tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                      for k, v in hf.items() if k.endswith("_token_id"))),
               source_config=json.dumps(hf, sort_keys=True),
               **_experts(hf, family))
    if family in ("gemma2", "gemma3_text"):
        out["query_pre_attn_scalar"] = float(hf.get("query_pre_attn_scalar", 256))
        for key, default in (("attn_logit_softcapping", 50.0 if family == "gemma2" else None),
                             ("final_logit_softcapping", 30.0 if family == "gemma2" else None)):
            value = hf.get(key, default)
            out[key] = None if value is None else float(value)
    return out


def _dtype(hf: dict) -> str:
    """The checkpoint's dtype as ``save_pretrained`` writes it back."""
    d = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return d if d in ("float32", "bfloat16") else "float32"


# Keys of a source config.json that write() derives again but keeps as the source had them:
# neither changes the model once its layer_types are written (Qwen2/3 derive the windowed
# layers from max_window_layers only when layer_types is absent).
KEEP_SOURCE = ("max_window_layers", "layer_types", "initializer_range", "use_cache")
# Never carried: what the written file itself decides (its dtype, the writer's version).
NOT_CARRIED = ("torch_dtype", "dtype", "transformers_version", "_name_or_path")


def write(c: Any) -> dict:
    """A ``config.json`` for ``config`` that transformers' class of its family loads; a config
    read from a ``config.json`` keeps that file's metadata keys (see :func:`_carry`)."""
    own = getattr(c, "hf_dict", None)  # a family with its own config module (DeepSeek-V3)
    return _carry(own() if own else _write(c), c)


def _carry(out: dict, c: Any) -> dict:
    """The source ``config.json``'s keys that ``out`` lacks (every key :func:`read` accepted is
    metadata or implemented, so carrying it is safe), and :data:`KEEP_SOURCE` as they were."""
    src = json.loads(c.source_config) if getattr(c, "source_config", None) else {}
    if src.get("model_type", "llama") != c.model_type \
            or src.get("num_hidden_layers") != c.num_hidden_layers:
        return out  # another model: nothing of its file applies
    extra = {k: v for k, v in src.items() if k not in out and k not in NOT_CARRIED}
    keep = {k: src[k] for k in KEEP_SOURCE if k in src and k in out}
    merged = {**out, **extra, **keep}
    types = src.get("layer_types")
    if types is not None and merged.get("layer_types") is types \
            and tuple(types) != tuple(c.layer_types):  # the model's types changed: not these
        if "layer_types" in out:
            merged["layer_types"] = out["layer_types"]
        else:
            merged.pop("layer_types")
    return merged


def _write(c: Any) -> dict:
    family = c.model_type
    out = {"architectures": [ARCHITECTURES[family]], "model_type": family,
           "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
           "torch_dtype": c.checkpoint_dtype}
    for key in DIMS:
        out[key] = getattr(c, key)
    out.update({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
    out.update({k: list(v) if isinstance(v, tuple) else v for k, v in c.token_ids})
    scaling = None if c.rope_scaling is None else dict(c.rope_scaling)
    rope = {"rope_type": "default", **(scaling or {}), "rope_theta": c.rope_theta}
    if family in ("gemma2", "gemma3_text"):
        out["hidden_activation"] = c.hidden_act
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            out[key] = getattr(c, key)
        q = c.query_pre_attn_scalar
        out["query_pre_attn_scalar"] = int(q) if float(q).is_integer() else q  # an int field
    else:
        out["hidden_act"] = c.hidden_act
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if family in QWENS:
        out["use_sliding_window"] = c.sliding_window is not None
    if family in ("qwen2", "qwen3"):
        out["max_window_layers"] = c.num_hidden_layers
    if family in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    out.update(_write_experts(c))
    if family not in ("llama", "gemma"):
        out["sliding_window"] = c.sliding_window
    if c.sliding_window is not None and family not in ("mistral", "phi3", *MOES):
        out["layer_types"] = list(c.layer_types)
    if family == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": c.local_rope_theta}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        out["rope_theta"], out["rope_local_base_freq"] = c.rope_theta, c.local_rope_theta
        out["rope_scaling"] = scaling
        out.setdefault("layer_types", list(c.layer_types))
        return out
    out["rope_parameters"] = rope
    out["rope_theta"], out["rope_scaling"] = c.rope_theta, scaling
    if family == "phi3":
        out["partial_rotary_factor"] = 1.0
        out["original_max_position_embeddings"] = c.max_position_embeddings
    return out


def _write_experts(c: Any) -> dict:
    """The mixture of experts' keys of a ``config.json`` (none for a dense model)."""
    if c.model_type not in MOES:
        return {}
    out = {"num_experts_per_tok": c.num_experts_per_tok,
           "router_aux_loss_coef": c.router_aux_loss_coef, "output_router_logits": False}
    if c.router_z_loss_coef:
        out["router_z_loss_coef"] = c.router_z_loss_coef
    if c.model_type == "mixtral":
        if not c.norm_topk_prob:
            raise ValueError("norm_topk_prob=False: Mixtral always renormalises its top-k "
                             "gates; save this model as model_type='qwen3_moe'")
        return {**out, "num_local_experts": c.num_experts, "router_jitter_noise": 0.0}
    return {**out, "num_experts": c.num_experts, "norm_topk_prob": c.norm_topk_prob,
            "moe_intermediate_size": c.moe_intermediate_size or c.intermediate_size,
            "decoder_sparse_step": 1, "mlp_only_layers": []}
