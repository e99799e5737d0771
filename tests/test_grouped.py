"""The blocked grouped matmul (``fiddlejax.models.grouped``): exact against a row-by-row
reference, running only the blocks that hold rows, forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close

from fiddlejax.models import grouped, moe

E, D, F, BLOCK = 4, 8, 16, 4


def weights():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (E, D, F)), jax.random.normal(k[1], (E, D, F)),
            jax.random.normal(k[2], (E, F, D)))


def reference(xs, sizes, ws):
    """Each row through its own expert (rows past the groups: zeros)."""
    m = xs.shape[0]
    owner = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=m)
    real = jnp.arange(m) < jnp.sum(sizes)
    w0, w1, w2 = (w[owner] for w in ws)
    h = jax.nn.silu(jnp.einsum("md,mdf->mf", xs, w0)) * jnp.einsum("md,mdf->mf", xs, w1)
    return jnp.where(real[:, None], jnp.einsum("mf,mfd->md", h, w2), 0)


SIZES = [np.array([5, 0, 3, 1]), np.array([0, 0, 9, 0]), np.array([2, 2, 2, 2])]


def test_blocked_equals_each_row_through_its_expert_with_padding_and_empty_experts():
    ws, m = weights(), 13  # rows past the sizes' sum: an all-to-all buffer's padding
    xs = jax.random.normal(jax.random.key(1), (m, D))
    for sizes in map(jnp.asarray, SIZES):
        def loss(f, xs, ws, sizes=sizes):
            return jnp.sum(f(xs, sizes.astype(jnp.int32), ws) ** 2)

        got = jax.jit(jax.value_and_grad(lambda x, w: loss(
            lambda a, s, v: moe.blocked_matmuls(a, s, v, jax.nn.silu, BLOCK), x, w),
            argnums=(0, 1)))(xs, ws)
        want = jax.value_and_grad(lambda x, w: loss(reference, x, w), argnums=(0, 1))(xs, ws)
        assert_close(got, want, 1e-5)


def test_only_the_blocks_holding_rows_run_forward_and_backward():
    ws, xs, runs = weights(), jnp.ones((13, D)), []

    def one(xb, w):
        jax.debug.callback(lambda: runs.append(1))
        return jax.nn.silu(xb @ w[0]) * (xb @ w[1]) @ w[2]

    for sizes in SIZES:
        runs.clear()
        s = jnp.asarray(sizes, jnp.int32)
        jax.jit(jax.grad(lambda x, w, s=s: grouped.blocked(x, s, w, one, BLOCK).sum(),
                         argnums=(0, 1)))(xs, ws)
        used = int(np.sum(-(-sizes // BLOCK)))
        # each used block forward, then again in the backward (the checkpointed block
        # recomputes its activation), and one block traced to read the residuals' layout
        # (dead code, run here only for the callback)
        assert len(runs) == 2 * used + 1, (sizes, len(runs), used)
    static = -(-(13 + E * (BLOCK - 1)) // BLOCK)
    assert static > 2 * 3  # what a loop over every block would run: more than the 3 used


def test_the_residuals_hold_no_weights_per_block():
    ws, xs = weights(), jnp.ones((13, D))
    back = jax.vjp(lambda x, w: moe.blocked_matmuls(
        x, jnp.array([5, 0, 3, 1], jnp.int32), w, jax.nn.silu, BLOCK), xs, ws)[1]
    shapes = [a.shape for a in jax.tree.leaves(back)]
    assert not [s for s in shapes if s[-2:] in ((D, F), (F, D)) and len(s) == 4], shapes
    blocks = -(-(13 + E * (BLOCK - 1)) // BLOCK)
    assert shapes.count((blocks, BLOCK, F)) == 2, shapes  # the two matmuls' outputs
