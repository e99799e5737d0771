"""Top-k sparsification with error feedback: nothing is lost, and the bytes are what we say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fiddlejax.collectives as fc
from fiddlejax.collectives import compression as cp


def test_error_feedback_transmits_all_mass_eventually():
    """On a fixed gradient, what has been sent after T steps is T*g minus a bounded residual,
    so the average sent gradient converges to g and every coordinate gets sent."""
    rng = np.random.default_rng(0)
    g = (rng.uniform(0.5, 1.0, 100) * rng.choice([-1, 1], 100)).astype(np.float32)
    g[::10] *= 0.2  # small coordinates must get their turn too
    tx = fc.topk_error_feedback(density=0.05)  # 5 of 100 entries per step

    def run(steps):
        def body(carry, _):
            state, total, count = carry
            sent, state = tx.update({"g": jnp.asarray(g)}, state)
            return (state, total + sent["g"], count + (sent["g"] != 0)), None

        init = (tx.init({"g": jnp.zeros_like(g)}), jnp.zeros_like(g), jnp.zeros(g.shape, int))
        (state, total, count), _ = jax.lax.scan(body, init, None, length=steps)
        return total, state.residual["g"], count

    errors = []
    for steps in (400, 1600):
        total, residual, count = map(np.asarray, jax.jit(run, static_argnums=0)(steps))
        np.testing.assert_allclose(total + residual, steps * g, rtol=1e-4, atol=1e-3)
        errors.append(np.linalg.norm(total / steps - g) / np.linalg.norm(g))
    assert (count > 0).all()
    assert errors[1] < 0.05
    assert errors[1] < errors[0] / 2  # the gap shrinks like 1/T: the residual stays bounded


def test_topk_compress_keeps_largest_and_remembers_the_rest():
    g = jnp.asarray([[0.1, -3.0, 0.2], [2.0, 0.0, -0.5]])
    r = jnp.asarray([[0.0, 0.0, 0.0], [0.0, 1.5, 0.0]])
    values, idx, left = fc.topk_compress(g, r, density=0.34)  # k = ceil(0.34 * 6) = 3
    assert sorted(np.asarray(idx).tolist()) == [1, 3, 4]
    np.testing.assert_allclose(left, [[0.1, 0, 0.2], [0, 0, -0.5]])
    np.testing.assert_allclose(cp.densify(values, idx, g.shape) + left, g + r)
    with pytest.raises(ValueError, match="density=0"):
        fc.topk_compress(g, r, density=0)


def test_topk_allreduce_sums_sparse_sends_and_counts_bytes():
    p, density = 4, 0.1
    mesh = jax.make_mesh((p,), ("data",), devices=jax.devices()[:p], axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(1)
    grads = {"w": rng.standard_normal((p, 8, 16), np.float32),
             "b": rng.standard_normal((p, 30), np.float32)}  # fmt: skip
    resid = {k: rng.standard_normal(v.shape, np.float32) * 0.1 for k, v in grads.items()}
    reported = []

    def body(g, r):
        g, r = jax.tree.map(lambda v: v[0], (g, r))
        summed, new_r, nbytes = fc.topk_allreduce(g, r, "data", density)
        reported.append(nbytes)
        return summed, jax.tree.map(lambda v: v[None], new_r)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"))))
    summed, new_r = f(grads, resid)
    # reference: every device's top-k of (grad + residual), densified and added up
    for k in grads:
        acc = (grads[k] + resid[k]).reshape(p, -1)
        kk = cp.num_kept(acc.shape[1], density)
        sent = np.zeros_like(acc)
        for d in range(p):
            top = np.argsort(-np.abs(acc[d]), kind="stable")[:kk]
            sent[d, top] = acc[d, top]
        np.testing.assert_allclose(summed[k].reshape(-1), sent.sum(0), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(new_r[k].reshape(p, -1), acc - sent, rtol=1e-6, atol=1e-6)
    # bytes: (p-1) * k * (4 value + 4 index bytes) per leaf; the HLO's all-gathers agree
    expected = sum((p - 1) * cp.num_kept(v[0].size, density) * 8 for v in grads.values())
    assert reported[0] == expected == fc.topk_bytes(jax.tree.map(lambda v: v[0], grads), p, density)
    text = f.lower(grads, resid).compile().as_text()
    ops = fc.hlo_collectives(text)
    assert {o.kind for o in ops} == {"all-gather"}
    assert fc.bytes_sent_per_device(text)[0] == pytest.approx(expected)
    dense = fc.dense_allreduce_bytes(jax.tree.map(lambda v: v[0], grads), p)
    # all-gathered (value, index) pairs vs a dense ring: ratio p * density (0.4 here), so the
    # exchange pays off when density < 1/p (at 1% on 8 devices it sends 8% of the dense bytes)
    assert expected / dense == pytest.approx(p * density, rel=0.1)
