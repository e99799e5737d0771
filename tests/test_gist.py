"""Gist encodings: lossless ones bit-identical, lossy ones within bounds, smaller stashes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fiddlejax.memory import gist, policies


def normal(seed, shape, scale=1.0):
    """Random float32 data from numpy: eager jax.random would compile one program per shape."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def plain_pool(x, window=(2, 2), strides=None, padding="VALID"):
    strides = window if strides is None else strides
    return jax.lax.reduce_window(
        jax.nn.relu(x), -jnp.inf, jax.lax.max, (1, *window, 1), (1, *strides, 1), padding
    )


def assert_same_vjp(f0, f1, x, g):
    """Outputs and input gradients bit-identical (one jitted program: eager ops compile slowly)."""

    @jax.jit
    def both(x, g):
        (y0, vjp0), (y1, vjp1) = jax.vjp(f0, x), jax.vjp(f1, x)
        return y0, y1, vjp0(g)[0], vjp1(g)[0]

    y0, y1, d0, d1 = both(x, g)
    assert np.array_equal(y0, y1)
    assert np.array_equal(d0, d1)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_pack_bits_roundtrip(n):
    mask = np.random.default_rng(n).random(n) < 0.3
    packed = gist.pack_bits(mask)
    assert packed.dtype == jnp.uint8 and packed.shape == (-(-n // 8),)
    assert np.array_equal(gist.unpack_bits(packed, (n,)), mask)


def test_relu_1bit_is_bit_identical():
    x = normal(0, (4, 33))
    x[0, :5] = 0.0  # ReLU'(0) = 0, as in jax.nn.relu
    g = normal(1, x.shape)
    assert_same_vjp(jax.nn.relu, gist.relu_1bit, x, g)


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (2, 9, 7, 3)])
@pytest.mark.parametrize("ties", [False, True])
def test_binarize_is_bit_identical(shape, ties):
    x = normal(2, shape)
    if ties:  # coarse values: many windows have several equal maxima
        x = np.round(x * 2) / 2
    g = normal(3, jax.eval_shape(plain_pool, x).shape)
    assert_same_vjp(plain_pool, gist.binarize, x, g)


def test_relu_maxpool_dispatch_and_fallback():
    x = normal(4, (2, 9, 9, 4))
    for window, strides in (((2, 2), None), ((3, 3), (2, 2))):  # the second overlaps

        def plain(x, window=window, strides=strides):
            return jnp.sum(jnp.sin(plain_pool(x, window, strides)))

        def model(x, window=window, strides=strides):
            return jnp.sum(jnp.sin(gist.relu_maxpool(x, window, strides)))

        ref = jax.jit(jax.grad(plain))(x)
        grad = jax.jit(jax.grad(model))
        for enc in ([], ["relu-1bit", "binarize"]):
            with gist.encodings(enc):
                assert np.array_equal(grad(x), ref), (window, enc)
    with pytest.raises(ValueError, match="non-overlapping"):
        gist.binarize(x, (3, 3), (2, 2))


def _dense_loss(x, w):
    return jnp.sum(jnp.sin(gist.dense(jax.nn.relu(x), w, relu_input=True)))


_dense_loss_grad = jax.jit(jax.grad(_dense_loss, (0, 1)))


def _dense_grads(enc, x, w):
    with gist.encodings(enc):  # part of the jit cache key: re-traces per selection
        return _dense_loss_grad(x, w)


X = normal(5, (64, 48))
W = normal(6, (48, 32), 1 / 7)


# Weight-gradient bounds: the per-element rms rounding error of normal data (bf16 1.7e-3,
# fp8-e4m3 2.7e-2) is the worst case, reached when the output gradient has random signs.
BOUND = {"bf16": 2.5e-3, "fp8": 3.5e-2}


@pytest.mark.parametrize("enc", ["bf16", "fp8"])
def test_reduced_precision_error_bounds(enc):
    dx0, dw0 = _dense_grads([], X, W)
    dx, dw = _dense_grads([enc], X, W)
    assert np.array_equal(dx, dx0)  # input gradients never read the stash
    assert 0 < rel(dw, dw0) < BOUND[enc]


def test_fp8_scaling_handles_large_and_small_inputs():
    for scale in (1e-4, 1e4):
        x, w = (X * scale).astype(np.float32), W
        dw0 = _dense_grads([], x, w)[1]
        assert rel(_dense_grads(["fp8"], x, w)[1], dw0) < BOUND["fp8"]


def test_sparse_is_exact_under_capacity_and_loud_over_it():
    dx0, dw0 = _dense_grads([], X, W)
    dx, dw = _dense_grads(["sparse:0.75"], X, W)  # ReLU of normal data: density about 0.5
    assert np.array_equal(dx, dx0) and np.array_equal(dw, dw0)
    dx, dw = _dense_grads(["sparse:0.25"], X, W)
    assert np.array_equal(dx, dx0) and bool(jnp.isnan(dw).all())
    # Composes with precision: values stored as bf16 inside the sparse buffer.
    assert rel(_dense_grads(["sparse:0.75", "bf16"], X, W)[1], dw0) < BOUND["bf16"]


def test_conv_encoding():
    x = normal(7, (2, 8, 8, 4))
    k = normal(8, (3, 3, 4, 5), 1 / 6)

    def f(x, k):
        return jnp.sum(jnp.sin(gist.conv(x, k, strides=(1, 1), padding="SAME")))

    grad = jax.jit(jax.grad(f, (0, 1)))
    g0 = grad(x, k)
    with gist.encodings(["bf16"]):
        g1 = grad(x, k)
    assert np.array_equal(g1[0], g0[0]) and 0 < rel(g1[1], g0[1]) < BOUND["bf16"]


def test_encoding_names_are_validated():
    assert gist.parse(["relu-1bit", "bf16"]).names == ("relu-1bit", "bf16")
    assert gist.parse("relu-maxpool-1bit").binarize
    assert gist.parse(["sparse"]).sparse_capacity == gist.DEFAULT_SPARSE_CAPACITY
    with pytest.raises(ValueError, match="unknown encoding 'relu-2bit'"):
        gist.parse(["relu-2bit"])
    with pytest.raises(ValueError, match="keep one"):
        gist.parse(["bf16", "fp8"])
    with pytest.raises(ValueError, match="fraction"):
        gist.parse(["sparse:2"])
    with pytest.raises(ValueError, match="unknown encoding"):
        with gist.encodings(["nope"]):
            pass


def test_context_switches_traces():
    """The selection is part of jax's trace cache key: a jitted function re-traces under it."""
    f = jax.jit(jax.grad(lambda x: jnp.sum(gist.relu(x) ** 2)))
    x = normal(9, (32,))

    def residual_dtypes():
        return {str(a.dtype) for a in jax.tree.leaves(jax.vjp(gist.relu, x)[1])}

    assert gist.active().names == ()
    assert "uint8" not in residual_dtypes()
    with gist.encodings(["relu-1bit"]):
        assert gist.active().relu_1bit and "uint8" in residual_dtypes()
        assert "uint8" in f.lower(x).as_text() or "ui8" in f.lower(x).as_text()
    assert "ui8" not in f.lower(x).as_text()
    wrapped = gist.with_encodings(lambda: gist.active().names, ["relu-1bit"])
    assert wrapped() == ("relu-1bit",) and gist.active().names == ()


# --- measured stash: a scan of identical ReLU layers, bytes per layer from temp bytes --------

N, K = 64, 128


def _stack_loss(layer_input_relu: bool):
    def layer(h, w):
        a = gist.relu(h)
        return gist.dense(a, w, relu_input=layer_input_relu), None

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    return loss


def _per_layer(enc, remat="none"):
    def temp(layers):
        ws = jax.ShapeDtypeStruct((layers, K, K), jnp.float32)
        x = jax.ShapeDtypeStruct((N, K), jnp.float32)
        loss = _stack_loss(True)
        if remat != "none":
            loss = _remat_stack(remat)
        f = gist.with_encodings(jax.grad(loss), enc)
        return jax.jit(f).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

    return (temp(8) - temp(4)) / 4


def _remat_stack(remat):
    def layer(h, w):
        return gist.dense(gist.relu(h), w), None

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(policies.remat_layer(layer, remat), x, ws)[0] ** 2)

    return loss


def test_encodings_cut_measured_stash():
    n = N * K
    plain = _per_layer([])
    one_bit = _per_layer(["relu-1bit"])
    bf16 = _per_layer(["relu-1bit", "bf16"])
    # Plain: XLA keeps the ReLU output (4 B, the matmul's input) and its `pred` mask (1 B).
    assert plain == pytest.approx(5 * n, rel=0.02)
    assert one_bit == pytest.approx(4.125 * n, rel=0.02)  # the mask drops to 1 bit
    assert bf16 == pytest.approx(2.125 * n, rel=0.02)  # and the matmul input to 2 B


def test_encodings_inside_remat_policies_keep_gradients():
    ws = normal(10, (3, K, K), K**-0.5)
    x = normal(11, (N, K))
    ref = jax.jit(jax.grad(_remat_stack("none")))(ws, x)
    for remat in ("full", "dots"):
        grad = jax.jit(jax.grad(_remat_stack(remat)))
        with gist.encodings(["relu-1bit"]):
            assert np.array_equal(grad(ws, x), ref)
        with gist.encodings(["bf16"]):
            assert rel(grad(ws, x), ref) < BOUND["bf16"]


def _pool_per_layer(enc):
    """Layers ``depth_to_space(relu_maxpool(h @ w))``: same shape in and out, so they scan."""

    def layer(h, w):
        y = gist.relu_maxpool(h @ w, (2, 2))  # [n, s/2, s/2, 4c]
        n, s, _, c4 = y.shape
        y = y.reshape(n, s, s, 2, 2, c4 // 4).transpose(0, 1, 3, 2, 4, 5)
        return y.reshape(n, 2 * s, 2 * s, c4 // 4), None

    def temp(layers):
        ws = jax.ShapeDtypeStruct((layers, 8, 32), jnp.float32)
        x = jax.ShapeDtypeStruct((2, 16, 16, 8), jnp.float32)
        loss = lambda ws, x: jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)  # noqa: E731
        f = gist.with_encodings(jax.grad(loss), enc)
        return jax.jit(f).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

    return (temp(8) - temp(4)) / 4


def test_binarize_cuts_measured_stash():
    n = 2 * 16 * 16 * 8  # layer input elements; the pool sees 4n
    # Plain: the matmul input (4 B per input element), the pool's f32 input and ReLU's pred mask.
    assert _pool_per_layer([]) == pytest.approx(4 * n + 16 * n + 4 * n, rel=0.02)
    # Binarize: the matmul input and 1 bit per pool input element.
    assert _pool_per_layer(["binarize"]) == pytest.approx(4 * n + 4 * n / 8, rel=0.02)


@pytest.mark.slow
def test_plan_encodings_through_the_trainer():
    """Plan(encodings=...) reaches the CNN's gist ops: same gradients, smaller compiled step."""
    import optax
    from flax import nnx
    from helpers import assert_close, reference_loss_and_grads

    import fiddlejax as fj
    from fiddlejax.models.cnn import CNN, CNNConfig

    model = CNN(CNNConfig(channels=8, n_layers=2), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batch = {"images": rng.standard_normal((8, 8, 8, 1)).astype(np.float32),
             "labels": rng.integers(0, 10, 8).astype(np.int32)}
    _, ref = reference_loss_and_grads(model, batch)
    mesh = fj.make_mesh(data=2, pipe=1, tensor=1, devices=jax.devices()[:2])
    temps = {}
    for enc, bound in (((), 1e-6), (("relu-1bit", "binarize"), 1e-6), (("bf16",), BOUND["bf16"])):
        trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=mesh, encodings=enc))
        state = trainer.init()
        assert_close(trainer.loss_and_grads(state, batch)[1], ref, bound)
        temps[enc] = trainer.lower_loss_and_grads(state, batch).compile().memory_analysis()
    plain = temps[()].temp_size_in_bytes
    assert temps[("relu-1bit", "binarize")].temp_size_in_bytes < plain
    assert temps[("bf16",)].temp_size_in_bytes < plain


def test_plan_encodings_reach_a_users_unmodified_model_through_the_interception():
    """A user's model written with gist ops and no ``ops`` keyword: ``Plan(encodings=...)``
    reaches its stem, blocks and head inside fiddlejax's trace (the one interception), on a
    1F1B pipeline too; fiddlejax sets no user context (outside, nothing is selected)."""
    import optax
    from flax import nnx
    from helpers import assert_close

    import fiddlejax as fj

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 16)) * 0.3)

        def __call__(self, x):
            return x + gist.dense(gist.relu(x), self.w[...], relu_input=True)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Param(jax.random.normal(rngs.params(), (4, 16)))
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])

        def __call__(self, x):
            h = gist.dense(x, self.stem[...])
            for b in self.blocks:
                h = b(h)
            return gist.relu(h[:, :8]).mean(axis=-1)  # the head's: another shape

    def loss(outputs, batch):
        return ((outputs - batch["y"]) ** 2).mean()

    model = Net(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((8, 4)).astype(np.float32),
             "y": rng.standard_normal((8,)).astype(np.float32)}
    graphdef, params = nnx.split(model, nnx.Param)
    ref = jax.grad(lambda p: loss(nnx.merge(graphdef, p)(batch["x"]), batch))(params)
    seen = []
    real = gist.relu_1bit
    with pytest.MonkeyPatch.context() as m:
        m.setattr(gist, "relu_1bit", lambda x: seen.append(x.shape) or real(x))
        for mesh, kw in ((dict(data=2), {}), (dict(pipe=2), dict(schedule="1f1b",
                                                                  microbatches=2))):
            plan = fj.Plan(mesh=fj.make_mesh(**mesh, devices=jax.devices()[:2]),
                           encodings=["relu-1bit"], **kw)
            t = fj.parallelize(model, optax.sgd(0.1), plan, layers="blocks", loss=loss)
            seen.clear()
            assert_close(t.loss_and_grads(t.init(), batch)[1], ref, 1e-6)
            assert set(seen) == {(4, 16), (4, 8)}, mesh  # the blocks' ReLU and the head's
    assert gist.active().names == ()
