"""A pytree message between layers and stages: integers travel as int32, statistics as float32.

A layer takes and returns a message of one structure: here the activation (float32), the
packed batch's segment ids and positions (int32, read by every layer, never differentiated)
and a per-row statistic each layer adds to (float32, differentiated: the loss reads it). Every
schedule moves that message, stashes it and sends its cotangent back, with the loss and
gradients of one device.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads, reference_loss_and_grads

import fiddlejax as fj
from fiddlejax import message

D, T, V = 16, 8, 32


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Linear(D, D, rngs=rngs)
        self.r = nnx.Param(jax.random.normal(rngs.params(), (D,)) * 0.1)

    def __call__(self, msg: dict) -> dict:
        x, seg, pos = msg["x"], msg["segment_ids"], msg["positions"]
        # attention-like mixing inside a segment, so the integers matter
        same = (seg[:, :, None] == seg[:, None, :]) & (pos[:, :, None] >= pos[:, None, :])
        mix = jnp.where(same, 1.0, 0.0) / jnp.maximum(same.sum(-1, keepdims=True), 1)
        x = x + jnp.tanh(self.w(mix @ x))
        stat = msg["stat"] + jnp.mean(x @ self.r, axis=-1)  # [B]: a per-row tally
        return {**msg, "x": x, "stat": stat}


class Model(nnx.Module):
    """The explicit staged protocol with a dict message."""

    stack = "layers"

    def __init__(self, n_layers, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(r):
            return Layer(r)

        self.layers = make(rngs)
        self.out = nnx.Linear(D, V, rngs=rngs)

    def prologue(self, batch):
        tokens = batch["tokens"][:, :-1]
        return {"x": self.embed(tokens), "segment_ids": batch["segment_ids"][:, :-1],
                "positions": batch["positions"][:, :-1],
                "stat": jnp.zeros(tokens.shape[:1], jnp.float32)}

    def head(self, msg):
        return self.out(msg["x"]), msg["stat"]

    def loss(self, outputs, batch):
        logits, stat = outputs
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        return ce.mean() + 0.01 * jnp.mean(stat ** 2)


def packed_batch(rows=8, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(k1, (rows, T + 1), 0, V)
    cut = jax.random.randint(k2, (rows, 1), 2, T)  # two documents per row
    cols = jnp.arange(T + 1)[None]
    seg = jnp.where(cols < cut, 1, 2).astype(jnp.int32)
    pos = jnp.where(cols < cut, cols, cols - cut).astype(jnp.int32)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def plan(data, pipe, tensor, **kw):
    mesh = fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])
    return fj.Plan(mesh=mesh, **kw)


@pytest.fixture(scope="module")
def reference():
    model, batch = Model(4, nnx.Rngs(0)), packed_batch()
    return model, batch, reference_loss_and_grads(model, batch)


@pytest.mark.parametrize("kind,mesh,v", [
    ("1f1b", (1, 2, 1), 1),
    ("interleaved-1f1b", (2, 2, 1), 2),
    ("zb-h1", (1, 4, 1), 1),   # split backward: I keeps the message's cotangents for W
    (None, (8, 1, 1), 1),      # no pipeline: the scan over layers carries the message
])
def test_a_dict_message_trains_like_one_device(reference, kind, mesh, v):
    model, batch, (ref_loss, ref_grads) = reference
    kw = {"schedule": kind, "microbatches": 4, "virtual_stages": v} if kind else {}
    trainer = fj.parallelize(model, optax.adamw(1e-3), plan(*mesh, **kw))
    loss, grads = trainer.loss_and_grads(trainer.init(), batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))


def test_integer_leaves_get_zero_cotangents_of_their_own_dtype():
    msg = {"x": jnp.ones((2, 3)), "ids": jnp.arange(6, dtype=jnp.int32).reshape(2, 3)}
    ct = message.to_vjp(msg)
    assert ct["ids"].dtype == jax.dtypes.float0 and ct["x"].dtype == jnp.float32
    back = message.from_vjp(ct, msg)
    assert back["ids"].dtype == jnp.int32 and not back["ids"].any()
    assert (back["x"] == 1).all()


def test_a_layer_that_changes_its_message_is_refused_by_name():
    x = {"x": jnp.ones((2, 3)), "ids": jnp.zeros((2, 3), jnp.int32)}
    with pytest.raises(ValueError, match=r"\['ids'\]: int32\[2, 3\]"):
        message.check_layer({"x": x["x"], "ids": x["ids"].astype(jnp.float32)}, x)


class PosBlock(nnx.Module):
    """A user's block reading an int32 side input: positions past 256, exact only as integers."""

    def __init__(self, rngs):
        self.w = nnx.Linear(D, D, rngs=rngs)
        self.pe = nnx.Embed(1024, D, rngs=rngs)

    def __call__(self, x, positions):
        return x + 0.5 * jnp.tanh(self.w(x)) + 0.1 * self.pe(positions)


class PosModel(nnx.Module):
    """An unmodified NNX model (no staged protocol): adapted by ``layers="blocks"``."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([PosBlock(rngs) for _ in range(4)])
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens, positions):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.out(x)


def pos_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def pos_batch(rows=8):
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    return {"tokens": jax.random.randint(k1, (rows, T), 0, V),
            "positions": jax.random.randint(k2, (rows, T), 700, 1024),
            "labels": jax.random.randint(k3, (rows, T), 0, V)}


def test_an_adapted_models_side_inputs_travel_in_their_own_dtype():
    """The message of a user's model is a pytree: its int32 side input stays int32 (it once
    rode in the activation's dtype, and bf16 compute refused integers above 256)."""
    model, batch = PosModel(nnx.Rngs(0)), pos_batch()
    staged, params = fj.split_model(model, pos_loss, layers="blocks")
    msg = staged.prologue(staged.to_staged(params), batch)  # shapes checked once, then packed
    assert msg["x"].dtype == jnp.float32 and msg["x"].shape == (8, T, D)
    (pos,) = msg["side"]
    assert pos.dtype == jnp.int32 and (pos == batch["positions"]).all()

    def ref(m):
        return pos_loss(m(batch["tokens"], batch["positions"]), batch)

    want = nnx.value_and_grad(ref)(model)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan(2, 2, 1, schedule="1f1b",
                                                         microbatches=2),
                             layers="blocks", loss=pos_loss)
    assert_loss_and_grads(trainer.loss_and_grads(trainer.init(), batch),
                          (want[0], nnx.state(want[1], nnx.Param)))
    bf16 = fj.parallelize(model, optax.sgd(0.1), plan(1, 2, 1, schedule="1f1b", microbatches=2,
                                                      compute_dtype="bfloat16"),
                          layers="blocks", loss=pos_loss)
    assert abs(float(bf16.loss_and_grads(bf16.init(), batch)[0]) - float(want[0])) < 2e-2
