"""Llama: the shared decoder (:mod:`.decoder`) as Hugging Face's ``LlamaForCausalLM`` — RMSNorm,
rotary positions (Llama 3.1's scaling too), SwiGLU and grouped-query attention — reading and
writing Hugging Face checkpoints (``config.json`` + safetensors) without torch (:mod:`.hf`).

Stage declaration (as :mod:`models.gpt`): ``prologue(batch)`` embeds ``tokens[:, :-1]``;
``blocks`` are ``num_hidden_layers`` :class:`LlamaBlock`s stacked on a leading axis; ``head(x)``
is the final RMSNorm and the vocabulary projection (tied to the embedding if asked); ``loss`` is
the mean next-token cross-entropy against ``tokens[:, 1:]``.

Tensor parallelism: query heads (``heads``) and KV heads (``kv_heads``) split over ``tensor``
in contiguous blocks, which keeps every query head on the device of the KV head it reads; the
MLP hidden units (``mlp``) and the vocabulary (``vocab``, padded when it does not divide) too.

Weights match Hugging Face's ``LlamaForCausalLM`` exactly: ``q_proj.weight[h * Dh + d, i]`` is
``wq[i, h, d]``, and rotary embeddings use the same "rotate_half" pairing (dimension ``d`` with
``d + Dh/2``), so conversion is a transpose and a reshape, never a permutation. Other families
(Mistral, Qwen, Phi-3, Gemma) load through ``fiddlejax.models.from_pretrained``.
"""

from __future__ import annotations

import numpy as np

from . import families
from .decoder import Decoder, DecoderBlock, DecoderConfig, RMSNorm
from .hf import (  # the checkpoint helpers' former home: importable from here as before
    INDEX,
    SINGLE,
    hf_tensors,
    params_from_hf,
    parse_size,
    read_safetensors,
    write_safetensors,
)
from .rope import LLAMA3_KEYS, ROPE_TYPES, apply_rope


class LlamaConfig(DecoderConfig):
    """Hugging Face ``LlamaConfig`` field names, plus ``seq_len``: the default training sequence
    length (``batch_spec``). ``head_dim=None`` means ``hidden_size // num_attention_heads``;
    ``rope_scaling`` is ``None`` or Llama 3's ``{"rope_type": "llama3", "factor", ...}``."""

    @property
    def rope_scaling_dict(self) -> dict | None:
        """``rope_scaling`` as Hugging Face writes it (``None`` for plain RoPE)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, hf: dict, seq_len: int | None = None) -> LlamaConfig:
        """The config of a Hugging Face ``config.json`` (transformers 4.x or 5.x keys).

        ``seq_len`` defaults to ``max_position_embeddings``. Features this model does not
        implement (biases, another activation or RoPE type) are refused by name.
        """
        return cls(**families.read(hf, seq_len, expect="llama"))

    def to_hf_config(self) -> dict:
        """A ``config.json`` that transformers' ``LlamaForCausalLM`` loads (4.x and 5.x)."""
        return families.write(self)


LlamaBlock = DecoderBlock  # one block for every family; a Llama config turns its options off


def rope_frequencies(config: DecoderConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim / 2]`` (float32), with Llama 3's scaling when configured.

    Computed in float32 as transformers does, so angles agree to the last bit or so.
    """
    return config.inv_freq("full_attention")


class Llama(Decoder):
    """The decoder with a :class:`LlamaConfig`; ``from_pretrained`` reads ``model_type='llama'``
    directories only (``fiddlejax.models.from_pretrained`` reads every family)."""

    config_class = LlamaConfig
    model_type = "llama"


__all__ = [
    "INDEX", "LLAMA3_KEYS", "ROPE_TYPES", "SINGLE", "Llama", "LlamaBlock", "LlamaConfig", "RMSNorm",
    "apply_rope", "hf_tensors", "params_from_hf", "parse_size", "read_safetensors",
    "rope_frequencies", "write_safetensors",
]
