"""Encoder-decoders (issue 50): jax-ml/bonsai's UMT5 (``UMT5Model``, copied unmodified into
``tests/external/bonsai_umt5``) with either stack as the pipelined one.

- ``layers="decoder.block"``: the encoder runs in the prologue and its output reaches every
  decoder block as a side input computed from the parameters, carried with its gradient: every
  block's share of it, from every stage and microbatch, sums back into the encoder's.
- ``layers="encoder.block"``: the decoder runs in the epilogue on the stack's output.

Both exact (every leaf, the encoder's included) on data x tensor and on 1F1B (2, 2, 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_any_model import EXTERNAL, check_exact, load, plan_for

import fiddlejax as fj

LAYOUTS = [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 4, 1)]


def umt5(encoder_layers: int, decoder_layers: int):
    """A small UMT5Model and a batch (a padded encoder input, decoder inputs, targets)."""
    t5 = load(EXTERNAL / "bonsai_umt5" / "modeling.py", "bonsai_umt5_modeling")
    cfg = t5.ModelConfig(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                         num_layers=encoder_layers, num_decoder_layers=decoder_layers,
                         dropout_rate=0.0)
    model = t5.UMT5Model(cfg, rngs=nnx.Rngs(0))
    # Kernels at half their initial scale, as after some training: at init the unscaled T5
    # attention saturates and the float32 reference itself is 2e-5 off float64 (measured);
    # here 1e-6, so a 1e-5 bound checks the split, not the summation order.
    for path, v in nnx.iter_graph(model):
        if path and path[-1] == "kernel":
            v[...] = v[...] * 0.5
    rng = np.random.default_rng(1)
    mask = np.ones((16, 12), np.int32)
    mask[:, 9:] = 0
    mask[5, 3:] = 0
    batch = {"input_ids": jnp.asarray(rng.integers(1, 64, (16, 12)), jnp.int32),
             "attention_mask": jnp.asarray(mask),
             "decoder_input_ids": jnp.asarray(rng.integers(1, 64, (16, 8)), jnp.int32),
             "target": jnp.asarray(rng.normal(size=(16, 8, 16)), jnp.float32)}
    return model, batch


def decoder_loss(hidden, batch):
    """Squared error of the decoder's states (UMT5Model returns them, its lm_head unapplied)."""
    return ((hidden - batch["target"]) ** 2).sum(), float(np.prod(hidden.shape[:2]))


def call(batch):
    return lambda m: m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=batch["decoder_input_ids"])


@pytest.mark.parametrize("layout_", LAYOUTS, ids=lambda t: f"{t[:3]}-{t[3]}")
def test_umt5_decoder_stack_encoder_in_the_prologue(layout_):
    model, batch = umt5(encoder_layers=2, decoder_layers=4)
    trainer = check_exact(model, call(batch), decoder_loss, batch, "decoder.block", layout_)
    side = next(iter(trainer.staged.sides.values()))
    # the causal mask is a constant; the encoder's padding mask and its output are carried
    # (keyword order), the output alone with its gradient
    assert side.learned == (False, True)


def test_umt5_encoder_stack_decoder_in_the_epilogue():
    model, batch = umt5(encoder_layers=4, decoder_layers=2)
    check_exact(model, call(batch), decoder_loss, batch, "encoder.block", LAYOUTS[1])


# -- a learned side input without a batch axis ---------------------------------------------
class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.q, self.kv = nnx.Linear(d, d, rngs=rngs), nnx.Linear(d, 2 * d, rngs=rngs)

    def __call__(self, x, memory, bias):
        k, v = jnp.split(self.kv(memory), 2, axis=-1)
        s = self.q(x + bias) @ k.swapaxes(1, 2) / x.shape[-1] ** 0.5
        return x + jax.nn.softmax(s) @ v


class Tiny(nnx.Module):
    """An encoder (one MLP) and decoder blocks that cross-attend to its output, with a
    learned positional table (no batch axis) as a second side input."""

    def __init__(self, d: int = 8, vocab: int = 16, rngs=None):
        self.encoder = nnx.Sequential(nnx.Linear(d, d, rngs=rngs), jnp.tanh,
                                      nnx.Linear(d, d, rngs=rngs))
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(8, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(4)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, frames, tokens):
        memory = self.encoder(frames)
        bias = self.pos(jnp.arange(tokens.shape[1]))
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, memory, bias)
        return self.head(x)


def tiny_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def test_learned_side_inputs_with_and_without_a_batch_axis():
    model = Tiny(rngs=nnx.Rngs(0))
    k = jax.random.split(jax.random.key(0), 3)
    batch = {"frames": jax.random.normal(k[0], (8, 5, 8)),
             "tokens": jax.random.randint(k[1], (8, 6), 0, 16),
             "labels": jax.random.randint(k[2], (8, 6), 0, 16)}
    trainer = check_exact(model, lambda m: m(batch["frames"], batch["tokens"]), tiny_loss,
                          batch, "blocks", LAYOUTS[1])
    side = next(iter(trainer.staged.sides.values()))
    assert side.learned == (True, True) and side.whole == (False, True)


def test_two_stacks_are_refused_naming_the_choice():
    model, _ = umt5(encoder_layers=2, decoder_layers=2)
    with pytest.raises(ValueError, match=r"one stack.*layers='decoder\.block'.*prologue"):
        fj.parallelize(model, optax.sgd(0.1), plan_for(LAYOUTS[1]), loss=decoder_loss,
                       layers=["encoder.block", "decoder.block"])
