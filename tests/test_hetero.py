"""Pipelines over unequal blocks (issue 50): an MLP whose widths change and a small CNN whose
blocks downsample, grouped one group per pipeline chunk (:mod:`fiddlejax.adaptation.hetero`),
exact against one device on data x pipe and pipe=4, under GPipe, 1F1B, ZB-H1, ZB-V and
interleaved 1F1B; PipeDream-2BW follows its one-step-stale rule."""

from __future__ import annotations

import dataclasses
import itertools
import random

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import assert_close, assert_loss_and_grads, stale_reference
from test_any_model import plan_for

import fiddlejax as fj
from fiddlejax.adaptation import grouping
from fiddlejax.pipeline.partition import balanced, chunk_costs, stage_loads


def check_exact(model, call, loss_fn, batch, layers, layout_, partition="uniform", **plan_kw):
    """Loss and every gradient leaf equal one device's ``jax.value_and_grad``."""
    plan = dataclasses.replace(plan_for(layout_), partition=partition, **plan_kw)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan, loss=loss_fn, layers=layers)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def ref(p):
        return loss_fn(call(nnx.merge(graphdef, p, rest, copy=True)), batch)

    want = jax.jit(jax.value_and_grad(ref))(params)
    state = trainer.init()
    assert_loss_and_grads(trainer.loss_and_grads(state, batch), want)
    assert_close(trainer.params(state), params, 1e-7)
    return trainer


class Dense(nnx.Module):
    def __init__(self, i: int, o: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(i, o, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class MLP(nnx.Module):
    """Blocks of widths 6 -> 12 -> 4 -> 16 -> 8 -> 10 -> 6 -> 5: no two alike."""

    def __init__(self, widths=(6, 12, 4, 16, 8, 10, 6, 5), rngs=None):
        self.blocks = nnx.List([Dense(a, b, rngs) for a, b in zip(widths, widths[1:])])
        self.head = nnx.Linear(widths[-1], 3, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


BATCH = {"x": jax.random.normal(jax.random.key(0), (8, 6)),
         "y": jax.random.normal(jax.random.key(1), (8, 3))}


@pytest.mark.parametrize("layout_", [(2, 2, 2, "gpipe", 4, 1), (2, 4, 1, "1f1b", 4, 1),
                                     (2, 2, 2, "zb-h1", 4, 1), (4, 2, 1, "zb-v", 2, 2)],
                         ids=["gpipe-2x2x2", "1f1b-pipe4", "zb-h1-2x2x2", "zb-v-4x2"])
def test_unequal_mlp_exact(layout_):
    model = MLP(rngs=nnx.Rngs(0))
    trainer = check_exact(model, lambda m: m(BATCH["x"]), mse, BATCH, "blocks", layout_)
    assert trainer.staged.num_layers == layout_[1] * layout_[5]


def test_unequal_mlp_2bw_follows_the_one_step_stale_rule():
    """PipeDream-2BW over unequal blocks: W(t+1) = W(t) + update(grad f(W(t-1))), W(-1) = W(0),
    two steps in one unflushed program then one more call, against one device's emulation."""
    opt = optax.adamw(1e-2)
    ref = MLP(rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)
    batches = [{"x": jax.random.normal(jax.random.key(10 + i), (8, 6)),
                "y": jax.random.normal(jax.random.key(20 + i), (8, 3))} for i in range(4)]

    def loss(p, b):
        return mse(nnx.merge(graphdef, p, rest, copy=True)(b["x"]), b)

    want, _, cur = stale_reference(loss, opt, params, batches)
    plan = plan_for((2, 2, 2, "2bw", 2, 1))
    trainer = fj.parallelize(MLP(rngs=nnx.Rngs(0)), opt, plan, loss=mse, layers="blocks")
    stacked = {k: jnp.stack([b[k] for b in batches[:2]]) for k in batches[0]}
    state, m = trainer.steps(trainer.init(), stacked)
    got = [float(x) for x in m["loss"]]
    for b in batches[2:]:
        state, m = trainer.step(state, b)
        got.append(float(m["loss"]))
    assert got == pytest.approx(want, rel=1e-5)
    assert int(state.step) == 4
    assert_close(jax.tree.leaves(trainer.params(state)), jax.tree.leaves(cur))


class Conv(nnx.Module):
    """A CNN block: a 3x3 convolution (strided and widening where it downsamples), relu, and a
    residual connection where the shape allows it."""

    def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), strides=stride, rngs=rngs)
        self.norm = nnx.GroupNorm(cout, num_groups=2, rngs=rngs)
        self.same = cin == cout and stride == 1

    def __call__(self, x):
        y = jax.nn.relu(self.norm(self.conv(x)))
        return x + y if self.same else y


class CNN(nnx.Module):
    def __init__(self, rngs=None):
        self.stem = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        spec = [(4, 4, 1), (4, 8, 2), (8, 8, 1), (8, 16, 2), (16, 16, 1)]
        self.blocks = nnx.List([Conv(a, b, s, rngs) for a, b, s in spec])
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, images):
        x = self.stem(images)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(axis=(1, 2)))

    def batch_spec(self, b: int) -> dict:
        return {"images": jax.ShapeDtypeStruct((b, 8, 8, 3), jnp.float32),
                "labels": jax.ShapeDtypeStruct((b,), jnp.int32)}


def labels_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


IMAGES = {"images": jax.random.normal(jax.random.key(2), (8, 8, 8, 3)),
          "labels": jax.random.randint(jax.random.key(3), (8,), 0, 10)}


@pytest.mark.parametrize("layout_", [(2, 2, 2, "interleaved-1f1b", 4, 2)],
                         ids=["interleaved-2x2x2"])
def test_downsampling_cnn_partitioned_by_cost_exact(layout_):
    """Blocks that halve the image and double the channels, grouped by measured FLOPs."""
    model = CNN(rngs=nnx.Rngs(0))
    trainer = check_exact(model, lambda m: m(IMAGES["images"]), labels_ce, IMAGES, "blocks",
                          layout_, "cost")
    assert trainer.staged.num_layers == layout_[1] * layout_[5]
    # each stage's two chunks balanced together (the schedule's placement), not chunk by chunk
    staged, canonical = fj.split_model(model, labels_ce, layers="blocks")
    costs = [c["flops"] for c in grouping.block_costs(staged, canonical, model.batch_spec(1))]
    placement = trainer.pipeline.schedule.placement
    counts = [b - a for a, b in trainer.staged.groups]
    assert max(stage_loads(counts, costs, placement)) == pytest.approx(
        _brute_stages(costs, placement), rel=1e-9)


def test_block_costs_measure_flops_and_memory():
    """Compiled training FLOPs follow the convolutions' work: block 0 (8x8 pixels, 4 -> 4
    channels) does twice block 1's (4x4 pixels after its stride, 4 -> 8)."""
    model = CNN(rngs=nnx.Rngs(0))
    staged, canonical = fj.split_model(model, labels_ce, layers="blocks")
    costs = grouping.block_costs(staged, canonical, model.batch_spec(1))
    flops = [c["flops"] for c in costs]
    assert all(f > 0 for f in flops) and all(c["bytes"] > 0 for c in costs)
    assert flops[0] / flops[1] == pytest.approx(2.0, rel=0.05), flops
    assert costs[4]["bytes"] > costs[0]["bytes"]  # 16 x 16 x 9 weights against 4 x 4 x 9


def _brute(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        m = max(chunk_costs(counts, costs))
        best = m if best is None else min(best, m)
    return best


def test_partitioner_is_optimal_against_brute_force():
    """PipeDream's dynamic program: the smallest possible slowest stage, on uneven costs."""
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(2, 10)
        k = rng.randint(1, n)
        costs = [rng.uniform(0.1, 10.0) ** 2 for _ in range(n)]
        counts = balanced(costs, k)
        assert len(counts) == k and sum(counts) == n and min(counts) >= 1
        assert max(chunk_costs(counts, costs)) == pytest.approx(_brute(costs, k), rel=1e-9)
    # a known uneven list: one heavy block alone on a stage, the rest shared
    assert balanced([1, 1, 1, 1, 8, 1, 1, 1, 1, 2], 3) == [4, 1, 5]


def _brute_stages(costs, placement):
    n, k = len(costs), len(placement)
    return min(max(stage_loads([b - a for a, b in zip([0, *cuts], [*cuts, n])], costs,
                                placement))
               for cuts in itertools.combinations(range(1, n), k - 1))


def test_interleaved_partitioner_balances_stages_against_brute_force():
    """With several chunks a stage (interleaved 1F1B's round robin, ZB-V's V), a stage runs at
    the pace of its chunks' sum: the split gives the smallest possible slowest stage, which the
    chunk-balanced split often misses."""
    rng = random.Random(2)
    missed = 0
    for t in range(60):
        p = rng.choice([2, 3])
        n = rng.randint(2 * p, 12)
        placement = [*range(p), *range(p)] if t % 2 else [*range(p), *reversed(range(p))]
        costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
        counts = balanced(costs, 2 * p, placement=placement)
        assert len(counts) == 2 * p and sum(counts) == n and min(counts) >= 1
        best = _brute_stages(costs, placement)
        assert max(stage_loads(counts, costs, placement)) == pytest.approx(best, rel=1e-9)
        missed += max(stage_loads(balanced(costs, 2 * p), costs, placement)) > best * 1.001
    assert missed > 10
    # ResNet-50's 16 bottleneck costs (benchmarks/hetero_pipeline.md, in 10 kFLOPs) on 4
    # stages: whole blocks, one chunk a stage, cannot beat 1.25 slowest / fastest; two chunks
    # a stage come within 15%
    resnet = [68, 68, 68, 95, 54, 54, 54, 81, 43, 43, 43, 43, 43, 71, 34, 34]
    one = chunk_costs(balanced(resnet, 4), resnet)
    two = stage_loads(balanced(resnet, 8, placement=[0, 1, 2, 3] * 2), resnet, [0, 1, 2, 3] * 2)
    assert max(one) / min(one) > 1.2 and max(two) / min(two) < 1.15


def _brute_bounded(costs, memory, budget, k):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, len(costs)])]
        if max(chunk_costs(counts, memory)) > budget:
            continue
        m = max(chunk_costs(counts, costs))
        best = m if best is None else min(best, m)
    return best


def test_partitioner_with_a_memory_budget_is_optimal_against_brute_force():
    """PipeDream's memory constraint: the smallest slowest stage among the splits whose every
    chunk's memory fits the budget; a budget no split meets is refused with the one it needs."""
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(2, 9)
        k = rng.randint(1, n)
        costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
        memory = [rng.uniform(0.1, 10.0) for _ in range(n)]
        need = max(chunk_costs(balanced(memory, k), memory))
        budget = need * rng.uniform(1.0, 1.6)
        counts = balanced(costs, k, layer_memory=memory, memory_budget=budget)
        assert max(chunk_costs(counts, memory)) <= budget * (1 + 1e-9)
        assert max(chunk_costs(counts, costs)) == pytest.approx(
            _brute_bounded(costs, memory, budget, k), rel=1e-9)
        if k < n:
            with pytest.raises(ValueError, match="memory_budget=.*needs"):
                balanced(costs, k, layer_memory=memory, memory_budget=need * 0.99)
    # costs alone put the two heavy-memory layers together; the budget splits them
    assert balanced([5, 1, 1, 1], 2) == [1, 3]
    assert balanced([5, 1, 1, 1], 2, layer_memory=[1, 4, 4, 1], memory_budget=6) == [2, 2]


def test_cnn_groups_keep_their_training_state_within_the_memory_budget():
    """Plan(memory_budget=) bounds each group's parameters, float32 gradients and optimizer
    state (grouping.state_bytes): the split moves off the FLOPs-only one and stays exact."""
    model = CNN(rngs=nnx.Rngs(0))
    layout_ = (2, 2, 2, "1f1b", 4, 1)
    free = check_exact(model, lambda m: m(IMAGES["images"]), labels_ce, IMAGES, "blocks",
                       layout_, "cost")
    state = grouping.state_bytes(free.staged, optax.sgd(0.1))
    sizes = lambda t: [sum(state[a:b]) for a, b in t.staged.groups]  # noqa: E731
    budget = int(0.9 * max(sizes(free)))
    bounded = check_exact(model, lambda m: m(IMAGES["images"]), labels_ce, IMAGES, "blocks",
                          layout_, "cost", memory_budget=budget)
    assert bounded.staged.groups != free.staged.groups
    assert max(sizes(bounded)) <= budget
    tight = dataclasses.replace(plan_for(layout_), partition="cost",
                                memory_budget=int(0.4 * max(state)))
    with pytest.raises(ValueError, match="memory_budget"):
        fj.parallelize(model, optax.sgd(0.1), tight, loss=labels_ce, layers="blocks")


@pytest.mark.parametrize("schedule,mesh,v", [("1f1b", (4, 2), 1),
                                             ("interleaved-1f1b", (4, 2), 2)],
                         ids=["1f1b", "interleaved"])
def test_planner_prices_unequal_blocks_as_compiled(schedule, mesh, v):
    """planner.unequal.spec: the groups as the pipeline runs them (padded parameter rows,
    residual buffers sized for the largest group, each group's measured FLOPs). Its predicted
    parameters and optimizer state equal the compiled step's arguments within 5% (the batch
    is the rest), its total the compiled peak within 10%; a stage's pace is its groups'
    sum."""
    from fiddlejax import planner
    from fiddlejax.planner import unequal
    from fiddlejax.planner.footprint import chunk_cost_scale

    model = CNN(rngs=nnx.Rngs(0))
    plan = fj.Plan(mesh=fj.make_mesh(data=mesh[0], pipe=mesh[1], tensor=1), schedule=schedule,
                   virtual_stages=v, microbatches=2, partition="cost")
    trainer = fj.parallelize(model, optax.adam(1e-3), plan, loss=labels_ce, layers="blocks")
    _, canonical = fj.split_model(model, labels_ce, layers="blocks")
    spec = unequal.spec(trainer.staged, canonical, model.batch_spec(1))
    batch = 64  # activations the larger part, as at scale (compiled, never run)
    layout_ = unequal.layout(plan, batch)
    got = planner.predict(spec, planner.cluster("h100", nodes=1), layout_).memory
    compiled = trainer.memory(batch=model.batch_spec(batch))
    inputs = sum(a.size * a.dtype.itemsize for a in model.batch_spec(batch).values()) / mesh[0]
    assert got.params + got.optimizer == pytest.approx(compiled["argument_bytes"] - inputs,
                                                       rel=0.05)
    assert got.total == pytest.approx(compiled["peak_bytes"] - inputs, rel=0.10)
    costs = [c["flops"] for c in grouping.block_costs(trainer.staged, canonical,
                                                     model.batch_spec(1))]
    counts = [b - a for a, b in trainer.staged.groups]
    loads = stage_loads(counts, costs, trainer.pipeline.schedule.placement)
    assert chunk_cost_scale(spec, layout_) == pytest.approx(
        max(loads) / v / (sum(costs) / len(counts)), rel=1e-6)


def test_epilogue_of_unequal_blocks_is_the_loss():
    """``StagedModel.epilogue`` on an adapted model (whose ``weighted_loss`` takes no ``ops``):
    the prologue, every group, then the epilogue give one device's loss."""
    model = CNN(rngs=nnx.Rngs(0))
    staged, canonical = fj.split_model(model, labels_ce, layers="blocks")
    grouped = staged.regrouped([staged.unit])
    params = grouped.to_staged(canonical)
    x = grouped.prologue(params, IMAGES)
    layer = jax.tree.map(lambda a: a[0], params[grouped.stack])
    got = grouped.epilogue(params, grouped.layer(layer, x), IMAGES)
    assert float(got) == pytest.approx(float(labels_ce(model(IMAGES["images"]), IMAGES)),
                                       rel=1e-6)
