"""BERT: a bidirectional pre-LayerNorm transformer encoder trained with a masked-LM loss.

Stage declaration: ``prologue`` embeds ``batch["inputs"]``, ``blocks`` are stacked encoder
layers, ``head`` is the final LayerNorm plus a dense MLM projection, and ``loss`` is the mean
cross-entropy over the masked positions (``batch["weights"]``). Every sequence masks the same
number of positions (:func:`mlm_batch`), so per-microbatch means average to the global mean.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .common import (
    Block,
    LayerNorm,
    Message,
    activation,
    annotated,
    cross_entropy,
    param,
    scan_layers,
    stacked,
)


@dataclasses.dataclass(frozen=True)
class BERTConfig:
    vocab_size: int = 257  # 256 bytes + the [MASK] token (id vocab_size - 1)
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 512
    mask_rate: float = 0.15

    @property
    def mask_id(self) -> int:
        return self.vocab_size - 1

    @property
    def masked_per_sequence(self) -> int:
        return max(1, round(self.mask_rate * self.seq_len))


class BERT(nnx.Module):
    stack = "blocks"

    def __init__(self, config: BERTConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        normal = jax.nn.initializers.normal
        self.wte = param(rngs, normal(0.02), (c.vocab_size, c.d_model), ("vocab", "embed"))
        self.wpe = param(rngs, normal(0.01), (c.seq_len, c.d_model), ("seq", "embed"))
        self.blocks = stacked(
            c.n_layers,
            lambda r: Block(c.d_model, c.n_heads, c.d_ff, causal=False, dropout=0.0,
                            n_layers=c.n_layers, rngs=r),
            rngs,
        )
        self.ln_f = LayerNorm(c.d_model)
        self.mlm = param(rngs, normal(0.02), (c.d_model, c.vocab_size), ("embed", "vocab"))
        self.mlm_bias = annotated(jnp.zeros((c.vocab_size,)), ("vocab",))

    def prologue(self, batch: dict) -> Message:
        tokens = batch["inputs"]
        return Message(jnp.take(self.wte[...], tokens, axis=0) + self.wpe[...][: tokens.shape[1]])

    def head(self, msg: Message) -> jax.Array:
        bias = self.mlm_bias[...]
        return self.ln_f(activation(msg)) @ self.mlm[...] + bias

    def loss(self, logits: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
        """Token-weighted: (summed loss of the masked positions, their count). fiddlejax sums
        both over microbatches and data shards before dividing, so the masked-LM loss is the
        mean over the whole batch's masked tokens however it is split."""
        ce = cross_entropy(logits, batch["targets"], self.config.vocab_size)
        w = batch["weights"]
        return (ce * w).sum(), w.sum()

    def batch_spec(self, batch_size: int) -> dict:
        shape = (batch_size, self.config.seq_len)
        return {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
                "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
                "weights": jax.ShapeDtypeStruct(shape, jnp.float32)}

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return self.head(scan_layers(self.blocks, self.prologue({"inputs": inputs})))


def mlm_batch(tokens: np.ndarray, config: BERTConfig, seed: int, first_row: int = 0,
              global_rows: int | None = None) -> dict:
    """Mask exactly ``config.masked_per_sequence`` positions of each row of ``tokens[B, T]``.

    Masked positions become ``[MASK]`` in ``inputs``; ``targets`` keeps the originals and
    ``weights`` is 1 at masked positions. A process holding rows ``first_row ..`` of a global
    batch of ``global_rows`` gets those rows' masks, the same however many processes share it.
    """
    tokens = np.asarray(tokens, np.int32)[:, : config.seq_len]
    b, t = tokens.shape
    rng = np.random.default_rng(seed)
    noise = rng.random((global_rows or b, t))[first_row:first_row + b]
    pos = np.argsort(noise, axis=1)[:, : config.masked_per_sequence]
    weights = np.zeros((b, t), np.float32)
    np.put_along_axis(weights, pos, 1.0, axis=1)
    inputs = np.where(weights > 0, config.mask_id, tokens).astype(np.int32)
    return {"inputs": inputs, "targets": tokens, "weights": weights}


# -- what the fiddlejax train job feeds it (models.REGISTRY["bert"]) --------------------------
VALIDATION_MASK_SEED = 1 << 20  # validation masks come from seeds the training batches never use


class MaskedBatches:
    """BERT's masked-LM batches over a token-batch iterator. Batch n is masked with seed
    ``seed + n``, each process masking its own rows of the global batch. The state (the token
    stream's and n) is checkpointed, so a resumed run sees the batches and masks the
    uninterrupted run would have."""

    def __init__(self, tokens, config: BERTConfig, seed: int, first_row: int = 0,
                 global_rows: int | None = None):
        self.tokens, self.config, self.seed, self.n = tokens, config, seed, 0
        self.rows = {"first_row": first_row, "global_rows": global_rows}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.tokens)
        self.n += 1
        return mlm_batch(np.asarray(batch["tokens"]), self.config, self.seed + self.n,
                         **self.rows)

    def get_state(self) -> dict:
        return {"tokens": self.tokens.get_state(), "batches": self.n}

    def set_state(self, state: dict) -> None:
        self.tokens.set_state(state["tokens"])
        self.n = int(state["batches"])


def masked_batches(cfg: dict, model: BERT, process_index: int, process_count: int):
    """The job's train and validation streams: stdlib-corpus windows of ``model.seq_len``
    bytes, masked per batch (:class:`MaskedBatches`); ids checked against the byte vocabulary
    (the [MASK] id excluded)."""
    from .feed import Batches, token_batches

    b, seed, seq = cfg["data"]["batch_size"], cfg["data"]["seed"], cfg["model"]["seq_len"]
    train, val = token_batches(cfg, seq - 1, model.config.vocab_size - 1, process_index,
                               process_count)  # windows of seq tokens: no shifted targets
    rows = {"first_row": process_index * (b // process_count), "global_rows": b}
    return Batches(MaskedBatches(train, model.config, seed, **rows),
                   MaskedBatches(val, model.config, seed + VALIDATION_MASK_SEED, **rows), b * seq)
