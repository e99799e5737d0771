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


class StateFirst(Block):
    """A block that returns ``(state, activation)``: the activation is not its first array."""

    def __call__(self, x, cache=None):
        y, state = self.mixer(self.norm(x), cache)
        return state, x + y


class StateFirstLM(Mamba):
    def __call__(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            _, h = layer(h)
        return self.lm_head(self.norm(h)), None


def test_block_output_picks_the_activation_of_a_block():
    """``parallelize(block_output=)``: the activation is what it picks (here the second of a
    pair); without it such a block is refused, naming block_output; with it, exact on 1F1B."""
    model = StateFirstLM(block=StateFirst, rngs=nnx.Rngs(0))
    staged, canonical = fj.split_model(model, fj.next_token(ce), layers="layers")
    with pytest.raises(TypeError, match=r"block_output"):
        staged.prologue(staged.to_staged(canonical), TOKENS)
    with pytest.warns(UserWarning, match=r"mixer\.layer_idx"):
        check_exact(model, lambda m: m(TOKENS["tokens"][:, :-1]), fj.next_token(ce), TOKENS,
                    "layers", LAYOUTS[1], block_output=lambda out: out[1])
    with pytest.raises(TypeError, match=r"picks the activation of the blocks at layers="):
        fj.split_model(model, fj.next_token(ce), block_output=lambda out: out[1])


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


def test_attribute_named_in_the_forward_makes_the_blocks_unequal():
    class Scaled(Mixer):
        def __call__(self, x, cache=None):
            y, state = super().__call__(x, cache)
            return y * (1 + self.layer_idx), state

    class ScaledBlock(Block):
        def __init__(self, d, layer_idx, rngs):
            self.norm = nnx.RMSNorm(d, rngs=rngs)
            self.mixer = Scaled(d, layer_idx, rngs)

    with pytest.warns(UserWarning, match=r"repeat in no pattern; they run as unequal blocks"):
        staged, _ = fj.split_model(Mamba(block=ScaledBlock, rngs=nnx.Rngs(0)),
                                   fj.next_token(ce), layers="layers")
    assert staged.num_blocks == 4 and staged.ignored == ()


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


# -- frozen batch statistics: per-block constants ----------------------------------------------
class Residual(nnx.Module):
    """A ResNet basic block in eval mode: conv, frozen BatchNorm, relu, residual."""

    def __init__(self, c: int, rngs: nnx.Rngs):
        self.conv = nnx.Conv(c, c, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(c, use_running_average=True, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(x + self.bn(self.conv(x)))


class Stage(nnx.Module):
    def __init__(self, n_blocks=4, c=8, classes=10, rngs=None):
        self.stem = nnx.Conv(3, c, (3, 3), rngs=rngs)
        self.stem_bn = nnx.BatchNorm(c, use_running_average=True, rngs=rngs)
        self.blocks = nnx.List([Residual(c, rngs) for _ in range(n_blocks)])
        self.head = nnx.Linear(c, classes, rngs=rngs)

    def __call__(self, images):
        x = self.stem_bn(self.stem(images))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def resnet_stage():
    """Statistics far from (0, 1) and different in every block: a block run with another's
    statistics gives another loss."""
    model = Stage(rngs=nnx.Rngs(0))
    rng = jax.random.key(7)
    for _, bn in nnx.iter_graph(model):
        if isinstance(bn, nnx.BatchNorm):
            k1, k2, rng = jax.random.split(rng, 3)
            bn.mean.value = jax.random.normal(k1, bn.mean.shape)
            bn.var.value = jax.random.uniform(k2, bn.var.shape, minval=0.2, maxval=3.0)
    return model


def labels_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


IMAGES = {"images": jax.random.normal(jax.random.key(1), (8, 6, 6, 3)),
          "labels": jax.random.randint(jax.random.key(2), (8,), 0, 10)}


@pytest.mark.parametrize("layout_", LAYOUTS, ids=["data-tensor", "pipe-tensor-1f1b"])
def test_frozen_batch_statistics_are_each_blocks_own(layout_):
    check_exact(resnet_stage(), lambda m: m(IMAGES["images"]), labels_ce, IMAGES, "blocks",
                layout_)


def test_training_mode_batch_statistics_are_refused_with_the_fix():
    model = resnet_stage()
    model.blocks[2].bn.use_running_average = False
    with pytest.raises(ValueError, match=r"\['blocks'\]\[2\]\['bn'\].*use_running_average=True"):
        fj.split_model(model, labels_ce, layers="blocks")


def test_a_block_writing_its_buffer_is_refused():
    class Counting(Residual):  # a buffer the forward updates: not a constant
        def __init__(self, c, rngs):
            super().__init__(c, rngs)
            self.calls = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.calls.value = self.calls.value + 1
            return super().__call__(x)

    model = resnet_stage()
    model.blocks = nnx.List([Counting(8, nnx.Rngs(i)) for i in range(2)])
    staged, canonical = fj.split_model(model, labels_ce, layers="blocks")
    with pytest.raises(ValueError, match=r"forward updates the blocks' non-parameter state"):
        staged.prologue(staged.to_staged(canonical), IMAGES)


# -- a user's annotations combine with inference ----------------------------------------------
def test_annotations_combine_with_inference_exact():
    """Naming the mixer's projections keeps those names and still infers the rest (the
    vocabulary-parallel embedding and head), instead of switching inference off."""
    model = Mamba(n_layers=2, rngs=nnx.Rngs(0))
    fj.sharding.annotate(model, {r"mixer/in_proj/kernel": ("embed", "mlp"),
                                 r"mixer/in_proj/bias": ("mlp",),
                                 r"mixer/out_proj/kernel": ("mlp", "embed")})
    with pytest.warns(UserWarning, match=r"6 parameters keep the names given; fiddlejax "
                                         r"inferred the other"):
        check_exact(model, lambda m: m(TOKENS["tokens"][:, :-1]), fj.next_token(ce), TOKENS,
                    "layers", LAYOUTS[0])
    assert model.layers[1].mixer.in_proj.kernel.get_metadata()["out_sharding"] == (
        "embed", "mlp")
    assert model.embed.embedding.get_metadata()["out_sharding"] == ("vocab", "embed")
