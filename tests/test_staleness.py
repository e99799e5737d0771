"""stale_correction: applied(t) = u(t) + alpha (u(t) - u(t-1)), nothing added to the first."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fiddlejax as fj


def test_feeds_back_the_change_in_update_after_the_first_step():
    inner = optax.sgd(0.1)
    opt = fj.stale_correction(inner, alpha=0.5)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    grads = [jnp.array([1.0, 2.0, 3.0]), jnp.array([3.0, 2.0, 1.0]), jnp.array([0.0, 0.0, 4.0])]
    applied, plain = [], []
    for g in grads:
        u, state = opt.update({"w": g}, state, params)
        applied.append(np.asarray(u["w"]))
        plain.append(-0.1 * np.asarray(g))
    np.testing.assert_allclose(applied[0], plain[0], rtol=1e-6)  # nothing to correct yet
    for t in (1, 2):
        np.testing.assert_allclose(applied[t], plain[t] + 0.5 * (plain[t] - plain[t - 1]),
                                   rtol=1e-6)


def test_alpha_zero_is_the_plain_optimizer_and_bad_alpha_is_refused():
    params = {"w": jnp.ones(4)}
    adam, corrected = optax.adam(1e-2), fj.stale_correction(optax.adam(1e-2), 0.0)
    s1, s2 = adam.init(params), corrected.init(params)
    for k in range(3):
        g = {"w": jnp.arange(4.0) * (k + 1) - 1.5}
        u1, s1 = adam.update(g, s1, params)
        u2, s2 = corrected.update(g, s2, params)
        np.testing.assert_array_equal(u1["w"], u2["w"])
    with pytest.raises(ValueError, match=r"alpha=1.5 must lie in \[0, 1\]"):
        fj.stale_correction(adam, 1.5)
