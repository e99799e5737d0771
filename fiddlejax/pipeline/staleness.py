"""A correction for one-step-stale gradients (PipeDream-2BW).

Under 2BW the update applied at step t comes from the gradient at W(t-1). One step later the
optimizer sees the gradient at W(t), the one step t should have used, so the update it makes
then also tells how wrong the previous one was. ``stale_correction`` feeds that error back,
in the spirit of error feedback as Zmushko et al. (2026, "One-Step Gradient Delay is Not a
Barrier for Large-Scale Asynchronous Pipeline Parallel LLM Pretraining") propose for 2BW; the
form here is ours: applied(t) = u(t) + alpha * (u(t) - u(t-1)), where u is the wrapped
optimizer's update. It is elementwise, so it runs per stage inside the 2BW program, and costs
one parameter-sized buffer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class StaleCorrectionState(NamedTuple):
    inner: Any  # the wrapped optimizer's state
    previous: Any  # its previous update u(t-1), parameter-shaped
    started: jax.Array  # False before the first update: nothing to correct yet


def stale_correction(optimizer: optax.GradientTransformation,
                     alpha: float = 1.0) -> optax.GradientTransformation:
    """``optimizer`` with its previous update's error fed back (``alpha`` in [0, 1])."""
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"stale_correction alpha={alpha} must lie in [0, 1] (1 = full "
                         "correction, 0 = the plain optimizer)")

    def init(params):
        return StaleCorrectionState(optimizer.init(params), jax.tree.map(jnp.zeros_like, params),
                                    jnp.zeros((), jnp.bool_))

    def update(grads, state, params=None):
        updates, inner = optimizer.update(grads, state.inner, params)
        a = jnp.where(state.started, alpha, 0.0)
        applied = jax.tree.map(lambda u, prev: u + (a * (u - prev)).astype(u.dtype), updates,
                               state.previous)
        return applied, StaleCorrectionState(inner, updates, jnp.ones((), jnp.bool_))

    return optax.GradientTransformation(init, update)
