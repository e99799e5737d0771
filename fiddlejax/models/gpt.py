"""GPT: a decoder-only, pre-LayerNorm transformer with learned positions.

Stage declaration (what fiddlejax's layouts build on):
- ``prologue(batch)``: token + position embedding of ``tokens[:, :-1]``;
- ``blocks``: ``n_layers`` identical :class:`~models.common.Block`s stacked on a leading axis;
- ``head(x)``: final LayerNorm and the vocabulary projection (tied to the embedding if asked);
- ``loss(logits, batch)``: mean next-token cross-entropy against ``tokens[:, 1:]``.

Packed documents: ``model(tokens, segment_ids=..., positions=...)`` (and batches carrying
``segment_ids`` / ``positions``, int32 like ``tokens``) embed each token at its position within
its document, attend only within the document, and the loss is ``(sum, count)`` over the targets
that continue their document (:func:`~models.common.next_token_loss`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from .common import (
    Block,
    LayerNorm,
    Message,
    activation,
    batch_sides,
    next_token_loss,
    param,
    scan_layers,
    side_inputs,
    stacked,
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 512
    tie_embeddings: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        for f in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{f}={v!r} must be a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")


class GPT(nnx.Module):
    stack = "blocks"  # the attribute holding the stacked layers

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        normal = jax.nn.initializers.normal
        self.wte = param(rngs, normal(0.02), (c.vocab_size, c.d_model), ("vocab", "embed"))
        self.wpe = param(rngs, normal(0.01), (c.seq_len, c.d_model), ("seq", "embed"))
        self.blocks = stacked(
            c.n_layers,
            lambda r: Block(
                c.d_model, c.n_heads, c.d_ff, causal=True, dropout=c.dropout,
                n_layers=c.n_layers, rngs=r,
            ),
            rngs,
        )
        self.ln_f = LayerNorm(c.d_model)
        if not c.tie_embeddings:
            self.lm_head = param(rngs, normal(0.02), (c.d_model, c.vocab_size), ("embed", "vocab"))

    def embed(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
              positions: jax.Array | None = None) -> Message:
        """Token + position embeddings; with segment ids or positions, the message also
        carries them (int32) for the blocks."""
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.config.seq_len}")
        x = jnp.take(self.wte[...], tokens, axis=0)
        segment_ids, positions = side_inputs(tokens, segment_ids, positions)
        if segment_ids is None:
            return Message(x + self.wpe[...][:t])
        x = x + jnp.take(self.wpe[...], positions, axis=0)
        return Message(x, segment_ids, positions)

    def prologue(self, batch: dict) -> Message:
        return self.embed(batch["tokens"][:, :-1], *batch_sides(batch))

    def head(self, msg: Message | jax.Array) -> jax.Array:
        x = self.ln_f(activation(msg))
        if self.config.tie_embeddings:
            return jnp.einsum("btd,vd->btv", x, self.wte[...])
        return x @ self.lm_head[...]

    def loss(self, logits: jax.Array, batch: dict):
        return next_token_loss(logits, batch, self.config.vocab_size)

    def batch_spec(self, batch_size: int) -> dict:
        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.config.seq_len + 1), jnp.int32)}

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, T, vocab]`` for ``tokens[B, T]``; ``segment_ids`` / ``positions``
        ``[B, T]`` for packed documents (attention stays within a segment)."""
        return self.head(scan_layers(self.blocks, self.embed(tokens, segment_ids, positions)))
