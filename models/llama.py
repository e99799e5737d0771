"""Llama: a decoder-only transformer with RMSNorm, rotary positions, SwiGLU and grouped-query
attention, reading and writing Hugging Face checkpoints (``config.json`` + safetensors) without
torch (:mod:`.hf`).

Stage declaration (as :mod:`models.gpt`): ``prologue(batch)`` embeds ``tokens[:, :-1]``;
``blocks`` are ``num_hidden_layers`` :class:`LlamaBlock`s stacked on a leading axis; ``head(x)``
is the final RMSNorm and the vocabulary projection (tied to the embedding if asked); ``loss`` is
the mean next-token cross-entropy against ``tokens[:, 1:]``.

Tensor parallelism: query heads (``heads``) and KV heads (``kv_heads``) split over ``tensor``
in contiguous blocks, which keeps every query head on the device of the KV head it reads; the
MLP hidden units (``mlp``) and the vocabulary (``vocab``, padded when it does not divide) too.

Weights match Hugging Face's ``LlamaForCausalLM`` exactly: ``q_proj.weight[h * Dh + d, i]`` is
``wq[i, h, d]``, and rotary embeddings use the same "rotate_half" pairing (dimension ``d`` with
``d + Dh/2``), so conversion is a transpose and a reshape, never a permutation.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fiddlejax.memory import names

from . import hf
from .common import (
    annotated,
    attention,
    batch_sides,
    encode_side,
    join_side,
    next_token_loss,
    param,
    scan_layers,
    side_inputs,
    side_values,
    split_side,
    stacked,
)
from .hf import (  # the checkpoint helpers' former home: importable from here as before
    INDEX,
    SINGLE,
    hf_tensors,
    params_from_hf,
    parse_size,
    read_safetensors,
    write_safetensors,
)

ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hugging Face ``LlamaConfig`` field names, plus ``seq_len``: the training sequence length
    (``batch_spec``). ``head_dim=None`` means ``hidden_size // num_attention_heads``;
    ``rope_scaling`` is ``None`` or Llama 3's ``{"rope_type": "llama3", "factor", ...}``."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Any = None  # stored as a sorted tuple of items: configs must stay hashable
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seq_len: int = 128

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LlamaConfig.{f}={v!r} must be a positive int")
        h, kv = self.num_attention_heads, self.num_key_value_heads
        if h % kv:
            raise ValueError(f"LlamaConfig.num_attention_heads={h} must be a multiple of "
                             f"num_key_value_heads={kv} (grouped-query attention)")
        if self.head_dim is None:
            if self.hidden_size % h:
                raise ValueError(f"LlamaConfig.hidden_size={self.hidden_size} must be divisible "
                                 f"by num_attention_heads={h}, or give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // h)
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even (rotary pairs)")
        scaling = self.rope_scaling
        if isinstance(scaling, dict):
            scaling = dict(scaling)
            kind = scaling.pop("rope_type", scaling.pop("type", "default"))
            scaling.pop("rope_theta", None)
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"LlamaConfig.rope_scaling type {kind!r} is not supported; "
                                 f"supported: {ROPE_TYPES}")
            else:
                scaling.setdefault("original_max_position_embeddings",
                                   self.max_position_embeddings)
                missing = [k for k in LLAMA3_KEYS if k not in scaling]
                if missing:
                    raise ValueError(f"LlamaConfig.rope_scaling (llama3) lacks {missing}")
                scaling = tuple(sorted((k, scaling[k]) for k in LLAMA3_KEYS))
            object.__setattr__(self, "rope_scaling", scaling)
        elif scaling is not None and not isinstance(scaling, tuple):
            raise ValueError(f"LlamaConfig.rope_scaling={scaling!r} must be None or a dict")

    @property
    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` as Hugging Face writes it (``None`` for plain RoPE)."""
        if self.rope_scaling is None:
            return None
        return {"rope_type": "llama3", **dict(self.rope_scaling)}

    @classmethod
    def from_hf_config(cls, hf: dict, seq_len: int | None = None) -> LlamaConfig:
        """The config of a Hugging Face ``config.json`` (transformers 4.x or 5.x keys).

        ``seq_len`` defaults to ``max_position_embeddings``. Features this model does not
        implement (biases, another activation or RoPE type) are refused by name.
        """
        if hf.get("model_type", "llama") != "llama":
            raise ValueError(f"config.json has model_type={hf['model_type']!r}; Llama reads "
                             "model_type='llama' checkpoints")
        refuse = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
        for key, ok in refuse.items():
            if hf.get(key, ok) != ok:
                raise ValueError(f"config.json has {key}={hf[key]!r}; Llama supports only "
                                 f"{key}={ok!r}")
        # transformers 5 nests rope_theta and the scaling in rope_parameters; 4.x keeps them apart
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "rope_theta",
                                                              "seq_len"}
        kw = {k: hf[k] for k in fields if hf.get(k) is not None}
        mpe = kw.get("max_position_embeddings", cls.max_position_embeddings)
        return cls(**kw, rope_theta=float(theta), rope_scaling=rope or None,
                   seq_len=seq_len or mpe)

    def to_hf_config(self) -> dict:
        """A ``config.json`` that transformers' ``LlamaForCausalLM`` loads (4.x and 5.x)."""
        out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
               "mlp_bias": False, "initializer_range": 0.02, "pretraining_tp": 1,
               "torch_dtype": "float32", "use_cache": True}
        for f in dataclasses.fields(self):
            if f.name not in ("rope_scaling", "seq_len"):
                out[f.name] = getattr(self, f.name)
        out["rope_scaling"] = self.rope_scaling_dict
        out["rope_parameters"] = {"rope_type": "llama3" if self.rope_scaling else "default",
                                  "rope_theta": self.rope_theta,
                                  **(dict(self.rope_scaling) if self.rope_scaling else {})}
        return out


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim / 2]`` (float32), with Llama 3's scaling when configured.

    Computed in float32 as transformers does, so angles agree to the last bit or so.
    """
    dim = config.head_dim
    inv = (1.0 / (np.float32(config.rope_theta)
                  ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    if config.rope_scaling is None:
        return inv
    s = dict(config.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # Long wavelengths (beyond the original context / low) are slowed by `factor`, short ones
    # (below old / high) kept, and the band between them interpolated smoothly.
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, inv_freq: np.ndarray, positions: jax.Array | None = None
               ) -> jax.Array:
    """Rotary embedding of ``x[B, T, H, Dh]`` at positions ``0 .. T-1`` (rotate_half pairing),
    or at ``positions[B, T]`` (packed documents, a KV cache's offset)."""
    if positions is None:
        pos = jnp.arange(x.shape[1], dtype=jnp.float32)
        freqs = pos[:, None] * jnp.asarray(inv_freq)[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    else:
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
        emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = annotated(jnp.ones((dim,)), ("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class LlamaBlock(nnx.Module):
    """x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)); Meta's names: w1 gate, w3 up, w2 down.

    Tags: Q/K/V projections before rotary, the attention context, the output projection, the
    gate and up projections (both ``MLP_HIDDEN``) and the down projection.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        d, h, kv, dh, f = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                           c.head_dim, c.intermediate_size)
        normal = jax.nn.initializers.normal
        std, out_std = 0.02, 0.02 / (2 * c.num_hidden_layers) ** 0.5  # scaled residual init
        self.attn_norm = RMSNorm(d, c.rms_norm_eps)
        self.wq = param(rngs, normal(std), (d, h, dh), ("embed", "heads", "head_dim"))
        self.wk = param(rngs, normal(std), (d, kv, dh), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, normal(std), (d, kv, dh), ("embed", "kv_heads", "head_dim"))
        self.wo = param(rngs, normal(out_std), (h, dh, d), ("heads", "head_dim", "embed"))
        self.mlp_norm = RMSNorm(d, c.rms_norm_eps)
        self.w1 = param(rngs, normal(std), (d, f), ("embed", "mlp"))
        self.w3 = param(rngs, normal(std), (d, f), ("embed", "mlp"))
        self.w2 = param(rngs, normal(out_std), (f, d), ("mlp", "embed"))

    def attention(self, x: jax.Array, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None) -> jax.Array:
        inv_freq = rope_frequencies(self.config)  # a trace-time constant
        q = checkpoint_name(jnp.einsum("btd,dhk->bthk", x, self.wq[...]), names.QUERY)
        k = checkpoint_name(jnp.einsum("btd,dhk->bthk", x, self.wk[...]), names.KEY)
        v = checkpoint_name(jnp.einsum("btd,dhk->bthk", x, self.wv[...]), names.VALUE)
        ctx = attention(apply_rope(q, inv_freq, positions), apply_rope(k, inv_freq, positions),
                        v, causal=True, segment_ids=segment_ids)
        return checkpoint_name(jnp.einsum("bthk,hkd->btd", ctx, self.wo[...]), names.ATTN_OUT)

    def mlp(self, x: jax.Array) -> jax.Array:
        gate = checkpoint_name(x @ self.w1[...], names.MLP_HIDDEN)
        up = checkpoint_name(x @ self.w3[...], names.MLP_HIDDEN)
        return checkpoint_name((jax.nn.silu(gate) * up) @ self.w2[...], names.MLP_OUT)

    def __call__(self, x: jax.Array) -> jax.Array:
        x, side = split_side(x, self.config.hidden_size)
        sides = (None, None) if side is None else side_values(side)
        x = x + self.attention(self.attn_norm(x), *sides)
        return join_side(x + self.mlp(self.mlp_norm(x)), side)


class Llama(nnx.Module):
    stack = "blocks"  # the attribute holding the stacked layers

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        normal = jax.nn.initializers.normal
        self.embed = param(rngs, normal(0.02), (c.vocab_size, c.hidden_size), ("vocab", "embed"))
        self.blocks = stacked(c.num_hidden_layers, lambda r: LlamaBlock(c, rngs=r), rngs)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, normal(0.02), (c.hidden_size, c.vocab_size),
                                 ("embed", "vocab"))

    def embed_tokens(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None) -> jax.Array:
        """Token embeddings; with segment ids or positions they ride along as side channels
        (:func:`~models.common.encode_side`) for the blocks' masks and rotary angles."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        segment_ids, positions = side_inputs(tokens, segment_ids, positions)
        return x if segment_ids is None else join_side(
            x, encode_side(segment_ids, positions, x.dtype))

    def prologue(self, batch: dict) -> jax.Array:
        return self.embed_tokens(batch["tokens"][:, :-1], *batch_sides(batch))

    def head(self, x: jax.Array) -> jax.Array:
        x = self.norm(split_side(x, self.config.hidden_size)[0])
        if self.config.tie_word_embeddings:
            return jnp.einsum("btd,vd->btv", x, self.embed[...])
        return x @ self.lm_head[...]

    def loss(self, logits: jax.Array, batch: dict):
        return next_token_loss(logits, batch, self.config.vocab_size)

    def batch_spec(self, batch_size: int) -> dict:
        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.config.seq_len + 1), jnp.int32)}

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, T, vocab]`` for ``tokens[B, T]``; ``segment_ids`` / ``positions``
        ``[B, T]`` for packed documents (attention stays within a segment)."""
        x = self.embed_tokens(tokens, segment_ids, positions)
        return self.head(scan_layers(self.blocks, x))

    # -- Hugging Face checkpoints (models/hf.py) -----------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, *, seq_len: int | None = None) -> Llama:
        """The model of a Hugging Face Llama directory: ``config.json`` and ``model.safetensors``
        or sharded ``model-*-of-*.safetensors`` with ``model.safetensors.index.json``.

        Weights load as float32 whatever their stored dtype (bf16 included). ``seq_len`` (the
        training length, for ``batch_spec``) defaults to ``max_position_embeddings``.
        """
        config = LlamaConfig.from_hf_config(hf.read_config(directory), seq_len=seq_len)
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        tensors = hf.read_safetensors(Path(directory))
        nnx.update(model, hf.params_from_hf(tensors, config, nnx.state(model, nnx.Param)))
        return model

    def save_pretrained(self, directory: str | Path, *, max_shard_size: int | str = "5GB",
                        dtype: str = "float32") -> None:
        """Write a Hugging Face directory ``transformers.LlamaForCausalLM.from_pretrained`` reads:
        ``config.json`` and safetensors, split into ``model-0000i-of-0000n.safetensors`` files
        with an index when the weights exceed ``max_shard_size`` (bytes, or "500MB", "2GiB").
        ``dtype``: "float32" (exact) or "bfloat16"."""
        tensors = hf.hf_tensors(nnx.state(self, nnx.Param), self.config)
        hf.write_pretrained(directory, tensors, self.config.to_hf_config(), max_shard_size, dtype)


__all__ = [
    "INDEX", "LLAMA3_KEYS", "ROPE_TYPES", "SINGLE", "Llama", "LlamaBlock", "LlamaConfig", "RMSNorm",
    "apply_rope", "hf_tensors", "params_from_hf", "parse_size", "read_safetensors",
    "rope_frequencies", "write_safetensors",
]
