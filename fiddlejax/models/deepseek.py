"""DeepSeek-V3 (``model_type: deepseek_v3``: DeepSeek-V3/R1, Kimi K2) on the shared decoder.

A :class:`DeepseekBlock` is a :class:`~.decoder.DecoderBlock` whose attention is multi-head
latent attention (:mod:`.mla`) and whose MLP is DeepSeek's mixture of experts
(:mod:`.deepseek_moe`), or a dense SwiGLU in the first ``first_k_dense_replace`` layers.
The two kinds have different weights, so they stack apart: ``dense`` (its own scan, run by
the prologue with the embedding: the first pipeline stage) and ``blocks``, the MoE layers every
layout splits (stages, experts, heads). Loss, head, checkpoints and the router tally are the
shared decoder's; :mod:`.deepseek_config` reads and writes ``config.json``.

Auxiliary-loss-free balancing: with ``bias_update_speed`` > 0 the message carries each MoE
layer's expert loads (``int32 [L, E]``) beside the layer index; the loss reports them and the
step moves each layer's router bias by them (:mod:`fiddlejax.parallel.balance`).

Multi-token prediction (``num_nextn_predict_layers`` > 0, :mod:`.mtp`): the ``mtp`` stack
runs in the loss, on the last hidden state the head hands it, so every layout that runs the
head runs it too (a pipeline's last stage path); its weights load from and save to the Hub's
``model.layers.{num_hidden_layers + k - 1}.*``. Not yet: KV-cached generation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from fiddlejax.parallel import balance
from fiddlejax.parallel.ops import Ops
from fiddlejax.staged import vocab_parallel

from . import deepseek_config, hf, hf_io, mtp
from .common import Message, activation, param, scan_layers, stacked
from .decoder import Decoder, DecoderBlock, RMSNorm
from .deepseek_config import DeepseekV3Config
from .deepseek_moe import DeepseekMoE
from .mla import LatentAttention


class MTPInput(NamedTuple):
    """What the head hands the loss for the MTP modules: the normed last hidden state."""

    hidden: jax.Array


class DeepseekBlock(DecoderBlock):
    """x + MLA(norm(x)), then x + MLP(norm(x)): a dense SwiGLU (``dense=True``) or the MoE."""

    # the dense layers' MLP (the attention's kernels are LatentAttention's targets)
    lora_targets = {"w1": (1, 1), "w3": (1, 1), "w2": (1, 1)}

    def __init__(self, config: DeepseekV3Config, *, rngs: nnx.Rngs, dense: bool = False):
        c = self.config = config
        d, f = c.hidden_size, c.intermediate_size
        normal = jax.nn.initializers.normal
        out_std = 0.02 / (2 * c.num_hidden_layers) ** 0.5
        norm = lambda n, axis="embed": RMSNorm(n, c.rms_norm_eps, False, axis)  # noqa: E731
        self.attn_norm, self.mlp_norm = norm(d), norm(d)
        self.attn = LatentAttention(c, norm, rngs=rngs, out_std=out_std)
        self.dense = dense
        if dense:
            self.w1 = param(rngs, normal(0.02), (d, f), ("embed", "mlp"))
            self.w3 = param(rngs, normal(0.02), (d, f), ("embed", "mlp"))
            self.w2 = param(rngs, normal(out_std), (f, d), ("mlp", "embed"))
        else:
            self.moe = DeepseekMoE(c.moe, rngs=rngs, out_std=out_std)

    def routed(self, msg: Message, ops: Ops | None = None) -> tuple[Message, jax.Array | None]:
        """As :meth:`.decoder.DecoderBlock.routed`; a message carrying ``loads`` (the
        loss-free balancing, :mod:`fiddlejax.parallel.balance`) gets this layer's: each expert's
        choices by the real tokens (padding left out), added at row ``msg.layer``."""
        out, logits = super().routed(msg, ops)
        if msg.loads is None or logits is None:
            return out, logits
        e = self.config.num_experts
        counts = (out.tally - msg.tally)[..., :e].astype(jnp.float32)  # [B, T, E], exact
        if msg.segment_ids is not None:
            counts = counts * (msg.segment_ids > 0)[..., None]
        per_expert = jnp.sum(counts.reshape(-1, e), axis=0).astype(jnp.int32)
        return out._replace(loads=msg.loads.at[msg.layer].add(per_expert)), logits

    def qkv(self, x, positions, kind, drop=None):
        raise NotImplementedError("DeepSeek-V3's latent attention has no K/V cache yet: "
                                  "generate with transformers, or train and export")

    def attend(self, x: jax.Array, segment_ids, positions, kind: str,
               ops: Ops | None = None, drop=None) -> jax.Array:
        return self.attn(x, segment_ids, positions, ops)


class DeepseekV3(Decoder):
    """DeepSeek-V3 as Hugging Face's ``DeepseekV3ForCausalLM`` (module docstring)."""

    config_class = DeepseekV3Config
    model_type = deepseek_config.MODEL_TYPE
    dropout_keys = False  # LoRA dropout refused: its layer counter counts the MoE layers

    def __init__(self, config: DeepseekV3Config, *, rngs: nnx.Rngs):
        c = self.config = config
        normal = jax.nn.initializers.normal
        k = c.first_k_dense_replace
        self.embed = param(rngs, normal(0.02), (c.vocab_size, c.hidden_size), ("vocab", "embed"))
        if k:
            self.dense = stacked(k, lambda r: DeepseekBlock(c, rngs=r, dense=True), rngs)
        self.blocks = stacked(c.num_hidden_layers - k, lambda r: DeepseekBlock(c, rngs=r),
                              rngs)
        if c.num_nextn_predict_layers:  # its block's router bias stays as loaded (.mtp)
            still = dataclasses.replace(c, bias_update_speed=0.0)
            self.mtp = stacked(c.num_nextn_predict_layers, lambda r: mtp.MTPLayer(
                c.hidden_size, c.rms_norm_eps, lambda r: DeepseekBlock(still, rngs=r),
                rngs=r), rngs)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, normal(0.02), (c.hidden_size, c.vocab_size),
                                 ("embed", "vocab"))

    def message(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                positions: jax.Array | None = None, ops: Ops | None = None,
                keys: jax.Array | None = None) -> Message:
        """The message entering the first MoE layer: the dense layers run here. (No LoRA
        dropout keys: ``dropout_keys`` is off, the layer counter counts MoE layers only.)"""
        c = self.config
        msg = super().message(tokens, segment_ids, positions, ops, keys)
        msg = scan_layers(self.dense, msg, ops) if c.first_k_dense_replace else msg
        if not c.bias_update_speed:
            return msg
        moe_layers = c.num_hidden_layers - c.first_k_dense_replace
        return msg._replace(layer=jnp.zeros((), jnp.int32),
                            loads=jnp.zeros((moe_layers, c.num_experts), jnp.int32))

    def head(self, msg: Message | jax.Array, ops: Ops | None = None):
        """As :meth:`.decoder.Decoder.head`, then the message's ``loads`` when it has them
        (the loss reports them), then with MTP an :class:`MTPInput`: the normed last hidden
        state the MTP modules start from."""
        out = super().head(msg, ops)
        loads = getattr(msg, "loads", None)
        out = out if loads is None else (*out, loads)
        if not self.config.num_nextn_predict_layers:
            return out
        return (*out, MTPInput(self.norm(activation(msg))))

    @vocab_parallel
    def loss(self, outputs, batch: dict, ops: Ops | None = None):
        """As :meth:`.decoder.Decoder.loss`; ``loads`` are reported as the sum
        :data:`fiddlejax.parallel.balance.LOADS`, which the step turns into the router bias'
        move; with MTP, its weighted loss added (:mod:`.mtp`) and reported (``mtp_loss``)."""
        if not isinstance(outputs, tuple):
            return super().loss(outputs, batch, ops)
        extra = None
        if isinstance(outputs[-1], MTPInput):
            outputs, extra = outputs[:-1], outputs[-1].hidden
        reported = super().loss(outputs[:2], batch, ops)
        if len(outputs) == 3:
            reported = reported._replace(sums={**reported.sums, balance.LOADS: outputs[2]})
        if extra is None:
            return reported
        c = self.config
        value, metric = mtp.add_to_loss(reported.value, mtp.depth_sums(self, extra, batch, ops),
                                        c.mtp_loss_weight, extra.shape[0] * extra.shape[1])
        return reported._replace(value=value, means={**reported.means, "mtp_loss": metric})

    @classmethod
    def from_pretrained(cls, directory, **kw) -> DeepseekV3:
        """As :meth:`.decoder.Decoder.from_pretrained`; the MTP depth is the checkpoint's: 0
        when it holds no MTP layer (transformers drops them), unless ``overrides`` set it."""
        from fiddlejax.models import hub

        directory, overrides = hub.local_dir(directory), dict(kw.pop("overrides", None) or {})
        if "num_nextn_predict_layers" not in overrides:
            n = hf.read_config(directory).get("num_hidden_layers")
            names = hf_io.sources(directory)
            overrides["num_nextn_predict_layers"] = sum(
                1 for k in range(8) if f"model.layers.{(n or 0) + k}.eh_proj.weight" in names)
        return super().from_pretrained(directory, overrides=overrides, **kw)

    def pretrained_params(self, shardings=None, *, directory=None, dtype=None) -> nnx.State:
        """As :meth:`.decoder.Decoder.pretrained_params`, each MTP layer's copies of the
        embedding and head checked equal to the main ones (one copy is kept)."""
        src = hf_io.sources(Path(directory or self.pretrained_from))
        mains = {("embed",): "model.embed_tokens.weight", ("lm_head",): "lm_head.weight"}
        for name, key, _ in self.config.hf_copies():
            main = mains[key]
            if name in src and not mtp.same(src[name], src[main]):
                raise ValueError(f"{hf_io.where(src[name])} differs from {main}: the MTP "
                                 "layers share the main model's embedding and head, so fiddlejax "
                                 "keeps one; make the copies equal, or set overrides="
                                 "{'num_nextn_predict_layers': 0}")
        return super().pretrained_params(shardings, directory=directory, dtype=dtype)

    @classmethod
    def config_from_hf(cls, hf_config: dict, seq_len: int | None = None) -> DeepseekV3Config:
        return DeepseekV3Config(**deepseek_config.read(hf_config, seq_len))

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, output_router_logits: bool = False):
        """As :meth:`.decoder.Decoder.__call__`; router logits of the MoE layers only (the
        dense layers have none), as transformers returns them."""
        if not output_router_logits:
            return super().__call__(tokens, segment_ids, positions)
        x = self.message(tokens, segment_ids, positions)
        graphdef, state = nnx.split(self.blocks)
        x, router = jax.lax.scan(lambda h, s: nnx.merge(graphdef, s).routed(h), x, state)
        e = self.config.num_experts
        return self.head(x)[0], tuple(jnp.reshape(r, (-1, e)) for r in router)
