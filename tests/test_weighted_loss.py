"""Losses are exact on every layout: token-weighted means and vocabularies that `tensor` pads.

A weighted loss returns ``(sum, weight)``; fiddlejax sums both over microbatches and data shards
before dividing, so padded batches give the single-device weighted mean. A vocabulary that does
not divide ``tensor`` is padded for sharding, and the outputs are sliced back before any loss
sees them, so a user's own loss (which knows nothing of the padding) stays exact.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads

import fiddlejax as fj
from fiddlejax.models.gpt import GPT, GPTConfig

PAD = 0
# Vocabulary 63 divides no tensor size above 1: the plan pads it to 64.
CFG = GPTConfig(vocab_size=63, seq_len=12, d_model=32, n_heads=4, n_layers=4, d_ff=64)


def token_weighted(logits, batch):
    """A user's loss, written as for one device: mean cross-entropy over non-padding targets."""
    targets = batch["tokens"][:, 1:]
    mask = (targets != PAD).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return (ce * mask).sum(), mask.sum()


def padded_batch(rows=16, seed=0):
    """Rows of very different lengths, padded at the end: shards hold unequal token counts."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, CFG.vocab_size, (rows, CFG.seq_len + 1)).astype(np.int32)
    lengths = rng.integers(2, CFG.seq_len + 2, rows)
    lengths[: rows // 2] = 2  # the first shards are nearly all padding
    for r, n in enumerate(lengths):
        toks[r, n:] = PAD
    return {"tokens": toks}


@pytest.fixture(scope="module")
def reference():
    model = GPT(CFG, rngs=nnx.Rngs(3))
    batch = padded_batch()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(graphdef, p, rest, copy=True)
        return fj.mean_loss(token_weighted(m(batch["tokens"][:, :-1]), batch))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return model, batch, float(value), grads


LAYOUTS = [  # (data, pipe, tensor, schedule, microbatches, virtual stages)
    (4, 1, 2, None, 2, 1),
    (8, 1, 1, None, 1, 1),
    (4, 2, 1, "1f1b", 2, 1),
    (2, 2, 2, "1f1b", 2, 1),
    (2, 2, 2, "interleaved-1f1b", 4, 2),
    (1, 4, 2, "zb-h1", 4, 1),
    (1, 2, 2, "zb-v", 4, 2),
]


@pytest.mark.parametrize("data,pipe,tensor,schedule,m,v", LAYOUTS)
def test_weighted_loss_and_padded_vocab_match_single_device(reference, data, pipe, tensor,
                                                            schedule, m, v):
    model, batch, ref_loss, ref_grads = reference
    mesh = fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])
    plan = fj.Plan(mesh=mesh, schedule=schedule or None, microbatches=m, virtual_stages=v)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan, loss=token_weighted)
    state = trainer.init()
    if tensor > 1:
        assert state.params["wte"][...].shape[0] == 64  # padded internally
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    if schedule is None:  # (a pipeline's loss runs the same program as loss_and_grads)
        assert abs(float(trainer.loss(state, batch)) - ref_loss) / ref_loss < 1e-5


def test_mean_of_shard_means_differs_here():
    """Why the pair exists: on this batch a per-shard mean would be wrong, not just rounded."""
    batch = padded_batch()
    mask = batch["tokens"][:, 1:] != PAD
    counts = mask.reshape(8, -1).sum(1)
    assert counts.max() > 2 * counts.min()


def test_loss_must_return_a_scalar_or_a_pair(reference):
    model, batch, *_ = reference
    mesh = fj.make_mesh(data=2, devices=jax.devices()[:2])

    def per_token(logits, b):
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["tokens"][:, 1:])

    trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=mesh), loss=per_token)
    with pytest.raises(TypeError, match=r"scalar .* or a pair .*shapes \(8, 12\)"):
        trainer.loss_and_grads(trainer.init(), batch)


def test_mean_loss():
    assert float(fj.mean_loss((jnp.float32(6.0), jnp.float32(3.0)))) == 2.0
    assert float(fj.mean_loss(jnp.float32(1.5))) == 1.5
