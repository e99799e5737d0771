"""GPT-OSS (``model_type: gpt_oss``: gpt-oss-20b, gpt-oss-120b) on the shared decoder.

A :class:`GptOssBlock` is a :class:`~.decoder.DecoderBlock` with Q/K/V and output biases,
attention sinks (a learned logit per head joins the softmax: :func:`.common.attention`'s
``sinks``), YaRN's factor on the rotated queries and keys, and :class:`GptOssMoE` as its MLP.
Sliding-window and full layers alternate (``layer_types``: the shared decoder's layer index
picks each layer's branch). :mod:`.gpt_oss_config` reads and writes ``config.json``.

MXFP4 experts (the Hub's checkpoints) dequantize at load (:class:`.gpt_oss_config.Mxfp4`).
Under ``context`` each sink joins the shards' joined softmax once
(:func:`fiddlejax.parallel.ring.with_sinks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fiddlejax import intercept
from fiddlejax.memory import names
from fiddlejax.parallel import expert
from fiddlejax.parallel.ops import Ops

from . import gpt_oss_config
from .common import annotated, attention, param, project, stacked
from .decoder import Decoder, DecoderBlock, RMSNorm
from .gpt_oss_config import GptOssConfig, GptOssMoEConfig
from .moe import MoE, MoEOutput, blocked, grouped_kind, sort_by_expert, with_padding


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GPT-OSS's SwiGLU: ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g`` the
    gate clamped above at ``limit``."""
    gate = jnp.minimum(checkpoint_name(gate, names.MLP_HIDDEN), limit)
    up = jnp.clip(checkpoint_name(up, names.MLP_HIDDEN), -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def experts(xs: jax.Array, sizes: jax.Array, ws: tuple, alpha: float, limit: float,
            grouped: str = "ragged_dot", most: jax.Array | None = None) -> jax.Array:
    """The experts on rows ``xs`` sorted by expert (``sizes[e]`` rows each): grouped matmuls
    plus each row's expert's biases; ``grouped`` as ``MoEConfig.grouped_matmul`` resolved
    (``blocked``: a loop over row blocks of one expert each, :func:`~.moe.blocked`, ``most``
    as there)."""
    if grouped == "blocked":
        def one(xb, w):
            w_gate, w_up, w_down, b_gate, b_up, b_down = w
            h = clamped_swiglu(xb @ w_gate + b_gate.astype(xb.dtype),
                               xb @ w_up + b_up.astype(xb.dtype), alpha, limit)
            return h @ w_down + b_down.astype(xb.dtype)

        return blocked(xs, sizes, ws, one, most=most)
    w_gate, w_up, w_down, b_gate, b_up, b_down = ws
    sizes = with_padding(sizes, xs.shape[0])
    owner = jnp.repeat(jnp.arange(w_gate.shape[0], dtype=jnp.int32), sizes,
                       total_repeat_length=xs.shape[0])
    rd = jax.lax.ragged_dot
    h = clamped_swiglu(rd(xs, w_gate, sizes) + b_gate[owner].astype(xs.dtype),
                       rd(xs, w_up, sizes) + b_up[owner].astype(xs.dtype), alpha, limit)
    return rd(h, w_down, sizes) + b_down[owner].astype(xs.dtype)


class GptOssMoE(MoE):
    """:class:`~.moe.MoE` with a router bias, expert biases (``b_gate``, ``b_up`` ``[E, f]``,
    ``b_down [E, d]``, split as their matrices) and the clamped SwiGLU; the gates are the
    softmax of the top-k router logits (transformers' ``GptOssTopKRouter``)."""

    def __init__(self, config: GptOssMoEConfig, *, rngs: nnx.Rngs, out_std: float | None = None):
        super().__init__(config, rngs=rngs, out_std=out_std)
        e, d, f = config.num_experts, config.hidden_size, config.intermediate_size
        self.router_bias = annotated(jnp.zeros((e,)), (None,))
        self.b_gate = annotated(jnp.zeros((e, f)), ("expert", "mlp"))
        self.b_up = annotated(jnp.zeros((e, f)), ("expert", "mlp"))
        self.b_down = annotated(jnp.zeros((e, d)), ("expert", "embed"))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        logits = x @ self.router[...].astype(x.dtype) + self.router_bias[...].astype(x.dtype)
        top, chosen = jax.lax.top_k(logits.astype(jnp.float32), self.config.num_experts_per_tok)
        return logits, jax.nn.softmax(top, axis=-1), chosen.astype(jnp.int32)

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> MoEOutput:
        """Route and run ``x [..., d]`` dropless; with ``ops.expert`` the experts are split
        over the ``expert`` axis and tokens travel to them (:mod:`fiddlejax.parallel.expert`)."""
        c = self.config
        ops = ops if ops is not None else intercept.current().ops
        ep = None if ops is None else ops.expert
        lead = x.shape[:-1]
        flat = x.reshape(-1, c.hidden_size)
        logits, gates, chosen = self.route(flat)
        ws = tuple(getattr(self, n)[...] for n in ("w_gate", "w_up", "w_down", "b_gate", "b_up",
                                                    "b_down"))
        grouped = grouped_kind(c.grouped_matmul)
        run = lambda xs, sizes, ws, most=None: experts(  # noqa: E731
            xs, sizes, ws, c.swiglu_alpha, c.swiglu_limit, grouped, most)
        if ep is None:
            order, sizes = sort_by_expert(chosen, c.num_experts)
            token = order % flat.shape[0]
            ys = run(flat[token], sizes, ws)
            g = gates.T.reshape(-1)[order].astype(ys.dtype)
            out = jnp.zeros_like(flat).at[token].add(ys * g[:, None])
        else:
            out = expert.dropless(ep, flat, gates, chosen, ws, run)
        out = checkpoint_name(out, names.MLP_OUT)
        return MoEOutput(out.reshape(x.shape), logits.reshape(*lead, -1),
                         chosen.reshape(*lead, -1), jnp.zeros(lead, jnp.int32))


class GptOssBlock(DecoderBlock):
    """:class:`~.decoder.DecoderBlock` with GPT-OSS's attention (biases, sinks, YaRN's
    factor) and :class:`GptOssMoE`."""

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        c = config
        self.bo = annotated(jnp.zeros((c.hidden_size,)), ("embed",))
        self.sinks = annotated(jnp.zeros((c.num_attention_heads,)), ("heads",))
        out_std = 0.02 / (2 * c.num_hidden_layers) ** 0.5
        self.moe = GptOssMoE(c.moe, rngs=rngs, out_std=out_std)

    def qkv(self, x: jax.Array, positions: jax.Array | None, kind: str, drop=None):
        """As :meth:`.decoder.DecoderBlock.qkv`, queries and keys times YaRN's cos/sin
        factor (transformers scales cos and sin by it)."""
        q, k, v = super().qkv(x, positions, kind, drop)
        f = self.config.rope_factor
        return (q, k, v) if f == 1.0 else (q * jnp.asarray(f, q.dtype), k * jnp.asarray(f, k.dtype),
                                           v)

    def attend(self, x: jax.Array, segment_ids, positions, kind: str,
               ops: Ops | None = None, drop=None) -> jax.Array:
        c = self.config
        q, k, v = self.qkv(x, positions, kind, drop)
        ctx = attention(q, k, v, causal=True, segment_ids=segment_ids, window=c.window(kind),
                        ops=ops, sinks=self.sinks[...])
        out = project(self, "wo", ctx, "bthk,hkd->btd", drop) + self.bo[...].astype(ctx.dtype)
        return checkpoint_name(out, names.ATTN_OUT)


class GptOss(Decoder):
    """GPT-OSS as Hugging Face's ``GptOssForCausalLM`` (module docstring)."""

    config_class = GptOssConfig
    model_type = gpt_oss_config.MODEL_TYPE

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        normal = jax.nn.initializers.normal
        self.embed = param(rngs, normal(0.02), (c.vocab_size, c.hidden_size), ("vocab", "embed"))
        self.blocks = stacked(c.num_hidden_layers, lambda r: GptOssBlock(c, rngs=r), rngs)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, normal(0.02), (c.hidden_size, c.vocab_size),
                                 ("embed", "vocab"))

    @classmethod
    def config_from_hf(cls, hf_config: dict, seq_len: int | None = None) -> GptOssConfig:
        return GptOssConfig(**gpt_oss_config.read(hf_config, seq_len))
