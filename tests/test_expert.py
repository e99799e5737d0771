"""fiddlejax/parallel/expert.py: the ``expert`` mesh axis. MoE experts split over it (a quarter
of their bytes per device at expert=4), tokens sent to them by all-to-all, loss (router losses
included) and gradients equal to one device on expert x data x tensor and under a 1F1B
pipeline; an outside MoE model's experts split by inferred names; clear refusals. The
interleaved pipeline and zero=3 run by hand (``benchmarks/expert_parallel.py --check``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads, reference_loss_and_grads, tokens
from test_moe import CFG, TinyMoE

import fiddlejax as fj

MOE = dataclasses.replace(CFG, router_aux_loss_coef=0.5, router_z_loss_coef=0.1)


def specs_of(state) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(state)}


def test_mesh_order_and_refusals():
    """``expert`` sits between ``context`` and ``tensor``; a count it does not divide, a model
    without experts (by parallelize) and ``context`` beside it (by the Plan) are refused
    before anything compiles."""
    mesh = fj.make_mesh(data=2, expert=2, tensor=2)
    assert mesh.axis_names == ("data", "pipe", "context", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 2, "pipe": 1, "context": 1, "expert": 2, "tensor": 2}
    assert fj.Plan(mesh=mesh).expert == 2 and fj.Plan(mesh=mesh).describe()["mesh"]["expert"] == 2
    model = TinyMoE(MOE, vocab=32, layers=2, rngs=nnx.Rngs(0))  # 4 experts
    with pytest.raises(ValueError, match=r"expert=8 .* holds 4 experts, not a multiple of 8; "
                                         r"use mesh expert in \[1, 2, 4\]"):
        fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(expert=8)))
    with pytest.raises(ValueError, match="expert=2 with context=2: .* use one of them"):
        fj.Plan(mesh=fj.make_mesh(context=2, expert=2, data=2))
    with pytest.raises(ValueError, match="sequence_parallel=True with expert=2: .* drop"):
        fj.Plan(mesh=fj.make_mesh(expert=2, tensor=2, data=2), sequence_parallel=True)
    with pytest.raises(ValueError, match="expert=2 splits MoE experts .* no parameter"):
        fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(data=4, expert=2),
                                                      rules={"expert": None}))


def test_expert4_holds_a_quarter_of_the_experts():
    """expert=4 x data=2: each device holds 1/4 of every expert weight's bytes (its 1 of 4
    experts, every layer's); with tensor=2 inside, 1/8 (gate and up by columns, down by rows)."""
    model = TinyMoE(MOE, vocab=32, layers=2, rngs=nnx.Rngs(0))
    for sizes, share in (({"data": 2, "expert": 4}, 0.25), ({"expert": 4, "tensor": 2}, 0.125)):
        trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(**sizes)))
        weights = {k: v for k, v in specs_of(trainer.init().params).items() if "'w_" in k}
        assert {k.split("'")[5]: tuple(w.sharding.spec) for k, w in weights.items()} == {
            "w_gate": (None, "expert", None, "tensor"), "w_up": (None, "expert", None, "tensor"),
            "w_down": (None, "expert", "tensor", None)}  # [layers, E, d, f], [layers, E, f, d]
        for w in weights.values():
            held = max(s.data.nbytes for s in w.addressable_shards) / w.nbytes
            assert held == share <= 0.3


def check_exact(sizes: dict, cfg=MOE, **plan):
    model = TinyMoE(cfg, vocab=32, layers=4, rngs=nnx.Rngs(0))
    batch = tokens(3, 8, 8, 32)
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(**sizes), **plan))
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    return trainer, state, batch


def test_dropless_on_expert_data_tensor_matches_one_device():
    """expert=2 x data=2 x tensor=2: each expert's matrices split over tensor, the experts over
    expert, the tokens sent there by all-to-all; the loss with its router losses and every
    gradient equal one device's."""
    trainer, state, batch = check_exact({"data": 2, "expert": 2, "tensor": 2}, microbatches=2)
    text = trainer.lower_loss_and_grads(state, batch).as_text()
    assert text.count("all_to_all") >= 3  # tokens and their tags out, the results back


def test_dropless_on_expert_pipe_data_1f1b_matches_one_device():
    check_exact({"data": 2, "pipe": 2, "expert": 2}, schedule="1f1b", microbatches=2)


def test_capacity_on_expert4_tensor_matches_one_device():
    """Capacity dispatch (factor 0.75: tokens drop) on expert=4 x tensor=2: each sequence's
    ``[E, C, d]`` buffer is cut by destination and sent by all-to-all; the same tokens drop
    as on one device (capacity is per sequence), loss and gradients equal."""
    cfg = dataclasses.replace(MOE, dispatch="capacity", capacity_factor=0.75)
    trainer, state, batch = check_exact({"expert": 4, "tensor": 2}, cfg)
    assert trainer.lower_loss_and_grads(state, batch).as_text().count("all_to_all") >= 2


@pytest.mark.parametrize("sizes", [{"data": 2, "expert": 4}, {"expert": 4, "tensor": 2}])
def test_zero3_stores_dense_weights_over_data_and_expert(sizes):
    """zero=3 with expert=4: outside the MoE layers ``expert`` is more data parallelism, so the
    dense weights (attention, embedding, router) are stored over data x expert too, 1/8 on each
    device (with data=1, over expert alone); the experts' own, split over ``expert`` by expert,
    shard over ``data`` beside it. Loss and gradients equal one device's."""
    trainer, state, _ = check_exact(sizes, zero=3)
    mesh = dict(trainer.plan.mesh.shape)
    for k, w in specs_of(state.params).items():
        axes = jax.tree.leaves(tuple(w.sharding.spec))
        assert "expert" in axes and ("data" in axes) == (mesh["data"] > 1), (k, axes)
        held = max(s.data.nbytes for s in w.addressable_shards) / w.nbytes
        assert held == 1 / np.prod([mesh[a] for a in axes]) <= 1 / 4, (k, held)


class OutsideMoE(nnx.Module):
    """An MoE block written without fiddlejax: no sharding names, stacked expert weights, its
    own dense dispatch (every expert on every token, weighted by the top-2 softmax gates)."""

    def __init__(self, d: int, f: int, e: int, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.3)
        self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs)
        self.experts_up = nnx.Param(init(rngs.params(), (e, d, f)))
        self.experts_down = nnx.Param(init(rngs.params(), (e, f, d)))

    def __call__(self, x):
        p = jax.nn.softmax(self.router(x), -1)
        top, idx = jax.lax.top_k(p, 2)
        w = jnp.sum(jax.nn.one_hot(idx, p.shape[-1]) * top[..., None], -2)
        h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, self.experts_up[...]))
        return x + jnp.einsum("btef,efd,bte->btd", h, self.experts_down[...], w)


class OutsideLM(nnx.Module):
    def __init__(self, vocab=32, d=16, layers=2, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([OutsideMoE(d, 24, 4, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_outside_moe_model_gets_its_experts_split():
    """``layers="blocks"``: the 3-D expert weights are named ``(expert, embed, mlp)`` /
    ``(expert, mlp, embed)`` and split over ``expert`` (and ``tensor`` inside); its own
    dispatch runs on them, partitioned by GSPMD, with the single-device loss and gradients."""
    model = OutsideLM()

    @fj.next_token  # the model gets tokens[:, :-1]
    def loss_fn(logits, batch):  # its take_along_axis runs on the rows (expert.loss_inputs)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]).mean()

    def call(m, batch):
        return m(batch["tokens"][:, :-1])

    plan = fj.Plan(mesh=fj.make_mesh(data=2, expert=2, tensor=2))
    with pytest.warns(UserWarning, match=r"split over experts \('expert', 'embed', 'mlp'\)"):
        trainer = fj.parallelize(model, optax.sgd(0.1), plan, loss=loss_fn, layers="blocks")
    batch = tokens(4, 8, 8, 32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(
        call(nnx.merge(graphdef, p, rest, copy=True), batch), batch)))(params)
    state = trainer.init()
    got = {k: tuple(v.sharding.spec) for k, v in specs_of(state.params).items() if "experts" in k}
    assert sorted(got.items()) == [
        ("['blocks']['experts_down'].value", (None, "expert", "tensor", None)),  # [L, E, f, d]
        ("['blocks']['experts_up'].value", (None, "expert", None, "tensor"))]
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    assert np.isfinite(float(loss))
