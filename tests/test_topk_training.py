"""Training with top-k sparsified gradient exchange and error feedback (Plan grad_allreduce="topk").

Density 1 is the dense mean exactly; at a small density the error-feedback identity holds (what
the replicas exchanged plus their mean residual is the sum of the true mean gradients), the
exchange is sparse, it composes with tensor parallelism, and the residual survives checkpoints.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, rel_err, tokens

import fiddlejax as fj
from fiddlejax import checkpoint as ckpt
from fiddlejax.collectives import compression
from fiddlejax.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)


def mesh(data, tensor, pipe=1):
    return fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * tensor * pipe])


@pytest.fixture(scope="module")
def model():
    return GPT(CFG, rngs=nnx.Rngs(0))


def test_topk_plan_errors_before_compile():
    for bad in (0, 1.5, -0.1, "1%", True):
        with pytest.raises(ValueError, match=f"topk_density={bad!r} must be a number in"):
            fj.Plan(mesh=mesh(2, 1), grad_allreduce="topk", topk_density=bad)
    with pytest.raises(ValueError, match="'topk' is not supported with a pipeline.*schedule=None"):
        fj.Plan(mesh=mesh(2, 1, pipe=2), schedule="1f1b", grad_allreduce="topk")
    with pytest.raises(ValueError, match="topk_on='weights' must be 'gradients' or 'updates'"):
        fj.Plan(mesh=mesh(2, 1), grad_allreduce="topk", topk_on="weights")
    with pytest.raises(ValueError, match="zero=1 .* topk_on='updates' keeps one per data"):
        fj.Plan(mesh=mesh(2, 1), grad_allreduce="topk", topk_on="updates", zero=1)
    plan = fj.Plan(mesh=mesh(2, 1), grad_allreduce="topk")
    assert plan.topk_density == 0.01 and plan.describe()["topk_density"] == 0.01


def test_topk_density_one_trains_like_xla(model):
    """Sending every entry is the dense all-reduce: same losses and parameters as psum."""
    batches = [tokens(200 + i, 8, CFG.seq_len, CFG.vocab_size) for i in range(4)]
    opt = optax.adamw(1e-2)

    def run(**kw):
        trainer = fj.parallelize(model, opt, fj.Plan(mesh=mesh(4, 1), **kw))
        state, losses = trainer.init(), []
        for b in batches:
            state, m = trainer.step(state, b)
            losses.append(float(m["loss"]))
        return np.array(losses), trainer.params(state), state

    dense, dense_params, dense_state = run(grad_allreduce="xla")
    topk, topk_params, topk_state = run(grad_allreduce="topk", topk_density=1.0)
    np.testing.assert_allclose(topk, dense, rtol=1e-6)
    # four AdamW steps on sums taken in another order: float32 rounding, up to 1.2e-6 a leaf
    # with XLA's CPU codegen of the suite (tests/conftest.py), under the project's 1e-5
    assert_close(topk_params, dense_params, 1e-5)
    assert dense_state.residual is None  # other plans keep their TrainState leaves unchanged
    assert max(float(abs(x).max()) for x in jax.tree.leaves(topk_state.residual)) == 0


def test_topk_error_feedback_identity_on_data_x_tensor(model, tmp_path):
    """On (data=2, tensor=2) at 5%: with SGD, (p0 - pT) / lr is the sum of the exchanged
    gradients; plus the replicas' mean residual it equals the sum of the exact mean gradients.
    Each exchanged leaf has at most data * k nonzeros, and the residual checkpoints exactly."""
    lr, density, data = 0.1, 0.05, 2
    trainer = fj.parallelize(model, optax.sgd(lr), fj.Plan(
        mesh=mesh(data, 2), grad_allreduce="topk", topk_density=density))
    state = trainer.init()
    p0 = trainer.params(state)
    total, prev = jax.tree.map(np.zeros_like, p0), p0
    for i in range(3):
        b = tokens(300 + i, 8, CFG.seq_len, CFG.vocab_size)
        _, g = trainer.loss_and_grads(state, b)  # the exact mean gradient at these params
        total = jax.tree.map(lambda t, x: t + np.asarray(x), total, g)
        state, _ = trainer.step(state, b)
        now = trainer.params(state)
        for a, c in zip(jax.tree.leaves(prev), jax.tree.leaves(now)):
            assert 0 < np.count_nonzero(np.asarray(a) - np.asarray(c)) <= data * (
                compression.num_kept(a.size, density))
        prev = now
    canonical = trainer.to_canonical_state(state)
    for r, s in zip(jax.tree.leaves(state.residual), jax.tree.leaves(trainer.residual_shardings)):
        assert r.shape[0] == data and r.sharding.is_equivalent_to(s, r.ndim)
    mean_residual = jax.tree.map(lambda r: np.asarray(r).mean(0), canonical.residual)
    assert rel_err(mean_residual, total) > 0.1  # most of the gradient is still owed
    sent = jax.tree.map(lambda a, c: (np.asarray(a) - np.asarray(c)) / lr, p0, prev)
    assert rel_err(jax.tree.map(np.add, sent, mean_residual), total) < 1e-4

    with ckpt.CheckpointManager(tmp_path, trainer) as m:
        m.save(3, state)
    with ckpt.CheckpointManager(tmp_path, trainer) as m:
        restored = m.restore()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_topk_on_updates_keeps_an_optimizer_state_per_replica(model):
    """topk_on="updates": each replica's AdamW state has a leading data dimension, the replicas'
    states differ after a step (local gradients), the update is sparse, and the state converts
    to the canonical layout and back bit for bit."""
    data, density = 2, 0.05
    trainer = fj.parallelize(model, optax.adamw(1e-2), fj.Plan(
        mesh=mesh(data, 1), grad_allreduce="topk", topk_density=density, topk_on="updates"))
    state = trainer.init()
    p0 = trainer.params(state)
    state, m = trainer.step(state, tokens(400, 8, CFG.seq_len, CFG.vocab_size))
    assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
    mu = state.opt_state[0].mu["blocks"]["w1"][...]
    assert mu.shape[0] == data and not np.array_equal(mu[0], mu[1])
    for a, c in zip(jax.tree.leaves(p0), jax.tree.leaves(trainer.params(state))):
        changed = np.count_nonzero(np.asarray(a) != np.asarray(c))
        assert 0 < changed <= data * compression.num_kept(a.size, density)
    back = trainer.from_canonical_state(trainer.to_canonical_state(state))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
