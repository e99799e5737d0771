"""The tiled attention block (fiddlejax/parallel/flash.py): tiles change nothing, values or
gradients, and two blocks merged by their log-sum-exp are one block over both key sets."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import rel_err

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
    assert rel_err(tiled[1], one[1]) < 1e-5
    ref = jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(reference(q, k, v, pos, seg) * w), (0, 1, 2)))(q, k, v)
    no_lse = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(flash.attend(
        q, k, v, pos, pos, seg, seg, causal=True, tile=4)[0] * w), (0, 1, 2)))(q, k, v)
    assert rel_err(no_lse[0], ref[0]) < 1e-6
    assert rel_err(no_lse[1], ref[1]) < 1e-5


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
    assert rel_err(g, g_ref) < 1e-5
    assert all(np.isfinite(np.asarray(x)).all() for x in g)


def test_planner_tile_is_the_kernels():
    from fiddlejax.planner import footprint

    assert footprint.ATTENTION_TILE == flash.TILE
