"""Any model, round three (issue 50): blocks that differ only in attributes the forward never
reads (Mamba2's ``mixer.layer_idx``), and blocks that return a tuple (Mamba2's states): a small
hand-written block shaped like jax-ml/bonsai's Mamba2 (``bonsai/models/mamba2``), exact on
data x tensor and on 1F1B, or refused naming the fix where the split would not be exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from test_any_model import check_exact

import fiddlejax as fj

LAYOUTS = [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 2, 1)]


class Mixer(nnx.Module):
    """Mamba2's mixer, reduced: a projection, a causal scan (the "SSM"), its final state
    returned beside the output; ``layer_idx`` is kept for a cache the training forward lacks."""

    def __init__(self, d: int, layer_idx: int, rngs: nnx.Rngs):
        self.layer_idx = layer_idx
        self.in_proj = nnx.Linear(d, 2 * d, rngs=rngs)
        self.out_proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, cache=None):
        u, gate = jnp.split(self.in_proj(x), 2, axis=-1)
        h = jnp.cumsum(jnp.tanh(u), axis=1) * jax.nn.sigmoid(gate)  # a toy selective scan
        return self.out_proj(h), h[:, -1]


class Block(nnx.Module):
    def __init__(self, d: int, layer_idx: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.mixer = Mixer(d, layer_idx, rngs)

    def __call__(self, x, cache=None):
        y, state = self.mixer(self.norm(x), cache)
        return x + y, state


class Mamba(nnx.Module):
    def __init__(self, n_layers=4, d=16, vocab=32, block=Block, rngs=None):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([block(d, i, rngs) for i in range(n_layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.lm_head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        states = []
        for layer in self.layers:
            h, state = layer(h)
            states.append(state)  # as Mamba2 collects its cache; training drops it
        return self.lm_head(self.norm(h)), states


def ce(outputs, batch):
    logits, _ = outputs
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


TOKENS = {"tokens": jax.random.randint(jax.random.key(0), (8, 9), 0, 32)}


@pytest.mark.parametrize("layout_", LAYOUTS, ids=["data-tensor", "pipe-tensor-1f1b"])
def test_mamba_like_blocks_with_states_and_layer_idx_exact(layout_):
    """layer_idx differs per block and is never read: ignored with a warning; the blocks'
    states are dropped; loss and grads equal the single-device ones."""
    model = Mamba(rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match=r"mixer\.layer_idx = 0 vs \d.*no method besides"):
        trainer = check_exact(model, lambda m: m(TOKENS["tokens"][:, :-1]),
                              fj.next_token(ce), TOKENS, "layers", layout_)
    assert trainer.staged.unit == 1 and trainer.staged.ignored == (("mixer", "layer_idx"),)


def test_attribute_read_through_getattr_is_refused():
    """An attribute that differs and that the forward reads (here by a name no method spells
    out) is refused at the first step, not ignored."""

    class Reader(Mixer):
        def __call__(self, x, cache=None):
            y, state = super().__call__(x, cache)
            return y * getattr(self, "_".join(["layer", "idx"]), 1), state

    class ReadBlock(Block):
        def __init__(self, d, layer_idx, rngs):
            self.norm = nnx.RMSNorm(d, rngs=rngs)
            self.mixer = Reader(d, layer_idx, rngs)

    model = Mamba(block=ReadBlock, rngs=nnx.Rngs(0))
    staged, canonical = fj.split_model(model, fj.next_token(ce), layers="layers")
    with pytest.raises(ValueError, match=r"forward reads \['mixer\.layer_idx'\]"):
        staged.prologue(staged.to_staged(canonical), TOKENS)


def test_attribute_named_in_the_forward_is_refused_before_compiling():
    class Scaled(Mixer):
        def __call__(self, x, cache=None):
            y, state = super().__call__(x, cache)
            return y * (1 + self.layer_idx), state

    class ScaledBlock(Block):
        def __init__(self, d, layer_idx, rngs):
            self.norm = nnx.RMSNorm(d, rngs=rngs)
            self.mixer = Scaled(d, layer_idx, rngs)

    with pytest.raises(ValueError, match=r"block 1 differs from block 0 in mixer\.layer_idx"):
        fj.split_model(Mamba(block=ScaledBlock, rngs=nnx.Rngs(0)), fj.next_token(ce),
                       layers="layers")


def test_state_threaded_into_the_next_block_is_refused():
    class Threaded(Mamba):  # each block gets the previous block's state (LLaDA's key, a cache)
        def __call__(self, tokens):
            h, state = self.embed(tokens), None
            for layer in self.layers:
                h, state = layer(h, state)
            return self.lm_head(self.norm(h)), state

    staged, canonical = fj.split_model(Threaded(rngs=nnx.Rngs(0)), fj.next_token(ce),
                                       layers="layers")
    with pytest.raises(ValueError, match=r"block 1 receives an output of block 0 besides"):
        staged.prologue(staged.to_staged(canonical), TOKENS)


def test_loss_using_the_states_is_refused():
    def with_states(outputs, batch):
        logits, states = outputs
        return ce(outputs, batch) + sum(s.mean() for s in states)

    staged, canonical = fj.split_model(Mamba(rngs=nnx.Rngs(0)), fj.next_token(with_states),
                                       layers="layers")
    with pytest.raises(ValueError, match=r"the loss uses what the blocks return besides"):
        staged.prologue(staged.to_staged(canonical), TOKENS)
