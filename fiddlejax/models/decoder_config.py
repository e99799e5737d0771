"""The shared decoder's configuration: one frozen dataclass of Hugging Face field names.

Every family :mod:`.families` reads (Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3, Mixtral,
Qwen3-MoE) is a :class:`DecoderConfig`; :mod:`.decoder` builds the model from it. Kept apart
from the model code so the options (and their checks) read in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from . import rope
from .moe import MoEConfig

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Hugging Face field names (``LlamaConfig``'s first), ``seq_len`` (the default training
    length for ``batch_spec``; any batch up to ``max_position_embeddings`` is accepted) and
    the options of the other families. ``layer_types``: one of :data:`LAYER_TYPES` per layer
    (None: all ``sliding_attention`` when ``sliding_window`` is set, else all full);
    ``local_rope_theta``: the sliding layers' RoPE base when it differs (Gemma 3);
    ``checkpoint_dtype``: what ``save_pretrained`` writes by default.

    Mixture of experts (Mixtral, Qwen3-MoE): ``num_experts > 0`` makes every layer's MLP a
    :class:`~.moe.MoE` of ``num_experts`` SwiGLU experts ``moe_intermediate_size`` wide (None:
    ``intermediate_size``, as Mixtral), ``num_experts_per_tok`` of them per token; the loss
    adds ``router_aux_loss_coef`` times the per-sequence load-balancing loss and
    ``router_z_loss_coef`` times the router z-loss (:mod:`.moe_loss`). ``moe_dispatch`` and
    ``capacity_factor`` are :class:`~.moe.MoEConfig`'s ``dispatch`` and ``capacity_factor``."""

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
    model_type: str = "llama"
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple | None = None
    local_rope_theta: float | None = None
    checkpoint_dtype: str = "float32"
    token_ids: tuple = ()  # (key, id) items of config.json's *_token_id keys, written back
    # the config.json read (JSON text), whose metadata keys save_pretrained carries through
    source_config: str | None = dataclasses.field(default=None, compare=False, repr=False)
    # the directory it was read from: save_pretrained copies its tokenizer files
    source_dir: str | None = dataclasses.field(default=None, compare=False, repr=False)
    num_experts: int = 0  # 0: a dense MLP
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    moe_dispatch: str = "dropless"
    capacity_factor: float | None = None

    rope_types: ClassVar[tuple[str, ...]] = ("default", "llama3", "linear")

    def __post_init__(self):
        me = type(self).__name__
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{me}.{f}={v!r} must be a positive int")
        h, kv = self.num_attention_heads, self.num_key_value_heads
        if h % kv:
            raise ValueError(f"{me}.num_attention_heads={h} must be a multiple of "
                             f"num_key_value_heads={kv} (grouped-query attention)")
        if self.head_dim is None:
            if self.hidden_size % h:
                raise ValueError(f"{me}.hidden_size={self.hidden_size} must be divisible "
                                 f"by num_attention_heads={h}, or give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // h)
        if self.head_dim % 2:
            raise ValueError(f"{me}.head_dim={self.head_dim} must be even (rotary pairs)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{me}.hidden_act={self.hidden_act!r} is not supported; "
                             f"supported: {tuple(ACTIVATIONS)}")
        object.__setattr__(self, "rope_scaling", rope.normalize_scaling(
            self.rope_scaling, self.max_position_embeddings, me))
        kind = dict(self.rope_scaling or ()).get("rope_type", "default")
        if kind not in self.rope_types:  # YaRN scales cos/sin too: only MLA applies it yet
            raise ValueError(f"{me}.rope_scaling type {kind!r} is not supported; supported: "
                             f"{self.rope_types}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
            raise ValueError(f"{me}.sliding_window={w!r} must be a positive int or None")
        types = self.layer_types
        if types is None:
            types = ("sliding_attention" if w else "full_attention",) * self.num_hidden_layers
        types = tuple(types)
        if len(types) != self.num_hidden_layers or set(types) - set(LAYER_TYPES):
            raise ValueError(f"{me}.layer_types={list(types)} must give one of {LAYER_TYPES} "
                             f"for each of the {self.num_hidden_layers} layers")
        if "sliding_attention" in types and not w:
            raise ValueError(f"{me}.layer_types has sliding_attention layers but "
                             "sliding_window is None")
        object.__setattr__(self, "layer_types", types)
        e = self.num_experts
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            raise ValueError(f"{me}.num_experts={e!r} must be an int >= 0 (0: a dense MLP)")
        self.moe  # noqa: B018 - MoEConfig checks the expert options, naming the bad value

    @property
    def moe(self) -> MoEConfig | None:
        """The MoE layer's config (None for a dense model)."""
        if not self.num_experts:
            return None
        return MoEConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size or self.intermediate_size,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob, dispatch=self.moe_dispatch,
            capacity_factor=self.capacity_factor, router_aux_loss_coef=self.router_aux_loss_coef,
            router_z_loss_coef=self.router_z_loss_coef, hidden_act=self.hidden_act)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The distinct layer types, in order of first use (a layer's branch index)."""
        return tuple(dict.fromkeys(self.layer_types))

    @property
    def attention_scale(self) -> float | None:
        q = self.query_pre_attn_scalar
        return None if q is None else float(q) ** -0.5

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == "sliding_attention" else None

    def inv_freq(self, kind: str = "full_attention"):
        """The RoPE inverse frequencies of a layer type (a trace-time constant)."""
        if kind == "sliding_attention" and self.local_rope_theta is not None:
            return rope.inverse_frequencies(self.head_dim, self.local_rope_theta)
        return rope.inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
