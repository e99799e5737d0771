"""DeepSeek-V3's configuration (``model_type: deepseek_v3``: DeepSeek-V3/R1, Kimi K2) and its
``config.json``, read and written.

:class:`DeepseekV3Config` is the shared :class:`~.decoder_config.DecoderConfig` plus multi-head
latent attention's ranks and head widths (:mod:`.mla`), DeepSeek's routing and shared experts
(:mod:`.deepseek_moe`) and ``first_k_dense_replace``, the dense layers below the MoE ones.
Every ``config.json`` key is implemented, checked against the one value implemented, or
metadata; any other is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, ClassVar

from . import families, mtp, rope
from .decoder_config import DecoderConfig
from .deepseek_moe import DeepseekMoEConfig

MODEL_TYPE = "deepseek_v3"
# config.json keys read into fields of the same name.
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
          "max_position_embeddings", "tie_word_embeddings", "num_experts_per_tok",
          "norm_topk_prob", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
          "qk_nope_head_dim", "v_head_dim", "n_shared_experts", "n_group", "topk_group",
          "routed_scaling_factor", "first_k_dense_replace", "rope_interleave",
          "num_nextn_predict_layers")
# Keys that must hold the one value implemented (absent counts as that value).
FIXED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
         "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
         "attention_dropout": 0.0, "pretraining_tp": 1}
# No effect on the function computed: training options transformers ignores (aux_loss_alpha,
# seq_aux, ep_size), derived widths (checked) and the usual metadata.
METADATA = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
            "use_cache", "initializer_range", "_name_or_path", "auto_map", "return_dict",
            "output_attentions", "output_hidden_states", "output_router_logits",
            "aux_loss_alpha", "seq_aux", "ep_size", "num_mtp_layers", "head_dim", "qk_head_dim",
            "rope_theta", "rope_scaling", "rope_parameters", "n_routed_experts",
            "num_local_experts", "id2label", "label2id", "tokenizer_class",
            "_attn_implementation_autoset"}
# transformers' DeepseekV3Config defaults, for keys a config.json leaves out.
HF_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "n_shared_experts": 1, "n_group": 8,
               "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True,
               "moe_intermediate_size": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(DecoderConfig):
    """:class:`~.decoder_config.DecoderConfig` with DeepSeek-V3's fields (transformers'
    names). ``head_dim`` is the rotary width ``qk_rope_head_dim`` (as transformers sets it);
    ``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``. ``q_lora_rank`` None: queries by one
    projection. The first ``first_k_dense_replace`` layers are dense SwiGLU MLPs
    ``intermediate_size`` wide; the others MoE layers (``num_experts`` routed experts
    ``moe_intermediate_size`` wide and ``n_shared_experts`` shared ones).
    ``num_nextn_predict_layers``: the multi-token-prediction depth ``D`` (:mod:`.mtp`; read
    from the checkpoint: 0 when it holds no MTP weights), its loss weighted by
    ``mtp_loss_weight`` (the paper's lambda: 0.3 early in pretraining, 0.1 after; 0.1 here)."""

    model_type: str = MODEL_TYPE
    num_key_value_heads: int = 4
    num_experts: int = 8
    moe_intermediate_size: int | None = 64
    router_aux_loss_coef: float = 0.0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    rope_interleave: bool = True
    bias_update_speed: float = 0.001  # loss-free balancing: the router bias' move per step
    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.1
    rope_types: ClassVar[tuple[str, ...]] = ("default", "llama3", "linear", "yarn")

    def __post_init__(self):
        me = type(self).__name__
        for f in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "first_k_dense_replace", "q_lora_rank"):
            v = getattr(self, f)
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            if not ok and not (f == "q_lora_rank" and v is None):
                raise ValueError(f"{me}.{f}={v!r} must be an int >= 0")
        mtp.check(self.num_nextn_predict_layers, self.mtp_loss_weight, me)
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
        super().__post_init__()
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"{me}.num_key_value_heads={self.num_key_value_heads} must equal "
                             f"num_attention_heads={self.num_attention_heads} (latent attention "
                             "expands keys and values per head)")
        if not self.num_experts:
            raise ValueError(f"{me}.num_experts=0: DeepSeek-V3 is a mixture of experts")
        if not 0 <= self.first_k_dense_replace < self.num_hidden_layers:
            raise ValueError(f"{me}.first_k_dense_replace={self.first_k_dense_replace} must be "
                             f"below num_hidden_layers={self.num_hidden_layers} (at least one "
                             "MoE layer)")
        if self.sliding_window is not None or self.qk_norm or self.attention_bias:
            raise ValueError(f"{me}: sliding windows, q/k norms and attention biases are not "
                             "part of DeepSeek-V3")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe(self) -> DeepseekMoEConfig:
        return DeepseekMoEConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size or self.intermediate_size,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob, dispatch=self.moe_dispatch,
            capacity_factor=self.capacity_factor, router_aux_loss_coef=self.router_aux_loss_coef,
            router_z_loss_coef=self.router_z_loss_coef, hidden_act=self.hidden_act,
            n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            n_shared_experts=self.n_shared_experts, bias_update_speed=self.bias_update_speed)

    def hf_stacks(self) -> list[tuple]:
        """The checkpoint's layers per stack of ours (:func:`.hf._stacks`): ``dense`` (the
        first ``first_k_dense_replace``), then ``blocks`` (the MoE layers)."""
        k, n = self.first_k_dense_replace, self.num_hidden_layers
        dense = [("dense", range(k), layer_rows(self, moe=False))] if k else []
        d = self.num_nextn_predict_layers
        mtp_rows = [(("block", *ours), theirs, tr, f)
                    for ours, theirs, tr, f in layer_rows(self, moe=True)] + MTP_ROWS
        return [*dense, ("blocks", range(k, n), layer_rows(self, moe=True)),
                *([("mtp", range(n, n + d), mtp_rows)] if d else [])]

    def hf_copies(self) -> list[tuple[str, tuple[str, ...], bool]]:
        """The Hub's copies of the shared embedding and head in each MTP layer: (name, our
        leaf, transposed); loaded as checked equal to ours, written back from ours."""
        n, d = self.num_hidden_layers, self.num_nextn_predict_layers
        head = ("embed",) if self.tie_word_embeddings else ("lm_head",)
        return [row for i in range(n, n + d)
                for row in ((f"model.layers.{i}.embed_tokens.weight", ("embed",), False),
                            (f"model.layers.{i}.shared_head.head.weight", head,
                             not self.tie_word_embeddings))]

    def hf_unused(self, name: str) -> bool:
        """A tensor of an MTP layer past our depth (``num_nextn_predict_layers`` lowered)."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= self.num_hidden_layers + \
            self.num_nextn_predict_layers

    def hf_dict(self) -> dict:
        """The ``config.json`` transformers' ``DeepseekV3ForCausalLM`` reads."""
        scaling = rope.scaling_dict(self.rope_scaling)
        out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": MODEL_TYPE,
               "hidden_act": self.hidden_act, "attention_bias": False,
               "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
               "torch_dtype": self.checkpoint_dtype, "n_routed_experts": self.num_experts,
               "rope_theta": self.rope_theta, "rope_scaling": scaling,
               "rope_parameters": {"rope_type": "default", **(scaling or {}),
                                   "rope_theta": self.rope_theta},
               "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        out.update({k: getattr(self, k) for k in FIELDS})
        if not self.num_nextn_predict_layers:  # none here: the source's value carries over
            out.pop("num_nextn_predict_layers")
        out.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.token_ids})
        return out


def read(hf: dict, seq_len: int | None = None) -> dict:
    """:class:`DeepseekV3Config` fields of a ``config.json``."""
    family = hf.get("model_type")
    if family != MODEL_TYPE:
        raise ValueError(f"config.json has model_type={family!r}; DeepseekV3 reads "
                         f"model_type={MODEL_TYPE!r} checkpoints")
    known = set(FIELDS) | set(FIXED) | METADATA
    unknown = sorted(k for k in hf if k not in known and not k.endswith("_token_id"))
    if unknown:
        fix = " (dequantize the FP8 weights first)" if "quantization_config" in unknown else ""
        raise ValueError(f"config.json sets {unknown}, which fiddlejax's {MODEL_TYPE} does not "
                         f"implement{fix}; remove the keys if they are metadata")
    for key, ok in FIXED.items():
        if hf.get(key) is not None and hf[key] != ok:
            raise families.refuse(key, hf[key], MODEL_TYPE, f"; it supports only {key}={ok!r}")
    out: dict[str, Any] = {k: hf.get(k, HF_DEFAULTS.get(k)) for k in FIELDS
                           if k in hf or k in HF_DEFAULTS}
    out["num_experts"] = hf.get("n_routed_experts", hf.get("num_local_experts", 256))
    out.setdefault("num_key_value_heads", out.get("num_attention_heads", 128))
    mpe = out.setdefault("max_position_embeddings", 4096)
    out.update(families._rope(hf, MODEL_TYPE, mpe))
    out.update(model_type=MODEL_TYPE, seq_len=seq_len or mpe,
               checkpoint_dtype=families._dtype(hf),
               token_ids=tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                      for k, v in hf.items() if k.endswith("_token_id"))),
               source_config=json.dumps(hf, sort_keys=True))
    config = DeepseekV3Config(**out)
    for key, ours in (("qk_head_dim", config.qk_head_dim), ("head_dim", config.head_dim)):
        if hf.get(key) not in (None, ours):
            raise ValueError(f"config.json has {key}={hf[key]!r}, but its widths give {ours} "
                             "(qk_nope_head_dim + qk_rope_head_dim; head_dim: qk_rope_head_dim)")
    return out


# An MTP layer's own tensors (the Hub's names), beside its block's (:func:`layer_rows`).
_ident = lambda w: w  # noqa: E731
MTP_ROWS = [(("enorm", "weight"), "enorm.weight", False, _ident),
            (("hnorm", "weight"), "hnorm.weight", False, _ident),
            (("eh_proj",), "eh_proj.weight", True, lambda w: w.T),
            (("head_norm", "weight"), "shared_head.norm.weight", False, _ident)]


def layer_rows(c: DeepseekV3Config, moe: bool) -> list[tuple]:
    """A layer's tensors as :func:`.hf._layer_map` lists them: (ours, theirs, transposed, to
    theirs); torch's ``[out, in]`` Linear weights, heads split out of ours."""
    from .hf import _expert_map

    d, h, rq, rkv = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    dq, dn, dv = c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim
    ident, t = (lambda w: w), (lambda w: w.T)
    a = "self_attn."
    if rq:
        rows = [(("attn", "wq_a"), a + "q_a_proj.weight", True, t),
                (("attn", "q_norm", "weight"), a + "q_a_layernorm.weight", False, ident),
                (("attn", "wq_b"), a + "q_b_proj.weight", True,
                 lambda w: w.reshape(rq, h * dq).T)]
    else:
        rows = [(("attn", "wq"), a + "q_proj.weight", True, lambda w: w.reshape(d, h * dq).T)]
    rows += [(("attn_norm", "weight"), "input_layernorm.weight", False, ident),
             (("attn", "wkv_a"), a + "kv_a_proj_with_mqa.weight", True, t),
             (("attn", "kv_norm", "weight"), a + "kv_a_layernorm.weight", False, ident),
             (("attn", "wkv_b"), a + "kv_b_proj.weight", True,
              lambda w: w.reshape(rkv, h * (dn + dv)).T),
             (("attn", "wo"), a + "o_proj.weight", True, lambda w: w.reshape(h * dv, d).T),
             (("mlp_norm", "weight"), "post_attention_layernorm.weight", False, ident)]
    mlp = [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]
    if not moe:
        return rows + [((ours,), f"mlp.{theirs}.weight", True, t) for ours, theirs in mlp]
    rows += [*_expert_map(c), (("moe", "bias"), "mlp.gate.e_score_correction_bias", False, ident)]
    if c.n_shared_experts:
        rows += [(("moe", ours), f"mlp.shared_experts.{theirs}.weight", True, t)
                 for ours, theirs in mlp]
    return rows
