"""Shared test helpers: single-device references and relative errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` over all leaves of two trees with the same structure."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (
        f"{jax.tree.structure(a)} != {jax.tree.structure(b)}"
    )
    fa = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)])
    fb = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fb))


def reference_loss_fn(model: nnx.Module):
    """The plain single-device loss of ``model`` as a function of its parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, batch):
        m = nnx.merge(graphdef, p, rest, copy=True)
        from fiddlejax.staged import mean_loss

        return mean_loss(m.loss(m.head(_scan(m, m.prologue(batch))), batch))

    return loss, params


def _scan(m, x):
    from fiddlejax.models.common import scan_layers

    return scan_layers(getattr(m, m.stack), x)


def reference_loss_and_grads(model: nnx.Module, batch: dict):
    loss, params = reference_loss_fn(model)
    return jax.jit(jax.value_and_grad(loss))(params, batch)


def reference_train(model: nnx.Module, optimizer: optax.GradientTransformation, batches):
    """Plain single-device optax training; returns the losses and final parameters."""
    loss, params = reference_loss_fn(model)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(p, s, b):
        value, g = jax.value_and_grad(loss)(p, b)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    losses = []
    for b in batches:
        params, opt_state, loss_value = step(params, opt_state, b)
        losses.append(float(loss_value))
    return losses, params


def tokens(seed: int, batch: int, seq_len: int, vocab: int) -> dict:
    t = jax.random.randint(jax.random.key(seed), (batch, seq_len + 1), 0, vocab, jnp.int32)
    return {"tokens": np.asarray(t)}


def assert_trains_like_single_device(trainer, model, optimizer, batches, check_grads=True):
    """Loss and gradients of the first batch, then losses and parameters after stepping through
    ``batches``, equal plain single-device training (relative error < 1e-5)."""
    state = trainer.init()
    if check_grads:
        ref_loss, ref_grads = reference_loss_and_grads(model, batches[0])
        loss, grads = trainer.loss_and_grads(state, batches[0])
        assert abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)) < 1e-5
        assert rel_err(grads, ref_grads) < 1e-5
    assert_steps_match(trainer, state, batches, *reference_train(model, optimizer, batches))


def assert_steps_match(trainer, state, batches, ref_losses, ref_params):
    """Stepping ``trainer`` from ``state`` through ``batches`` gives the reference losses and
    final parameters (relative error < 1e-5)."""
    losses = []
    for b in batches:
        state, metrics = trainer.step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert rel_err(trainer.params(state), ref_params) < 1e-5
