"""models/moe.py and models/moe_loss.py: routing as transformers routes (Mixtral, Qwen3-MoE),
dispatch equal to every token through every expert, capacity drops counted, the per-sequence
load-balancing loss equal to transformers' on one sequence, and a stack of MoE layers on
data=2 x pipe=2 x tensor=2 with the single-device loss (aux and z included) and gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, assert_loss_and_grads, reference_loss_and_grads, rel_err, tokens

import fiddlejax as fj
from fiddlejax.models import moe_loss
from fiddlejax.models.common import scan_layers
from fiddlejax.models.moe import MoE, MoEConfig, route
from fiddlejax.models.moe_lm import MoELM as TinyMoE

CFG = MoEConfig(hidden_size=16, intermediate_size=24, num_experts=4, num_experts_per_tok=2)


def layer(cfg=CFG, seed=0):
    return MoE(cfg, rngs=nnx.Rngs(seed))


def inputs(n=2, t=24, d=16, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, t, d), jnp.float32)


def hf_route(logits, top_k, norm_topk_prob):
    """transformers' Mixtral / Qwen3-MoE router in numpy: float32 softmax, top-k, renorm."""
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :top_k]
    top = np.take_along_axis(p, idx, -1)
    return (top / top.sum(-1, keepdims=True) if norm_topk_prob else top), idx


def hf_layer(moe: MoE, x):
    """transformers' MixtralExperts loop: each hit expert on its tokens, gates, index_add."""
    c = moe.config
    flat = x.reshape(-1, c.hidden_size)
    logits = flat @ moe.router[...]
    p = jax.nn.softmax(logits, -1)
    top, idx = jax.lax.top_k(p, c.num_experts_per_tok)
    top = top / top.sum(-1, keepdims=True) if c.norm_topk_prob else top
    out = jnp.zeros_like(flat)
    for e in range(c.num_experts):
        h = jax.nn.silu(flat @ moe.w_gate[e]) * (flat @ moe.w_up[e])
        gate = jnp.sum(jnp.where(idx == e, top, 0.0), -1)
        out = out + gate[:, None] * (h @ moe.w_down[e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers(norm):
    """Mixtral renormalises the top-k softmax; Qwen3-MoE does when norm_topk_prob."""
    logits = jax.random.normal(jax.random.key(2), (40, 8)) * 2
    gates, experts = route(logits, 2, "softmax", norm)
    ref_gates, ref_experts = hf_route(logits, 2, norm)
    np.testing.assert_array_equal(np.asarray(experts), ref_experts)
    assert rel_err(gates, ref_gates) < 1e-6
    assert np.allclose(np.asarray(gates).sum(-1), 1.0) == norm


def test_sigmoid_router():
    logits = jax.random.normal(jax.random.key(3), (10, 6))
    gates, experts = route(logits, 3, "sigmoid", True)
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    idx = np.argsort(-s, -1)[:, :3]
    top = np.take_along_axis(s, idx, -1)
    np.testing.assert_array_equal(np.asarray(experts), idx)
    assert rel_err(gates, top / top.sum(-1, keepdims=True)) < 1e-6


@pytest.mark.parametrize("dispatch,grouped,norm", [
    ("dropless", "ragged_dot", True), ("dropless", "blocked", True),
    ("dropless", "blocked", False), ("dense", "auto", True)])
def test_layer_matches_every_expert_on_every_token(dispatch, grouped, norm):
    """Output and gradients (weights, router, input) equal the dense reference, float32."""
    moe = layer(dataclasses.replace(CFG, dispatch=dispatch, grouped_matmul=grouped,
                                    norm_topk_prob=norm))
    x = inputs()
    graphdef, params = nnx.split(moe)
    target = jax.random.normal(jax.random.key(5), x.shape)

    def loss(p, x, fn):
        return jnp.sum(fn(nnx.merge(graphdef, p), x) * target)

    ours = lambda m, x: m(x).output  # noqa: E731
    assert rel_err(ours(moe, x), hf_layer(moe, x)) < 1e-5
    grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)  # jitted: eager ops compile one by one
    g, ref = grad(params, x, ours), grad(params, x, hf_layer)
    assert_close(g, ref)
    assert float(jnp.linalg.norm(g[0]["router"][...])) > 0  # the gates train the router


def test_capacity_large_enough_equals_dropless():
    x = inputs()
    dropless = layer()(x)
    big = layer(dataclasses.replace(CFG, dispatch="capacity", capacity_factor=4.0))(x)
    assert rel_err(big.output, dropless.output) < 1e-6
    assert int(big.dropped.sum()) == 0
    np.testing.assert_array_equal(np.asarray(big.experts), np.asarray(dropless.experts))


def test_capacity_drops_and_counts():
    """A small factor: each expert keeps its first ``C`` pairs (first choices before second
    ones, earlier tokens first); the dropped ones add nothing and are counted per token."""
    cfg = dataclasses.replace(CFG, dispatch="capacity", capacity_factor=0.5)
    moe, x = layer(cfg), inputs(1, 24)
    out = moe(x)
    cap = cfg.capacity(24)
    assert cap == 6  # ceil(0.5 * 24 * 2 / 4)
    experts = np.asarray(out.experts).reshape(24, 2)
    kept, taken = np.zeros((24, 2), bool), np.zeros(4, int)
    for j in range(2):                      # choice-major priority, as documented
        for n in range(24):
            e = experts[n, j]
            kept[n, j] = taken[e] < cap
            taken[e] += 1
    np.testing.assert_array_equal(np.asarray(out.dropped).reshape(24), (~kept).sum(1))
    assert int(out.dropped.sum()) == int(np.maximum(np.bincount(experts.ravel(), minlength=4)
                                                    - cap, 0).sum()) > 0
    # the reference with the dropped choices' gates zeroed
    flat = x.reshape(24, 16)
    gates, _ = route(flat @ moe.router[...], 2)
    gates = jnp.where(jnp.asarray(kept), gates, 0.0)
    ref = jnp.zeros_like(flat)
    for e in range(4):
        h = jax.nn.silu(flat @ moe.w_gate[e]) * (flat @ moe.w_up[e])
        ref += jnp.sum(jnp.where(experts == e, gates, 0.0), -1)[:, None] * (h @ moe.w_down[e])
    assert rel_err(out.output.reshape(24, 16), ref) < 1e-5
    # per sequence: another row beside it changes nothing (the layouts' microbatches differ)
    two = moe(jnp.concatenate([x, inputs(1, 24, seed=9)]))
    assert rel_err(two.output[:1], out.output) < 1e-6
    np.testing.assert_array_equal(np.asarray(two.dropped[:1]), np.asarray(out.dropped))


def test_refusals_name_the_value():
    with pytest.raises(ValueError, match="capacity_factor=None.*1.25"):
        MoEConfig(dispatch="capacity")
    with pytest.raises(ValueError, match="capacity_factor=2.0 is read only"):
        MoEConfig(capacity_factor=2.0)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds num_experts=8"):
        MoEConfig(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="grouped_matmul='gmm'"):
        MoEConfig(grouped_matmul="gmm")
    with pytest.raises(ValueError, match="scoring='relu'"):
        MoEConfig(scoring="relu")
    with pytest.raises(ValueError, match=r"MoE expects \[..., 16\]"):
        layer()(jnp.ones((2, 8)))


def test_aux_loss_is_transformers_on_one_sequence():
    """Three layers' router logits of one sequence: the tally's per-sequence aux equals
    transformers' load_balancing_loss_func (the sums it pools are the same ones); with a
    padding mask too. For two sequences the per-sequence mean differs from the pooled one."""
    e, k, t = 4, 2, 10
    logits = [jax.random.normal(jax.random.key(i), (2, t, e)) * 2 for i in range(3)]
    mask = jnp.arange(t)[None, :] < jnp.array([[7], [10]])

    @jax.jit
    def aux_of(logits, mask):
        tally = moe_loss.empty((2, t), e, jnp.float32)
        for lg in logits:
            tally = moe_loss.accumulate(tally, _out(lg, route(lg, k)[1]))
        return (moe_loss.sequence_losses(tally, k).aux,
                moe_loss.sequence_losses(tally, k, mask).aux)

    aux, masked = aux_of(logits, mask)
    for s in range(2):
        one = [lg[s] for lg in logits]
        assert abs(float(aux[s]) / float(_hf_aux(one, e, k)) - 1) < 1e-6
        assert abs(float(masked[s]) / float(_hf_aux(one, e, k, mask[s])) - 1) < 1e-6
    pooled = _hf_aux([lg.reshape(-1, e) for lg in logits], e, k)
    assert abs(float(aux.mean()) - float(pooled)) > 1e-3
    assert abs(float(moe_loss.load_balancing_loss(logits, e, k)) / float(pooled) - 1) < 1e-6


def test_router_losses_reduce_exactly_over_row_splits():
    """Both loss forms are sums over rows: two halves of a batch, reduced as fiddlejax reduces
    microbatches (means averaged; pairs summed then divided), give the whole batch's value."""
    e, k = 4, 2
    lg = jax.random.normal(jax.random.key(7), (4, 6, e)) * 2
    tally = moe_loss.accumulate(moe_loss.empty((4, 6), e, jnp.float32), _out(lg, route(lg, k)[1]))
    add = jax.jit(moe_loss.add_router_losses, static_argnums=(2, 3, 4))
    mask = jnp.arange(6)[None, :] < jnp.array([[6], [3], [5], [0]])
    w = mask.sum(-1).astype(jnp.float32)
    whole = add(1.0, tally, k, 0.3, 0.2)
    halves = [add(1.0, tally[i:i + 2], k, 0.3, 0.2) for i in (0, 2)]
    assert abs(float(whole) - float(sum(halves)) / 2) < 1e-6
    total, count = add((2.0, w.sum()), tally, k, 0.3, 0.2, mask, w)
    parts = [add((1.0, w[i:i + 2].sum()), tally[i:i + 2], k, 0.3, 0.2, mask[i:i + 2],
                 w[i:i + 2]) for i in (0, 2)]
    assert abs(float(total / count) - float(sum(p[0] for p in parts) / count)) < 1e-6
    r = moe_loss.sequence_losses(tally, k, mask)
    assert float(r.aux[3]) == float(r.z[3]) == 0.0 and float(r.aux[1]) > 0  # an empty row: 0
    with pytest.raises(ValueError, match="weights="):
        moe_loss.add_router_losses((2.0, 3.0), tally, k, 0.3)


def _out(logits, experts):
    from fiddlejax.models.moe import MoEOutput

    return MoEOutput(None, logits, experts, jnp.zeros(logits.shape[:-1], jnp.int32))


def _hf_aux(logits, e, k, mask=None):
    """transformers' load_balancing_loss_func, in numpy (its per-layer loop, histc counts)."""
    counts, probs, rows = np.zeros(e), np.zeros(e), 0.0
    m = None if mask is None else np.asarray(mask, np.float64).reshape(-1)
    for lg in logits:
        z = np.asarray(lg, np.float64).reshape(-1, e)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        sel = np.argsort(-p, -1)[:, :k]
        w = np.ones(len(p)) if m is None else m
        np.add.at(counts, sel.reshape(-1), np.repeat(w, k))
        probs += (p * w[:, None]).sum(0)
        rows += w.sum()
    return e * np.sum((counts / rows) * (probs / rows))


# Dropless on (2, 2, 2) 1F1B: tests/test_hf_moe.py (a Mixtral) and tests/test_expert.py.
@pytest.mark.parametrize("dispatch", [{"dispatch": "capacity", "capacity_factor": 0.75}])
def test_moe_stack_on_222_pipeline_matches_one_device(dispatch):
    """data=2 x pipe=2 x tensor=2, 1F1B: each expert's matrices split over tensor, layers over
    two stages, the tally in the message; loss and gradients (aux and z included, with large
    coefficients so they matter) equal one device, float32 rel < 1e-5; with a capacity that
    drops, the same tokens drop (capacity is per sequence)."""
    cfg = dataclasses.replace(CFG, router_aux_loss_coef=0.5, router_z_loss_coef=0.1, **dispatch)
    model = TinyMoE(cfg, vocab=32, layers=4, rngs=nnx.Rngs(0))
    batch = tokens(3, 8, 8, 32)
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    plain = dataclasses.replace(cfg, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    nnx.update(no_aux := TinyMoE(plain, 32, 4, nnx.Rngs(0)), nnx.state(model))
    ce_loss, ce_grads = reference_loss_and_grads(no_aux, batch)
    assert float(ref_loss - ce_loss) > 0.1 and rel_err(ce_grads, ref_grads) > 1e-3
    mesh = fj.make_mesh(data=2, pipe=2, tensor=2, devices=jax.devices()[:8])
    plan = fj.Plan(mesh=mesh, schedule="1f1b", microbatches=2, rules={"expert": None})
    trainer = fj.parallelize(model, optax.sgd(0.1), plan)
    state = trainer.init()
    specs = {jax.tree_util.keystr(p): v.sharding.spec
             for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
    spec = lambda name: next(v for k, v in specs.items() if f"'{name}'" in k)  # noqa: E731
    # Megatron inside each expert: gate and up split by columns, down by rows
    assert spec("w_gate")[-1] == spec("w_up")[-1] == spec("w_down")[-2] == "tensor"
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    if cfg.dispatch != "capacity":
        return
    # the step's metrics: the router's losses and drops beside the loss, as on one device
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    m = nnx.merge(graphdef, params, rest)
    _, tally = m.head(scan_layers(m.blocks, m.prologue(batch)))
    r = moe_loss.sequence_losses(tally, cfg.num_experts_per_tok)
    _, metrics = trainer.step(state, batch)
    assert set(metrics) == {"loss", "grad_norm", "nonfinite_skipped", "moe_aux_loss",
                            "moe_z_loss", "moe_dropped"}
    assert abs(float(metrics["loss"]) / float(ref_loss) - 1) < 1e-5
    assert abs(float(metrics["moe_aux_loss"]) / float(r.aux.mean()) - 1) < 1e-5
    assert abs(float(metrics["moe_z_loss"]) / float(r.z.mean()) - 1) < 1e-5
    assert float(metrics["moe_dropped"]) == float(r.dropped.sum()) > 0


def test_reported_metrics_refusals_and_the_job_line():
    """A loss may not report under the step's own names, nor anything but scalars; the job's
    step line shows the router's aux loss and, when capacity drops, the dropped choices."""
    from fiddlejax.app.logs import line
    from fiddlejax.staged import Reported, as_sums

    total, sums = as_sums(Reported((3.0, 2.0), {"moe_aux_loss": 0.5}, {"moe_dropped": 4}))
    assert (float(total), float(sums.weight), float(sums.means["moe_aux_loss"]),
            float(sums.sums["moe_dropped"])) == (3.0, 2.0, 0.5, 4.0)
    with pytest.raises(ValueError, match="'grad_norm'.*rename"):
        as_sums(Reported(1.0, {"grad_norm": 1.0}))
    with pytest.raises(TypeError, match="'moe_dropped' of shape \\(2,\\)"):
        as_sums(Reported(1.0, sums={"moe_dropped": jnp.ones(2)}))
    rec = {"loss": 2.0, "moe_aux_loss": 1.0312, "moe_dropped": 7.0, "step_time_s": 0.1,
           "tokens_per_s": 10.0, "tflops_per_device": 0.0}
    assert "| aux 1.0312 | dropped 7 |" in line(3, rec)
    assert "dropped" not in line(3, {**rec, "moe_dropped": 0.0})
