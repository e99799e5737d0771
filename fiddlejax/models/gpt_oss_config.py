"""GPT-OSS's configuration (``model_type: gpt_oss``: gpt-oss-20b, gpt-oss-120b) and its
``config.json`` and tensor layout, read and written.

:class:`GptOssConfig` is the shared :class:`~.decoder_config.DecoderConfig` (attention biases,
alternating ``sliding_attention`` / ``full_attention`` layers, YaRN) plus the clamped SwiGLU's
``swiglu_alpha`` and ``swiglu_limit``. Every ``config.json`` key is implemented, checked
against the one value implemented, or metadata; any other is refused by name. MXFP4 experts
(``quantization_config`` ``mxfp4``: the Hub's checkpoints) dequantize as they are read.

The checkpoint stores each layer's experts fused: ``gate_up_proj [E, d, 2f]`` with gate and up
interleaved (gate the even columns) and ``gate_up_proj_bias [E, 2f]``; they read as strided
views (:class:`Strided`, no copy of the tensor) and are interleaved again at save.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import numpy as np

from . import families, hf_io, rope
from .decoder_config import DecoderConfig
from .moe import MoEConfig

MODEL_TYPE = "gpt_oss"
# config.json keys read into fields of the same name.
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
          "max_position_embeddings", "tie_word_embeddings", "num_experts_per_tok",
          "sliding_window", "router_aux_loss_coef", "swiglu_alpha", "swiglu_limit")
# Keys that must hold the one value implemented (absent counts as that value).
FIXED = {"attention_bias": True, "hidden_act": "silu", "attention_dropout": 0.0}
# No effect on the function computed (read elsewhere: num_local_experts, layer_types, rope).
METADATA = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
            "use_cache", "initializer_range", "_name_or_path", "auto_map", "return_dict",
            "output_attentions", "output_hidden_states", "output_router_logits", "id2label",
            "label2id", "tokenizer_class", "_attn_implementation_autoset", "rope_theta",
            "rope_scaling", "rope_parameters", "num_local_experts", "layer_types",
            "experts_per_token", "initial_context_length"}
# transformers' GptOssConfig defaults, for keys a config.json leaves out.
HF_DEFAULTS = {"num_experts_per_tok": 4, "sliding_window": 128, "head_dim": 64,
               "router_aux_loss_coef": 0.001, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
               "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


@dataclasses.dataclass(frozen=True)
class GptOssMoEConfig(MoEConfig):
    """:class:`~.moe.MoEConfig` with the clamped SwiGLU: gate clamped above at ``limit``, up
    to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        super().__post_init__()
        me = type(self).__name__
        if self.dispatch != "dropless":
            raise ValueError(f"{me}.dispatch={self.dispatch!r}: GPT-OSS's experts (biases, "
                             "clamped SwiGLU) run dropless only; set moe_dispatch='dropless'")
        if not self.swiglu_limit > 0:
            raise ValueError(f"{me}.swiglu_limit={self.swiglu_limit!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """:class:`~.decoder_config.DecoderConfig` with GPT-OSS's fields (transformers' names):
    Q/K/V/O biases, a sink logit per head, YaRN's cos/sin factor, an MoE router with a bias
    and experts with biases and the clamped SwiGLU in every layer."""

    model_type: str = MODEL_TYPE
    attention_bias: bool = True
    num_experts: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rope_types: ClassVar[tuple[str, ...]] = ("default", "llama3", "linear", "yarn")

    def __post_init__(self):
        super().__post_init__()
        me = type(self).__name__
        if not self.num_experts:
            raise ValueError(f"{me}.num_experts=0: GPT-OSS is a mixture of experts")
        if not self.attention_bias or self.qk_norm or self.sandwich_norms \
                or self.norm_plus_one or self.scale_embeddings or self.hidden_act != "silu":
            raise ValueError(f"{me}: GPT-OSS has Q/K/V/O biases, plain pre-norms, SiLU and no "
                             "q/k norms, embedding scale or (1 + w) norms")
        for f in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                  "local_rope_theta"):
            if getattr(self, f) is not None:
                raise ValueError(f"{me}.{f}={getattr(self, f)!r} is not part of GPT-OSS")

    @property
    def moe(self) -> GptOssMoEConfig:
        return GptOssMoEConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            dispatch=self.moe_dispatch, capacity_factor=self.capacity_factor,
            router_aux_loss_coef=self.router_aux_loss_coef,
            router_z_loss_coef=self.router_z_loss_coef,
            swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)

    @property
    def rope_factor(self) -> float:
        """YaRN's factor on cos and sin (1 for other RoPE types)."""
        return rope.yarn_factors(self.rope_scaling)[0]

    def hf_stacks(self) -> list[tuple]:
        return [("blocks", range(self.num_hidden_layers), layer_rows(self))]

    def hf_unfuse(self, tensors: dict) -> dict:
        """The checkpoint's fused ``gate_up_proj`` (and bias) as strided gate and up views;
        MXFP4 experts (``*_blocks``, ``*_scales``) dequantized as read (:class:`Mxfp4`)."""
        out = dict(tensors)
        for i in range(self.num_hidden_layers):
            pre = f"model.layers.{i}.mlp.experts."
            for w in ("gate_up_proj", "down_proj"):
                if pre + w + "_blocks" in out:
                    out[pre + w] = Mxfp4(out.pop(pre + w + "_blocks"),
                                         out.pop(pre + w + "_scales"))
            for fused in ("gate_up_proj", "gate_up_proj_bias"):
                if pre + fused in out:
                    w, tail = out.pop(pre + fused), fused[len("gate_up_proj"):]
                    out[f"{pre}gate_proj{tail}"], out[f"{pre}up_proj{tail}"] = (
                        Strided(w, 0), Strided(w, 1))
        return out

    def hf_fuse(self, plan: list) -> list:
        """:func:`.hf.hf_plan`'s gate and up tensors written as transformers' interleaved
        ``gate_up_proj`` and ``gate_up_proj_bias``."""
        by_name, out = {p[0]: p for p in plan}, []
        for name, shape, needs, make in plan:
            if ".experts.up_proj" in name:
                continue
            if ".experts.gate_proj" not in name:
                out.append((name, shape, needs, make))
                continue
            up = by_name[name.replace("gate_proj", "up_proj")]
            out.append((name.replace("gate_proj", "gate_up_proj"), (*shape[:-1], 2 * shape[-1]),
                        [*needs, *up[2]], lambda xs, g=make, u=up[3]: _interleave(
                            g(xs[:1]), u(xs[1:]))))
        return out

    def hf_dict(self) -> dict:
        """The ``config.json`` transformers' ``GptOssForCausalLM`` reads."""
        scaling = rope.scaling_dict(self.rope_scaling)
        out = {"architectures": ["GptOssForCausalLM"], "model_type": MODEL_TYPE,
               "hidden_act": "silu", "attention_bias": True, "attention_dropout": 0.0,
               "initializer_range": 0.02, "use_cache": True, "output_router_logits": False,
               "torch_dtype": self.checkpoint_dtype, "num_local_experts": self.num_experts,
               "layer_types": list(self.layer_types),
               "rope_parameters": {"rope_type": "default", **(scaling or {}),
                                   "rope_theta": self.rope_theta},
               "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        out.update({k: getattr(self, k) for k in FIELDS})
        out.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.token_ids})
        return out


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``[..., 2f]`` with gate in the even columns and up in the odd ones."""
    return np.stack([gate, up], -1).reshape(*np.shape(gate)[:-1], -1)


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0,
                       -3.0, -4.0, -6.0], np.float32)  # e2m1, by 4-bit code


class Mxfp4:
    """An MXFP4 expert tensor read dequantized, as transformers' ``convert_moe_packed_tensors``:
    ``blocks [E, out, G, 16]`` uint8 (two e2m1 codes a byte, the low nibble first) and
    ``scales [E, out, G]`` (a power of two ``2 ** (s - 127)`` per 32 values) give the weight
    ``[E, in = 32 G, out]`` (in, out: transformers' layout), each read only over the groups it
    needs."""

    def __init__(self, blocks, scales):
        e, rows, groups, width = blocks.shape
        if width != 16 or tuple(scales.shape) != (e, rows, groups):
            raise ValueError(f"{hf_io.where(blocks)}: MXFP4 blocks {tuple(blocks.shape)} and "
                             f"scales {tuple(scales.shape)} do not pair ([E, out, G, 16] and "
                             "[E, out, G])")
        self.blocks, self.scales, self.shape = blocks, scales, (e, groups * 32, rows)

    def read(self, index: hf_io.Index) -> np.ndarray:
        ex, cols, rows = index
        g0, g1 = cols.start // 32, -(-cols.stop // 32)
        blk = self.blocks.read((ex, rows, slice(g0, g1), slice(0, 16)))
        exp = self.scales.read((ex, rows, slice(g0, g1))).astype(np.int32) - 127
        vals = np.stack([FP4_VALUES[blk & 0x0F], FP4_VALUES[blk >> 4]], -1)
        vals = np.ldexp(vals.reshape(*blk.shape[:-1], 32), exp[..., None])
        vals = vals.reshape(*vals.shape[:-2], -1)[..., cols.start - 32 * g0:cols.stop - 32 * g0]
        return np.swapaxes(vals, -1, -2).astype(np.float32)


class Strided(hf_io.Part):
    """Every other column of ``base``'s last axis from ``offset``: gate (0) or up (1) of
    transformers' interleaved ``gate_up_proj``."""

    def __init__(self, base, offset: int):
        super().__init__(base, (), offset, (*base.shape[:-1], base.shape[-1] // 2))

    def read(self, index: hf_io.Index) -> np.ndarray:
        *lead, last = index
        cols = slice(2 * last.start + self.start, 2 * (last.stop - 1) + self.start + 1)
        return self.base.read((*lead, cols))[..., ::2]


def read(hf: dict, seq_len: int | None = None) -> dict:
    """:class:`GptOssConfig` fields of a ``config.json``."""
    family = hf.get("model_type")
    if family != MODEL_TYPE:
        raise ValueError(f"config.json has model_type={family!r}; GptOss reads "
                         f"model_type={MODEL_TYPE!r} checkpoints")
    known = set(FIELDS) | set(FIXED) | METADATA
    unknown = sorted(k for k in hf if k not in known and not k.endswith("_token_id"))
    quant = hf.get("quantization_config")
    if quant is not None and not (isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"):
        raise families.refuse("quantization_config", quant, MODEL_TYPE,
                              " (only MXFP4 experts, dequantized at load)")
    unknown = [k for k in unknown if k != "quantization_config"]
    if unknown:
        raise ValueError(f"config.json sets {unknown}, which fiddlejax's {MODEL_TYPE} does not "
                         "implement; remove the keys if they are metadata")
    for key, ok in FIXED.items():
        if hf.get(key) is not None and hf[key] != ok:
            raise families.refuse(key, hf[key], MODEL_TYPE, f"; it supports only {key}={ok!r}")
    out: dict[str, Any] = {k: hf.get(k, HF_DEFAULTS.get(k)) for k in FIELDS
                           if k in hf or k in HF_DEFAULTS}
    k, alias = out.get("num_experts_per_tok"), hf.get("experts_per_token")
    if alias is not None and alias != k:
        raise ValueError(f"config.json has experts_per_token={alias!r} and "
                         f"num_experts_per_tok={k!r}; keep one of them")
    out["num_experts"] = hf.get("num_local_experts", 128)
    out.setdefault("num_key_value_heads", out.get("num_attention_heads", 64))
    mpe = out.setdefault("max_position_embeddings", 131072)
    n = out.setdefault("num_hidden_layers", 36)
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf = {**hf, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": hf.get("rope_theta",
                                                                              150000.0)}}
    out.update(families._rope(hf, MODEL_TYPE, mpe))
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(n)]
    out.update(model_type=MODEL_TYPE, seq_len=seq_len or mpe, layer_types=tuple(types),
               checkpoint_dtype=families._dtype(hf),
               token_ids=tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                      for k, v in hf.items() if k.endswith("_token_id"))),
               source_config=json.dumps({k: v for k, v in hf.items()  # written dequantized
                                         if k != "quantization_config"}, sort_keys=True))
    return out


def layer_rows(c: GptOssConfig) -> list[tuple]:
    """A layer's tensors as :func:`.hf._layer_map` lists them: (ours, theirs, transposed, to
    theirs). The experts' gate and up are :meth:`GptOssConfig.hf_unfuse`'s views."""
    d, h, kv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ident, t = (lambda w: w), (lambda w: w.T)
    a, x = "self_attn.", "mlp.experts."
    rows = [(("attn_norm", "weight"), "input_layernorm.weight", False, ident),
            (("mlp_norm", "weight"), "post_attention_layernorm.weight", False, ident),
            (("wq",), a + "q_proj.weight", True, lambda w: w.reshape(d, h * dh).T),
            (("wk",), a + "k_proj.weight", True, lambda w: w.reshape(d, kv * dh).T),
            (("wv",), a + "v_proj.weight", True, lambda w: w.reshape(d, kv * dh).T),
            (("wo",), a + "o_proj.weight", True, lambda w: w.reshape(h * dh, d).T),
            (("bq",), a + "q_proj.bias", False, lambda b: b.reshape(h * dh)),
            (("bk",), a + "k_proj.bias", False, lambda b: b.reshape(kv * dh)),
            (("bv",), a + "v_proj.bias", False, lambda b: b.reshape(kv * dh)),
            (("bo",), a + "o_proj.bias", False, ident),
            (("sinks",), a + "sinks", False, ident),
            (("moe", "router"), "mlp.router.weight", True, t),
            (("moe", "router_bias"), "mlp.router.bias", False, ident)]
    return rows + [(("moe", ours), x + theirs, False, ident) for ours, theirs in (
        ("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"),
        ("b_gate", "gate_proj_bias"), ("b_up", "up_proj_bias"), ("b_down", "down_proj_bias"))]
