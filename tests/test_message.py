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
