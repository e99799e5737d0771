"""Every all-reduce schedule equals psum, sends the bytes it should, and works in the Trainer's
partial-manual shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fiddlejax.collectives as fc
from fiddlejax.collectives import topology as T

ALL = ("f32", "bf16", "i32")
VARIANTS = [  # (algorithm, chunks, inputs)
    ("ring", None, ALL),
    ("bidirectional-ring", None, ALL),
    ("recursive-halving-doubling", None, ALL),
    ("tree", None, ALL),
    ("packed-trees", None, ALL),
    ("auto", None, ALL),
]
# chunks > 1 exercises the pipelined tree loops (fill, fori_loop steady state, drain); they
# compile slowly on CPU, so only for a few axis sizes
PIPELINED = [("tree", 4, ("f32", "i32")), ("packed-trees", 3, ("bf16", "i32"))]


def _mesh(*shape, names=("i",)):
    n = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, devices=jax.devices()[:n], axis_types=(AxisType.Auto,) * len(shape)
    )


def _inputs(p, seed=0):
    """Per-device inputs stacked on a leading axis of size p; sizes not multiples of p.
    (numpy, not jax.random: eager random ops would each compile a program)"""
    rng = np.random.default_rng(seed)
    return {
        "f32": rng.standard_normal((p, 3, 5, 7), np.float32),
        "tiny": rng.standard_normal((p, 2), np.float32),  # fewer elements than devices
        "bf16": rng.standard_normal((p, 33), np.float32).astype(jnp.bfloat16),
        "i32": rng.integers(-(2**20), 2**20, (p, 4, 9), dtype=np.int32),
    }


def _check(y_all, x, ref, p):
    """y_all: the results of some devices, stacked. Same bits on every device; ints exact;
    floats within (p - 1) * eps * sum_i |x_i| of psum."""
    y_all, x, ref = np.asarray(y_all), np.asarray(x), np.asarray(ref)
    for d in range(1, y_all.shape[0]):
        np.testing.assert_array_equal(y_all[d], y_all[0])
    y = y_all[0]
    assert y.shape == ref.shape and y.dtype == ref.dtype
    if np.issubdtype(y.dtype, np.integer):
        np.testing.assert_array_equal(y, ref)
    else:
        eps = float(jnp.finfo(y.dtype).eps)
        tol = (p - 1) * eps * np.abs(x.astype(np.float64)).sum(0)
        err = np.abs(y.astype(np.float64) - ref.astype(np.float64))
        assert (err <= tol + 1e-30).all(), float((err - tol).max())


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
def test_every_algorithm_equals_psum(p):
    mesh = _mesh(p)
    # few trees keep compile time down; p=6 is Blink's fragmented DGX-1 allocation
    topo = T.dgx1_v100_fragment() if p == 6 else T.switch(p)
    xs = _inputs(p, seed=p)
    type_errors = []

    def body(xs):
        xs = jax.tree.map(lambda v: v[0], xs)
        ref = {k: jax.lax.psum(v, "i") for k, v in xs.items()}
        out = {}
        for alg, chunks, names in VARIANTS + (PIPELINED if p == 6 else []):
            for k in names:
                v = xs[k]
                y = fc.allreduce(v, "i", alg, topology=topo, chunks=chunks)
                if jax.typeof(y) != jax.typeof(ref[k]):  # invariant over "i", like psum
                    type_errors.append((alg, k, jax.typeof(y), jax.typeof(ref[k])))
                out[f"{alg}/{chunks}/{k}"] = y[None]
        return out, ref

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P())))
    out, ref = f(xs)
    assert not type_errors
    for key, y_all in out.items():
        name = key.split("/")[-1]
        _check(y_all, xs[name], ref[name], p)


def test_fewer_elements_than_devices():
    p = 7
    xs = {"tiny": _inputs(p)["tiny"]}

    def body(xs):
        v = xs["tiny"][0]
        algs = ["ring", "bidirectional-ring", "recursive-halving-doubling", "tree"]
        return {a: fc.allreduce(v, "i", a)[None] for a in algs}, jax.lax.psum(v, "i")

    out, ref = jax.jit(
        jax.shard_map(body, mesh=_mesh(p), in_specs=P("i"), out_specs=(P("i"), P()))
    )(xs)
    for y in out.values():
        _check(y, xs["tiny"], ref, p)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (2, 3), (3, 2)])
def test_hierarchical_equals_psum(shape):
    mesh = _mesh(*shape, names=("node", "gpu"))
    p = shape[0] * shape[1]
    xs = _inputs(p, seed=10 + p)

    def body(xs):
        xs = jax.tree.map(lambda v: v[0], xs)
        ys = {k: fc.allreduce(v, ("node", "gpu"), "hierarchical")[None] for k, v in xs.items()}
        return ys, {k: jax.lax.psum(v, ("node", "gpu")) for k, v in xs.items()}

    spec = P(("node", "gpu"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, P())))
    out, ref = f(xs)
    for k in xs:
        _check(out[k], xs[k], ref[k], p)


def _sent(f, x):
    text = jax.jit(f).lower(x).compile().as_text()
    return fc.bytes_sent_per_device(text), fc.hlo_collectives(text)


@pytest.mark.parametrize(
    "alg,p",
    [
        ("ring", 8),
        ("ring", 6),
        ("bidirectional-ring", 8),
        ("bidirectional-ring", 5),
        ("recursive-halving-doubling", 8),
        ("recursive-halving-doubling", 4),
    ],
)
def test_bytes_sent_in_hlo_are_bandwidth_optimal(alg, p):
    n = 2 * p * 1536  # float32 elements per device
    f = jax.shard_map(
        lambda v: fc.allreduce(v, "i", alg), mesh=_mesh(p), in_specs=P("i"), out_specs=P()
    )
    sent, ops = _sent(f, np.ones(p * n, np.float32))
    assert {o.kind for o in ops} == {"collective-permute"}
    expected = 2 * (p - 1) / p * n * 4
    for d in range(p):
        assert sent[d] == pytest.approx(expected, rel=0.01)


def test_rhd_non_power_of_two_fallback_bytes():
    """p=6: ranks 1 and 3 fold into 0 and 2 (n each way), the other 4 run halving-doubling."""
    p, n = 6, 4096
    f = jax.shard_map(
        lambda v: fc.allreduce(v, "i", "recursive-halving-doubling"),
        mesh=_mesh(p), in_specs=P("i"), out_specs=P(),
    )  # fmt: skip
    sent, _ = _sent(f, np.ones(p * n, np.float32))
    core = 2 * 3 / 4 * n * 4
    assert sent[0] == pytest.approx(core + n * 4)  # core + hand the result back to 1
    assert sent[1] == pytest.approx(n * 4)  # folded in, then waits
    assert sent[4] == pytest.approx(core)


def test_hierarchical_sends_only_the_inner_share_across_outer():
    outer, inner = 2, 4
    p, n = outer * inner, 8192
    mesh = _mesh(outer, inner, names=("node", "gpu"))
    f = jax.shard_map(
        lambda v: fc.allreduce(v, ("node", "gpu"), "hierarchical"),
        mesh=mesh, in_specs=P(("node", "gpu")), out_specs=P(),
    )  # fmt: skip
    sent, ops = _sent(f, np.ones(p * n, np.float32))
    for d in range(p):
        assert sent[d] == pytest.approx(2 * (p - 1) / p * n * 4, rel=0.01)
    across = {d: 0.0 for d in range(p)}
    for op in ops:
        for s, t in op.pairs:
            if s // inner != t // inner:  # device id = node * inner + gpu
                across[s] += op.nbytes
    for d in range(p):
        assert across[d] == pytest.approx(2 * (outer - 1) / outer * n / inner * 4, rel=0.01)


def test_allreduce_tree_in_partial_manual_shard_map():
    """The Trainer's setting: manual over "data", "tensor" left to the compiler."""
    mesh = jax.make_mesh((2, 1, 4), ("data", "pipe", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rng = np.random.default_rng(3)
    grads = {
        "w": jax.device_put(
            rng.standard_normal((2, 16, 8), np.float32),
            NamedSharding(mesh, P("data", None, "tensor")),
        ),
        "b": rng.standard_normal((2, 8), np.float32),
        "h": rng.standard_normal((2, 5, 3), np.float32).astype(jnp.bfloat16),
        "n": rng.integers(0, 100, (2, 7), dtype=np.int32),
    }

    def body(g):
        g = jax.tree.map(lambda v: v[0], g)
        ring = fc.allreduce_tree(g, "data", "ring", bucket_bytes=64)  # several buckets
        auto = fc.allreduce_tree(g, "data", "auto")
        # reference in float32 (psum of bf16 under partial-manual shard_map crashes XLA:CPU)
        ref = jax.tree.map(lambda v: jax.lax.psum(v.astype(jnp.float32), "data"), g)
        return ring, auto, ref

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), axis_names={"data"})
    )
    ring, auto, ref = f(grads)
    for out in (ring, auto):
        for k in grads:
            assert out[k].dtype == grads[k].dtype and out[k].shape == grads[k].shape[1:]
            _check(np.asarray(out[k])[None], grads[k], np.asarray(ref[k]).astype(out[k].dtype), 2)


def test_bucketing_groups_by_dtype_in_order():
    tree = {
        "a": jnp.zeros(10, jnp.float32),
        "b": jnp.zeros(10, jnp.bfloat16),
        "c": jnp.zeros(30, jnp.float32),
        "d": jnp.zeros(5, jnp.float32),
    }
    # f32 leaves a, c, d (40, 120, 20 bytes) under 100-byte buckets: [a], [c], [d]; bf16: [b]
    assert fc.bucket_plan(tree, 100) == [40, 120, 20, 20]
    assert fc.bucket_plan(tree, 1000) == [180, 20]


def test_gradient_through_allreduce_matches_psum():
    p = 4
    mesh = _mesh(p)
    x = np.random.default_rng(7).standard_normal(p * 6, np.float32)

    def grads(v):
        g = jax.grad(lambda u: jnp.sum(jnp.sin(fc.allreduce(u, "i", "ring"))))(v)
        g_ref = jax.grad(lambda u: jnp.sum(jnp.sin(jax.lax.psum(u, "i"))))(v)
        return g, g_ref

    g, g_ref = jax.jit(
        jax.shard_map(grads, mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P("i")))
    )(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)


def test_broadcast_reduce_scatter_all_gather_helpers():
    p = 5
    mesh = _mesh(p)
    x = np.random.default_rng(8).standard_normal((p, 3, 4), np.float32)

    def body(v):
        v = v[0]
        return (
            fc.broadcast(v, "i", root=2),
            fc.reduce_scatter(v, "i")[None],
            jax.lax.psum_scatter(jnp.pad(v.reshape(-1), (0, 3)), "i", tiled=True)[None],
            fc.all_gather(v, "i"),
        )

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P(), P("i"), P("i"), P()))
    )
    b, rs, rs_ref, ag = f(x)
    np.testing.assert_array_equal(b, x[2])
    np.testing.assert_allclose(rs, rs_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ag, x)


def test_errors_name_the_bad_value_and_the_fix():
    mesh = _mesh(4)

    def run(fn):
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P()))(jnp.ones(8))

    with pytest.raises(ValueError, match=r"unknown all-reduce algorithm 'rings'.*'ring'"):
        run(lambda v: fc.allreduce(v, "i", "rings"))
    with pytest.raises(ValueError, match=r"hierarchical.*\(outer, inner\)"):
        run(lambda v: fc.allreduce(v, "i", "hierarchical"))
    with pytest.raises(ValueError, match="needs topology="):
        run(lambda v: fc.allreduce(v, "i", "packed-trees"))
    with pytest.raises(ValueError, match="has 8 devices but axis"):
        run(lambda v: fc.allreduce(v, "i", "packed-trees", topology=T.dgx1_v100()))


def test_psum_like_on_a_flattened_pair_of_axes():
    """Non-hierarchical algorithms also take a tuple of axes, as psum does."""
    mesh = _mesh(2, 3, names=("a", "b"))
    x = np.random.default_rng(9).standard_normal((6, 10), np.float32)
    f = jax.jit(jax.shard_map(
        lambda v: (fc.allreduce(v[0], ("a", "b"), "recursive-halving-doubling"),
                   jax.lax.psum(v[0], ("a", "b"))),
        mesh=mesh, in_specs=P(("a", "b")), out_specs=P(),
    ))  # fmt: skip
    y, ref = f(x)
    _check(np.asarray(y)[None], x, ref, 6)
