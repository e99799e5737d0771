"""16-bit parameters (a bf16 model, e.g. a checkpoint kept in bf16 to halve its state): every
exchange trains it. The runtime accumulates and reduces gradients in float32 whatever the
parameters' dtype, then rounds each to its parameter's dtype (``state.in_param_dtypes``), as
``jax.grad`` would give it, so AdamW's moments stay bf16; before, the first step failed with a
``lax.cond`` dtype mismatch (float32 moments from float32 gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import BF16, assert_loss_and_grads, reference_loss_and_grads, tokens

import fiddlejax as fj
from fiddlejax.models.llama import Llama, LlamaConfig

SEQ, VOCAB = 16, 64


@pytest.fixture(scope="module")
def models():
    """The bf16 model and the same (bf16-rounded) weights in float32, the reference's."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      seq_len=SEQ)
    half, full = Llama(cfg, rngs=nnx.Rngs(0)), Llama(cfg, rngs=nnx.Rngs(0))
    weights = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(half, nnx.Param))
    nnx.update(half, weights)
    nnx.update(full, jax.tree.map(lambda x: x.astype(jnp.float32), weights))
    return half, full


@pytest.mark.parametrize("axes,kw", [
    (dict(data=4, tensor=2), dict(zero=1)),
    (dict(data=2, pipe=2, tensor=2), dict(zero=3, microbatches=2)),
    (dict(data=2, pipe=2, tensor=2), dict(schedule="2bw", microbatches=2)),
], ids=["zero1", "1f1b-zero3", "2bw"])
def test_bf16_parameters_train_with_bf16_state_on_every_exchange(models, axes, kw):
    """Gradients in bf16, every leaf within bf16 error of the float32 single-device reference
    at the same weights; three AdamW steps keep parameters and moments bf16 and lower the loss
    (2BW's second step still sees the first weights: one-step-stale gradients)."""
    half, full = models
    batch = tokens(1, 8, SEQ, VOCAB)
    trainer = fj.parallelize(half, optax.adamw(1e-2), fj.Plan(mesh=fj.make_mesh(**axes), **kw))
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    assert_loss_and_grads((loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads)),
                          reference_loss_and_grads(full, batch), BF16)
    losses = []
    for _ in range(3):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    kept = {x.dtype for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim}
    assert kept == {jnp.dtype(jnp.bfloat16)}
    assert int(metrics["nonfinite_skipped"]) == 0
    np.testing.assert_allclose(losses[0], float(loss), rtol=1e-6)
    assert losses[2] < losses[0]


def test_the_job_trains_bf16_parameters():
    """``model.param_dtype=bfloat16`` in the job: parameters and AdamW's moments bf16 from
    init, kept so through steps with the job's clip and schedule, the loss finite and falling
    on a repeated batch."""
    from fiddlejax.app import config, train

    cfg = config.load(None, [
        "run.cpu_devices=0", "mesh.data=4", "mesh.pipe=1", "mesh.tensor=2",
        "plan.schedule=null", "plan.microbatches=1", "plan.zero=3", "model.name=llama",
        "model.param_dtype=bfloat16",
        "model.seq_len=16", "model.d_model=32", "model.n_layers=2", "model.d_ff=64",
        "data.batch_size=8", "optimizer.warmup_steps=1", "checkpoint.dir=null"])
    job = train._start(cfg)
    state = job.trainer.init(job.loader)
    half = jnp.dtype(jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {half}
    batch, losses = next(job.data.train), []
    for _ in range(3):
        state, metrics = job.trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim} == {half}
    assert np.isfinite(losses).all() and losses[2] < losses[0]
