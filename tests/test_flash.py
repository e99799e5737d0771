"""The tiled attention block (fiddlejax/parallel/flash.py): tiles change nothing, values or
gradients, and two blocks merged by their log-sum-exp are one block over both key sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, rel_err

from fiddlejax.parallel import flash

C, B, N, KV, G, D = 2, 1, 16, 2, 2, 8


def inputs(seed: int):
    r = np.random.default_rng(seed)
    q = r.normal(size=(C, B, N, KV, G, D)).astype(np.float32)
    k, v = (r.normal(size=(C, B, N, KV, D)).astype(np.float32) for _ in range(2))
    pos = np.broadcast_to(np.arange(N), (C, N)).astype(np.int32)
    seg = np.repeat(np.array([1, 1, 2, 3]), N // 4)[None, None].repeat(C, 0).astype(np.int32)
    seg[1, 0, :3] = 0  # padding: its own document
    return q, k, v, pos, seg


def reference(q, k, v, pos, seg):
    """Plain masked softmax attention, causal, within documents."""
    s = jnp.einsum("cbqkgd,cbskd->cbkgqs", q, k) * D ** -0.5
    mask = seg[..., :, None] == seg[..., None, :]
    mask = mask & (pos[:, None, :, None] >= pos[:, None, None, :])
    p = jax.nn.softmax(jnp.where(mask[:, :, None, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("cbkgqs,cbskd->cbqkgd", p, v)


def test_tiles_equal_one_block_values_and_grads():
    q, k, v, pos, seg = inputs(0)
    w = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)

    def loss(tile):
        def f(q, k, v):
            out, lse = flash.attend(q, k, v, pos, pos, seg, seg, causal=True, tile=tile)
            return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.sin(lse))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

    one, tiled = loss(N), loss(4)  # one 16 x 16 tile; 4 x 4 tiles of 4 x 4
    assert flash.tile_size(N, 4) == 4 and flash.tile_size(12, 8) == 6
    assert rel_err(tiled[0], one[0]) < 1e-6
    assert_close(tiled[1], one[1])
    ref = jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(reference(q, k, v, pos, seg) * w), (0, 1, 2)))(q, k, v)
    no_lse = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(flash.attend(
        q, k, v, pos, pos, seg, seg, causal=True, tile=4)[0] * w), (0, 1, 2)))(q, k, v)
    assert rel_err(no_lse[0], ref[0]) < 1e-6
    assert_close(no_lse[1], ref[1])


def test_merged_blocks_equal_one_block():
    """Keys split in two blocks (the first fully masked for some queries) and merged."""
    q, k, v, pos, seg = inputs(2)
    h = N // 2

    def two(q, k, v):
        a = flash.attend(q, k[:, :, :h], v[:, :, :h], pos, pos[:, :h], seg, seg[..., :h],
                         causal=True, tile=4)
        b = flash.attend(q, k[:, :, h:], v[:, :, h:], pos, pos[:, h:], seg, seg[..., h:],
                         causal=True, tile=4)
        return flash.merge(flash.merge(flash.empty(q), a), b)[0]

    w = np.random.default_rng(3).normal(size=q.shape).astype(np.float32)
    val, g = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(two(*a) * w), (0, 1, 2)))(q, k, v)
    ref, g_ref = jax.jit(jax.value_and_grad(
        lambda *a: jnp.sum(reference(*a, pos, seg) * w), (0, 1, 2)))(q, k, v)
    assert rel_err(val, ref) < 1e-6
    assert_close(g, g_ref)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)


def reference_with(q, k, v, pos, seg, window=None, softcap=None, scale=None):
    """Plain attention with the model options, as models.common.capped_attention computes
    them: scaled scores, capped, then masked (causal, window, documents)."""
    s = jnp.einsum("cbqkgd,cbskd->cbkgqs", q, k) * (D ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    ahead = pos[:, None, :, None] - pos[:, None, None, :]
    mask = (seg[..., :, None] == seg[..., None, :]) & (ahead >= 0)
    if window is not None:
        mask = mask & (ahead < window)
    p = jax.nn.softmax(jnp.where(mask[:, :, None, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("cbkgqs,cbskd->cbqkgd", p, v)


@pytest.mark.parametrize("opts", [dict(window=3), dict(softcap=0.7), dict(scale=0.9),
                                  dict(window=5, softcap=1.5, scale=12 ** -0.5)])
def test_window_softcap_scale_values_and_grads(opts):
    """Each option alone and all three together, on documents, in 4 x 4 tiles (with a
    window of 3 whole tiles below the diagonal are masked) and as two merged key blocks."""
    q, k, v, pos, seg = inputs(4)
    q = q * 2.0  # scores large enough that the cap bends them
    w = np.random.default_rng(5).normal(size=q.shape).astype(np.float32)
    h = N // 2

    def tiled(q, k, v):
        return flash.attend(q, k, v, pos, pos, seg, seg, causal=True, tile=4, **opts)[0]

    def two(q, k, v):
        a = flash.attend(q, k[:, :, :h], v[:, :, :h], pos, pos[:, :h], seg, seg[..., :h],
                         causal=True, tile=4, **opts)
        b = flash.attend(q, k[:, :, h:], v[:, :, h:], pos, pos[:, h:], seg, seg[..., h:],
                         causal=True, tile=4, **opts)
        return flash.merge(flash.merge(flash.empty(q), a), b)[0]

    def grads(f):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), (0, 1, 2)))(q, k, v)

    ref = grads(lambda *a: reference_with(*a, pos, seg, **opts))
    plain = grads(lambda *a: reference(*a, pos, seg))
    assert rel_err(ref[1], plain[1]) > 1e-2  # the option matters
    out_ref = reference_with(q, k, v, pos, seg, **opts)
    for f in (tiled, two):
        val, g = grads(f)
        assert rel_err(jax.jit(f)(q, k, v), out_ref) < 1e-5
        assert abs(float(val - ref[0])) < 1e-5 * float(jnp.sum(jnp.abs(out_ref * w)))
        for got, want in zip(g, ref[1]):  # dq, dk, dv each
            assert_close(got, want)
    # the hand-written backward with the lse's cotangent too, against autodiff of forward
    def with_lse(fwd):
        def f(q, k, v):
            out, lse = fwd(q, k, v, pos, pos, seg, seg, causal=True, tile=4, **opts)
            return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.sin(jnp.where(jnp.isfinite(lse), lse,
                                                                         0.0)))
        return jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v)

    mine, auto = with_lse(flash.attend), with_lse(flash.forward)
    assert rel_err(mine[0], auto[0]) < 1e-6
    assert_close(mine[1], auto[1])


def test_planner_tile_is_the_kernels():
    from fiddlejax.planner import footprint

    assert footprint.ATTENTION_TILE == flash.TILE
