"""One decoder for the Hugging Face families: Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3,
and the mixtures of experts Mixtral and Qwen3-MoE.

The families differ by options of one block, not by code: biases on Q/K/V (Qwen2), RMSNorm on
queries and keys (Qwen3, Gemma 3), sliding-window layers (Mistral, Qwen2, Gemma 2/3, Phi-3),
soft-capped attention and final logits (Gemma 2), a query scale of its own
(``query_pre_attn_scalar``), norms before and after each sub-layer, Gemma's ``(1 + w)`` norm and
scaled embedding, GeGLU instead of SwiGLU, per-layer-type RoPE bases (Gemma 3), and a
mixture of experts in place of the MLP (:mod:`.moe`; Mixtral, Qwen3-MoE).
:mod:`.families` reads each family's ``config.json`` into a :class:`DecoderConfig`.

Stage declaration (as :mod:`models.gpt`): ``prologue(batch)`` embeds ``tokens[:, :-1]``;
``blocks`` are ``num_hidden_layers`` :class:`DecoderBlock`s stacked on a leading axis; ``head``
is the final norm and the vocabulary projection; ``loss`` the next-token cross-entropy.

The layers pass a :class:`~models.common.Message` on: the activation, a packed batch's segment
ids and positions (int32), and as needed the layer index and the router tally.
Layers of different types (local and global attention) share one stacked block, so a layer
learns its type from the message: a model with several layer types carries the next layer's
index (int32), and each block reads it, picks its type's branch with ``lax.switch`` (each
branch one attention call with static options, so the fused kernel stays available) and adds
one. Pipelines carry it with the message, so every layout sees the same layer types.
An MoE model carries the router tally (float32, :mod:`.moe_loss`): each layer adds its routing
to it, the head hands it to the loss, which adds the per-sequence router losses.

Tensor parallelism: query heads (``heads``) and KV heads (``kv_heads``) split over ``tensor`` in
contiguous blocks (every query head on the device of the KV head it reads), as do the MLP units
(``mlp``) and the vocabulary (padded when it does not divide); Q/K/V biases follow their heads,
q/k norms act per head, and the layer index rides with the (replicated) hidden state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fiddlejax.adaptation import dropout
from fiddlejax.memory import names
from fiddlejax.parallel.ops import Ops
from fiddlejax.staged import vocab_parallel

from . import families, hf, hf_io, moe_loss, rope
from .common import (
    Message,
    RMSNorm,
    activation,
    annotated,
    attention,
    batch_sides,
    embedding,
    next_token_loss,
    param,
    project,
    scan_layers,
    side_inputs,
    stacked,
    target_mask,
    vocab_rows,
)
from .decoder_config import ACTIVATIONS, LAYER_TYPES, DecoderConfig  # noqa: F401 - re-exported
from .moe import MoE, MoEOutput


class DecoderBlock(nnx.Module):
    """x + Attn(norm(x)), then x + MLP(norm(x)) (each sub-layer's output normed too with
    ``sandwich_norms``); Meta's names: w1 gate, w3 up, w2 down.

    Tags: Q/K/V projections before rotary, the attention context, the output projection, the
    gate and up projections (both ``MLP_HIDDEN``) and the down projection.
    """

    lora_targets = {"wq": (1, 2), "wk": (1, 2), "wv": (1, 2), "wo": (2, 1), "w1": (1, 1),
                    "w3": (1, 1), "w2": (1, 1)}  # kernel: (input dims, output dims)

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        d, h, kv, dh, f = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                           c.head_dim, c.intermediate_size)
        normal = jax.nn.initializers.normal
        std, out_std = 0.02, 0.02 / (2 * c.num_hidden_layers) ** 0.5  # scaled residual init
        norm = lambda n=d, axis="embed": RMSNorm(n, c.rms_norm_eps, c.norm_plus_one, axis)
        self.attn_norm = norm()
        self.wq = param(rngs, normal(std), (d, h, dh), ("embed", "heads", "head_dim"))
        self.wk = param(rngs, normal(std), (d, kv, dh), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, normal(std), (d, kv, dh), ("embed", "kv_heads", "head_dim"))
        if c.attention_bias:
            self.bq = annotated(jnp.zeros((h, dh)), ("heads", "head_dim"))
            self.bk = annotated(jnp.zeros((kv, dh)), ("kv_heads", "head_dim"))
            self.bv = annotated(jnp.zeros((kv, dh)), ("kv_heads", "head_dim"))
        if c.qk_norm:
            self.q_norm, self.k_norm = norm(dh, "head_dim"), norm(dh, "head_dim")
        self.wo = param(rngs, normal(out_std), (h, dh, d), ("heads", "head_dim", "embed"))
        if c.sandwich_norms:
            self.attn_post_norm = norm()
        self.mlp_norm = norm()
        if c.num_experts:
            self.moe = MoE(c.moe, rngs=rngs, out_std=out_std)
        else:
            self.w1 = param(rngs, normal(std), (d, f), ("embed", "mlp"))
            self.w3 = param(rngs, normal(std), (d, f), ("embed", "mlp"))
            self.w2 = param(rngs, normal(out_std), (f, d), ("mlp", "embed"))
        if c.sandwich_norms:
            self.mlp_post_norm = norm()

    def qkv(self, x: jax.Array, positions: jax.Array | None, kind: str, drop=None):
        """Queries, keys and values of ``x[B, T, d]``: biases, norms and rotary applied;
        ``drop``: the layer's dropout keys (LoRA dropout, :func:`.common.project`)."""
        c = self.config
        q = checkpoint_name(project(self, "wq", x, "btd,dhk->bthk", drop), names.QUERY)
        k = checkpoint_name(project(self, "wk", x, "btd,dhk->bthk", drop), names.KEY)
        v = checkpoint_name(project(self, "wv", x, "btd,dhk->bthk", drop), names.VALUE)
        if c.attention_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv = c.inv_freq(kind)
        return rope.apply_rope(q, inv, positions), rope.apply_rope(k, inv, positions), v

    def attend(self, x: jax.Array, segment_ids, positions, kind: str,
               ops: Ops | None = None, drop=None) -> jax.Array:
        """The attention sub-layer of a layer of type ``kind`` (before the output norm)."""
        c = self.config
        q, k, v = self.qkv(x, positions, kind, drop)
        ctx = attention(q, k, v, causal=True, segment_ids=segment_ids, window=c.window(kind),
                        softcap=c.attn_logit_softcapping, scale=c.attention_scale, ops=ops)
        return checkpoint_name(project(self, "wo", ctx, "bthk,hkd->btd", drop), names.ATTN_OUT)

    def attention(self, x: jax.Array, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None, layer: jax.Array | None = None,
                  ops: Ops | None = None, drop=None) -> jax.Array:
        """Attention of the layer ``layer`` (its index: picks its type), or of the one type."""
        kinds = self.config.kinds
        if len(kinds) == 1 or layer is None:  # one type (or a probe of layer 0 alone)
            return self.attend(x, segment_ids, positions, self.config.layer_types[0], ops, drop)
        table = jnp.asarray([kinds.index(t) for t in self.config.layer_types], jnp.int32)
        branches = [lambda x, s, p, kind=kind: self.attend(x, s, p, kind, ops, drop)
                    for kind in kinds]
        return jax.lax.switch(table[jnp.clip(layer, 0, len(table) - 1)], branches, x,
                              segment_ids, positions)

    def mlp(self, x: jax.Array) -> jax.Array:
        return self.routed_mlp(x)[0]

    def routed_mlp(self, x: jax.Array, ops: Ops | None = None, drop=None
                   ) -> tuple[jax.Array, MoEOutput | None]:
        """The MLP's output, and the MoE layer's routing (None for a dense MLP)."""
        if hasattr(self, "moe"):  # a layer has a MoE only if its MLP is one (DeepSeek's dense)
            out = self.moe(x, ops=ops)
            return out.output, out
        act = ACTIVATIONS[self.config.hidden_act]
        gate = checkpoint_name(project(self, "w1", x, "...d,df->...f", drop), names.MLP_HIDDEN)
        up = checkpoint_name(project(self, "w3", x, "...d,df->...f", drop), names.MLP_HIDDEN)
        return checkpoint_name(project(self, "w2", act(gate) * up, "...f,fd->...d", drop),
                               names.MLP_OUT), None

    def residual(self, x: jax.Array, attn: jax.Array) -> jax.Array:
        """The rest of the layer once its attention output ``attn`` is known."""
        return self.routed_residual(x, attn)[0]

    def routed_residual(self, x: jax.Array, attn: jax.Array, ops: Ops | None = None,
                        drop=None):
        """:meth:`residual` and the MLP's routing (None for a dense MLP)."""
        if self.config.sandwich_norms:
            x = x + self.attn_post_norm(attn)
            y, routed = self.routed_mlp(self.mlp_norm(x), ops, drop)
            return x + self.mlp_post_norm(y), routed
        x = x + attn
        y, routed = self.routed_mlp(self.mlp_norm(x), ops, drop)
        return x + y, routed

    def __call__(self, msg: Message, ops: Ops | None = None) -> Message:
        return self.routed(msg, ops)[0]

    def routed(self, msg: Message, ops: Ops | None = None) -> tuple[Message, jax.Array | None]:
        """The layer on a message, and its router logits ``[B, T, E]`` (None if dense);
        ``ops``: what the layout offers (:class:`fiddlejax.parallel.ops.Ops`); a message
        carrying dropout ``keys`` (a training step with LoRA dropout) gives this layer's
        (:class:`fiddlejax.adaptation.dropout.LayerKeys`) to its projections."""
        x, layer = msg.x, msg.layer
        drop = None if msg.keys is None else dropout.LayerKeys(msg.keys, layer)
        x, routed = self.routed_residual(
            x, self.attention(self.attn_norm(x), msg.segment_ids, msg.positions, layer, ops,
                              drop), ops, drop)
        msg = msg._replace(x=x, layer=None if layer is None else layer + 1)
        if routed is None:
            return msg, None
        return msg._replace(tally=moe_loss.accumulate(msg.tally, routed)), routed.router_logits


class Decoder(nnx.Module):
    """A decoder-only language model of any family :mod:`.families` reads."""

    stack = "blocks"  # the attribute holding the stacked layers
    vocab_services = True  # prologue/head/loss take ops (ops.vocab: compute.vocab's slices)
    dropout_seed: int | None = None  # LoRA dropout's seed (finetune.lora.add sets it)
    dropout_keys = True  # its layers take per-example dropout keys (LoRA dropout)

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        normal = jax.nn.initializers.normal
        self.embed = param(rngs, normal(0.02), (c.vocab_size, c.hidden_size), ("vocab", "embed"))
        self.blocks = stacked(c.num_hidden_layers, lambda r: DecoderBlock(c, rngs=r), rngs)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_plus_one)
        if not c.tie_word_embeddings:
            self.lm_head = param(rngs, normal(0.02), (c.hidden_size, c.vocab_size),
                                 ("embed", "vocab"))

    def embed_tokens(self, tokens: jax.Array, ops: Ops | None = None) -> jax.Array:
        """Token embeddings (times sqrt(hidden) for Gemma)."""
        x, c = embedding(self.embed[...], tokens, ops), self.config
        return x * jnp.asarray(c.hidden_size ** 0.5, x.dtype) if c.scale_embeddings else x

    def message(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                positions: jax.Array | None = None, ops: Ops | None = None,
                keys: jax.Array | None = None) -> Message:
        """The message entering layer 0: the embeddings, the segment ids and positions of
        packed documents, layer 0's index (several layer types, or dropout ``keys``), (MoE) an
        empty tally and the per-example dropout ``keys`` (``[B, 2]``, a training step's)."""
        segment_ids, positions = side_inputs(tokens, segment_ids, positions)
        c = self.config
        return Message(
            self.embed_tokens(tokens, ops), segment_ids, positions,
            layer=jnp.zeros((), jnp.int32) if len(c.kinds) > 1 or keys is not None else None,
            tally=moe_loss.empty(tokens.shape, c.num_experts) if c.num_experts else None,
            keys=keys)

    def prologue(self, batch: dict, ops: Ops | None = None) -> Message:
        """The message of ``batch``; a training step of a model with LoRA dropout
        (``dropout_seed`` set) carries each row's step and example index in the batch
        (:mod:`fiddlejax.adaptation.dropout`), folded here into per-example keys."""
        keys = (None if self.dropout_seed is None
                else dropout.example_keys(self.dropout_seed, batch))
        return self.message(batch["tokens"][:, :-1], *batch_sides(batch), ops=ops, keys=keys)

    def head(self, msg: Message | jax.Array, ops: Ops | None = None):
        """Final norm and vocabulary projection (``ops.vocab``: onto this device's slice): the
        logits, or ``(logits, tally)`` with an MoE model's router tally (the loss reads it)."""
        c, tally = self.config, getattr(msg, "tally", None)
        x = vocab_rows(self.norm(activation(msg)), ops)
        tied = c.tie_word_embeddings  # the head is the embedding's transpose
        logits = jnp.einsum("btd,vd->btv", x, self.embed[...]) if tied else x @ self.lm_head[...]
        cap = c.final_logit_softcapping
        logits = logits if cap is None else cap * jnp.tanh(logits / cap)
        return logits if tally is None else (logits, tally)

    @vocab_parallel  # its one-hot cross-entropy takes the head's vocabulary-split logits
    def loss(self, outputs, batch: dict, ops: Ops | None = None):
        """Next-token cross-entropy; an MoE model's ``(logits, tally)`` adds the router losses
        of each sequence (a row; its padding left out), weighted as the row's targets, and
        reports them (``moe_aux_loss``, ``moe_dropped``: the step's metrics)."""
        if not isinstance(outputs, tuple):
            return next_token_loss(outputs, batch, self.config.vocab_size, ops)
        logits, tally = outputs
        c, seg = self.config, batch.get("segment_ids")
        value = next_token_loss(logits, batch, c.vocab_size, ops)
        mask = weights = None
        if seg is not None:
            mask = seg[:, :-1] > 0
        if (targets := target_mask(batch)) is not None:
            weights = jnp.sum(targets, -1).astype(jnp.float32)
        joining = getattr(ops, "context", None)  # a context split's rows join per sequence
        return moe_loss.add_router_losses(value, tally, c.num_experts_per_tok,
                                          c.router_aux_loss_coef, c.router_z_loss_coef, mask,
                                          weights, report=True,
                                          sequences=joining and joining.sequences)

    def router_losses(self, outputs, batch: dict) -> moe_loss.RouterLosses:
        """Each sequence's load-balancing and z losses and dropped choices ``[B]`` (before
        their coefficients) from the head's ``(logits, tally)``."""
        seg = batch.get("segment_ids")
        return moe_loss.sequence_losses(outputs[1], self.config.num_experts_per_tok,
                                        None if seg is None else seg[:, :-1] > 0)

    def batch_spec(self, batch_size: int, batch: dict | None = None) -> dict:
        """``{"tokens": int32[batch_size, seq_len + 1]}``; given a ``batch``, its own length
        (the sequence length is the data's), refused beyond ``max_position_embeddings``."""
        t = self.config.seq_len
        tokens = None if batch is None else batch.get("tokens")
        if tokens is not None and len(getattr(tokens, "shape", ())) == 2:
            t, most = int(tokens.shape[1]) - 1, self.config.max_position_embeddings
            if t > most:
                raise ValueError(f"batch['tokens'] holds {t} positions (+1 target), beyond "
                                 f"max_position_embeddings={most} of {type(self).__name__}; "
                                 f"use sequences of at most {most} tokens")
            t = max(t, 1)
        return {"tokens": jax.ShapeDtypeStruct((batch_size, t + 1), jnp.int32)}

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, output_router_logits: bool = False):
        """Logits ``[B, T, vocab]`` for ``tokens[B, T]``; ``segment_ids`` / ``positions``
        ``[B, T]`` for packed documents (attention stays within a segment). An MoE model with
        ``output_router_logits=True``: ``(logits, router_logits)``, one ``[B * T, E]`` array
        per layer, as transformers returns them."""
        x = self.message(tokens, segment_ids, positions)
        if not output_router_logits:
            out = self.head(scan_layers(self.blocks, x))
            return out[0] if isinstance(out, tuple) else out
        e = self.config.num_experts
        if not e:
            raise ValueError(f"output_router_logits=True: {type(self).__name__} has no router "
                             "(num_experts=0); call it without output_router_logits")
        graphdef, state = nnx.split(self.blocks)
        x, router = jax.lax.scan(lambda h, s: nnx.merge(graphdef, s).routed(h), x, state)
        return self.head(x)[0], tuple(r.reshape(-1, e) for r in router)

    # -- Hugging Face checkpoints (models/hf.py, models/families.py) ---------------------------
    config_class = DecoderConfig
    model_type: str | None = None  # the one config.json model_type a family class reads

    @classmethod
    def config_from_hf(cls, hf_config: dict, seq_len: int | None = None) -> DecoderConfig:
        """The config of a ``config.json`` (a family class refuses another family's)."""
        return cls.config_class(**families.read(hf_config, seq_len, expect=cls.model_type))

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, seq_len: int | None = None,
                        dtype: Any = None, abstract: bool = False, shardings: Any = None,
                        overrides: dict | None = None) -> Decoder:
        """The model of a Hugging Face directory (or a hub id in the local cache:
        ``meta-llama/Llama-3.1-8B``): ``config.json`` and ``model.safetensors`` or sharded
        files with ``model.safetensors.index.json``. Weights load as float32 masters (or
        ``dtype``), each leaf read by the slices its devices hold (``shardings``: see
        :meth:`pretrained_params`); ``save_pretrained`` writes the stored dtype back.
        ``seq_len`` defaults to ``max_position_embeddings``. ``abstract=True``: shapes only
        (then ``trainer.init(model.pretrained_params)``). ``overrides``: config fields the
        checkpoint does not hold (DeepSeek-V3's ``bias_update_speed``)."""
        from fiddlejax.models import hub

        directory = hub.local_dir(directory)
        config, overrides = cls.config_from_hf(hf.read_config(directory), seq_len), overrides or {}
        if bad := sorted(set(overrides) - {f.name for f in dataclasses.fields(config)}):
            raise ValueError(f"overrides={overrides!r}: {type(config).__name__} has no field {bad}")
        config = dataclasses.replace(config, **overrides, source_dir=str(directory))
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        model.pretrained_from = str(directory)
        # every file's header now: a damaged file, a tensor of the wrong shape named at build
        hf.check_shapes(hf_io.sources(directory), config, nnx.state(model, nnx.Param),
                        cls.__name__)
        if not abstract:
            nnx.update(model, model.pretrained_params(shardings, dtype=dtype))
        return model

    def pretrained_params(self, shardings: Any = None, *, directory: str | Path | None = None,
                          dtype: Any = None) -> nnx.State:
        """The source directory's parameters, each leaf placed by ``shardings`` (a tree, a
        function of the leaf's key, or None: the default device), read by its devices' slices."""
        directory = Path(directory or self.pretrained_from)
        return hf.load_params(hf_io.sources(directory), self.config, nnx.state(self, nnx.Param),
                              type(self).__name__, dtype, shardings)

    def save_pretrained(self, directory: str | Path, *, max_shard_size: int | str = "5GB",
                        dtype: str | None = None, tokenizer: Any = "auto",
                        leaves: tuple | None = None) -> None:
        """Write a Hugging Face directory that transformers' class of the family reads:
        ``config.json`` and safetensors, split into ``model-0000i-of-0000n.safetensors`` files
        with an index above ``max_shard_size`` (bytes, or "500MB", "2GiB"), tensor by tensor
        from the (possibly sharded) parameters; every process calls it, process 0 writes.
        ``dtype``: "float32" or "bfloat16"; default: the loaded checkpoint's. ``tokenizer``: a
        tokenizer or ``data.tokenizer`` spec whose files (and ``generation_config.json``) are
        written too; ``"auto"``: the source directory's. ``leaves``: ``(shapes, leaf)``, the
        parameters read one at a time (:func:`fiddlejax.checkpoint.params.param_leaves`)."""
        if leaves is None:
            flat = hf.flat_params(nnx.state(self, nnx.Param))
            leaves = {k: tuple(v.shape) for k, v in flat.items()}, flat.__getitem__
        hf.save_params(directory, leaves[1], leaves[0], self.config,
                       families.write(self.config), max_shard_size,
                       dtype or self.config.checkpoint_dtype)
        from fiddlejax.data import tokenizer as tokenizers
        from fiddlejax.data import tokenizer_files

        found = tokenizers.find(self.config.source_dir) if self.config.source_dir else None
        tokenizer = (found and str(found)) if tokenizer == "auto" else tokenizer
        if jax.process_index() == 0:
            tokenizer_files.save(directory, tokenizer, self.config.max_position_embeddings)


def _family(name: str, model_type: str) -> type[Decoder]:
    cls = type(name, (Decoder,), {"model_type": model_type, "__module__": __name__,
                                  "__doc__": f"The decoder as Hugging Face's {model_type}."})
    cls.__qualname__ = name
    return cls


Mistral = _family("Mistral", "mistral")
Qwen2 = _family("Qwen2", "qwen2")
Qwen3 = _family("Qwen3", "qwen3")
Phi3 = _family("Phi3", "phi3")
Gemma = _family("Gemma", "gemma")
Gemma2 = _family("Gemma2", "gemma2")
Gemma3 = _family("Gemma3", "gemma3_text")
Mixtral = _family("Mixtral", "mixtral")
Qwen3Moe = _family("Qwen3Moe", "qwen3_moe")
FAMILIES: dict[str, type[Decoder]] = {c.model_type: c for c in (
    Mistral, Qwen2, Qwen3, Phi3, Gemma, Gemma2, Gemma3, Mixtral, Qwen3Moe)}
