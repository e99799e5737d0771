"""The ``data`` axis as replicas: each computes its rows' loss and gradients, then they reduce.

A replica sums ``(loss, weight, gradients)`` over its microbatches; :func:`replica_mean`
scales the sums so that their mean over ``data`` is the step's weighted mean, and
:func:`reduce` takes that mean with the plan's all-reduce (XLA's, a
``fiddlejax.collectives`` algorithm, or the reduce-scatter onto ZeRO/FSDP shards). Without a
pipeline the replicas run under ``jax.shard_map`` manual over ``data``; with one, the pipeline
runtime runs them and is handed :func:`reduce_sums`. A loss's reported metrics
(``staged.Reported``) ride in the weight's place (``staged.Sums``) and reduce the same way
(:func:`reduce_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from fiddlejax import compute
from fiddlejax.finetune import lora
from fiddlejax.memory import remat as remat_
from fiddlejax.parallel import zero as zero_
from fiddlejax.plan import Plan
from fiddlejax.staged import Sums
from fiddlejax.state import in_param_dtypes

if TYPE_CHECKING:
    from fiddlejax.parallel.layout import Layout


def microbatch_loss(lay: Layout, remat: Callable, params: nnx.State,
                    batch: dict) -> tuple[jax.Array, Sums]:
    """(loss sum, Sums) of one microbatch (see ``staged.StagedModel.weighted_loss``)."""
    s = lay.model
    x = remat_.run_stack(remat, s.layer, params[s.stack], s.prologue(params, batch),
                         unroll=unrolled(lay))
    return s.weighted_loss(params, x, batch)


def unrolled(lay: Layout) -> bool:
    """Whether the layers run unrolled (``Plan.unroll_layers``; ``None``: off the CPU, unless
    the layout gathers the layers' weights per layer, FSDP, which the scan prefetches)."""
    if lay.plan.unroll_layers is not None:
        return lay.plan.unroll_layers
    return jax.default_backend() != "cpu" and lay.zero.dims is None


def local_sums(lay: Layout, remat: Callable, params: nnx.State, batch: dict):
    """(loss sum, Sums, gradients of the sum) of one replica's rows, summed over its
    microbatches (inside shard_map); :func:`replica_mean` normalizes them."""
    m = lay.plan.microbatches
    vg = jax.value_and_grad(lambda p, b: microbatch_loss(lay, remat, p, b), has_aux=True)
    adapters = lora.has_adapters(params)  # LoRA: only the adapters' gradients are summed

    def one(mb):
        (total, weight), grads = vg(params, mb)
        return total, weight, lora.drop_frozen(grads) if adapters else grads

    if m == 1:
        (total, sums), grads = vg(params, batch)
        return total, sums, jax.tree.map(
            lambda g: g.astype(compute.grad_dtype(g.dtype)), grads)
    mbs = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)

    def body(acc, mb):
        return jax.tree.map(jnp.add, acc, one(mb)), None

    zero = match_varying(jnp.zeros((), jnp.float32), jax.tree.leaves(params)[0])
    sums = sums_like(lay.model, params, jax.tree.map(lambda x: x[0], mbs))
    # float32 sums even for weights gathered once in bf16 (fsdp_gather="step")
    zeros = (zero, jax.tree.map(lambda a: _zero_like(zero, a), sums), jax.tree.map(
        lambda x: jnp.zeros_like(x, compute.grad_dtype(x.dtype)),
        lora.drop_frozen(params) if adapters else params))
    total, sums, grads = jax.lax.scan(body, zeros, mbs)[0]
    if adapters:  # the base's gradients: zeros, never accumulated
        grads = lora.fill_frozen(grads, params, lambda x: compute.grad_dtype(x.dtype))
    return total, sums, grads


def _zero_like(zero: jax.Array, like) -> jax.Array:
    """An accumulator for one reported sum: ``zero`` (float32) for a scalar, zeros of its own
    shape and dtype for an integer array (counts, e.g. the router's per-expert loads)."""
    if not like.shape:
        return zero
    return match_varying(jnp.zeros(like.shape, like.dtype), zero)


def sums_like(model, params: nnx.State, batch: dict) -> Sums:
    """The shapes of a microbatch's :class:`~fiddlejax.staged.Sums` (which metrics its loss
    reports), traced through the prologue and the head only: zeros for the accumulators."""
    return jax.eval_shape(lambda p, b: model.weighted_loss(p, model.prologue(p, b), b)[1],
                          params, batch)


def replica_mean(plan: Plan, total, sums: Sums, grads):
    """A replica's loss sum, gradients and metric means scaled so that their mean over
    ``data`` is the step's weighted mean: ``x * data / (sum of all replicas' weights)``. For a
    mean loss (weight 1 per microbatch) that is ``x / microbatches``, as for equal-sized
    shards. Returns (loss, gradients, Sums with the means scaled)."""
    n = plan.data
    all_weight = jax.lax.psum(sums.weight, "data") if n > 1 else sums.weight
    scale = n / all_weight
    means = {k: v * scale for k, v in sums.means.items()}
    return (total * scale, jax.tree.map(lambda g: g * scale.astype(g.dtype), grads),
            sums._replace(means=means))


def reduce_metrics(plan: Plan, scaled: Sums) -> dict:
    """The step's reported metrics from one replica's :func:`replica_mean`-scaled sums: the
    means averaged over ``data`` as the loss is, the sums added up."""
    means, sums = scaled.means, scaled.sums
    if plan.data > 1:
        means, sums = jax.lax.pmean(means, "data"), jax.lax.psum(sums, "data")
    return {**means, **sums}


def reduce(lay: Layout, loss, grads):
    """The mean over ``data`` of the replicas' scaled loss and gradients."""
    plan, zero = lay.plan, lay.zero
    n = plan.data
    if n == 1:  # no data parallelism: nothing to reduce
        return loss, grads
    loss = jax.lax.pmean(loss, "data")
    if lora.has_adapters(grads) and zero.scatter_dims is None:  # only adapters are exchanged
        dims = jax.tree.map(lambda _: -1, grads) if zero.dims is None else jax.tree.map(
            lambda d, g: jax.tree.map(lambda _: d, g), zero.dims, grads)  # one per leaf
        return loss, lora.reduce_frozen(
            grads, dims, lambda a, d: a / n if d >= 0 else jax.lax.pmean(a, "data"))
    if zero.scatter_dims is not None:  # whole sums (ZeRO-2, FSDP gathered once)
        grads = compute.scatter_whole(grads, zero.scatter_dims, zero.gather_specs)
    sharded = zero.dims if zero.dims is not None else zero.scatter_dims
    if sharded is not None:  # sharded leaves arrive reduce-scattered (summed): divide
        return loss, jax.tree.map(lambda d, g: jax.tree.map(
            lambda a: a / n if d >= 0 else jax.lax.pmean(a, "data"), g), sharded, grads)
    if plan.grad_allreduce in ("xla", "topk"):  # topk: the exact mean (no residual)
        return loss, jax.lax.pmean(grads, "data")
    from fiddlejax import collectives

    grads = collectives.allreduce_tree(grads, "data", algorithm=plan.grad_allreduce,
                                       bucket_bytes=plan.bucket_bytes)
    return loss, jax.tree.map(lambda g: g / n, grads)


def reduce_sums(lay: Layout, total, sums: Sums, grads):
    """The step's (loss, gradients, metrics) from one replica's sums (the pipeline's
    ``reduce``)."""
    loss, grads, scaled = replica_mean(lay.plan, total, sums, grads)
    return (*reduce(lay, loss, grads), reduce_metrics(lay.plan, scaled))


def loss_and_grads(lay: Layout, remat: Callable, params: nnx.State, batch: dict):
    """The step's exact loss, gradients (in the trainer's layout, each in its parameter's
    dtype: ``fiddlejax.state.in_param_dtypes``) and the loss's reported metrics (a dict, empty
    for most models), inside ``jit``."""
    loss, grads, metrics = _loss_and_grads(lay, remat, params, batch)
    return loss, in_param_dtypes(grads, params), metrics


def _loss_and_grads(lay: Layout, remat: Callable, params: nnx.State, batch: dict):
    plan, zero = lay.plan, lay.zero
    if lay.pipeline is not None:
        return lay.pipeline.loss_and_grads(
            params, batch, lambda *s: reduce_sums(lay, *s), remat,
            lambda p: zero_.gather_once(zero, p), zero_.scatter_specs(plan, zero, params))

    def per_replica(p, b):
        if plan.data > 1:
            p = zero_.vary_replicated(zero, p)
        return reduce_sums(lay, *local_sums(lay, remat, zero_.gather_once(zero, p), b))

    if plan.data == 1:  # nothing to make manual; GSPMD handles `tensor`
        return per_replica(params, batch)
    specs = P() if zero.dims is None else compute.only_data(zero.dims, params)
    grad_specs = zero_.scatter_specs(plan, zero, params) or specs
    return jax.shard_map(per_replica, mesh=plan.mesh, in_specs=(specs, P("data")),
                         out_specs=(P(), grad_specs, P()), axis_names={"data"})(params, batch)


def loss(lay: Layout, remat: Callable, params: nnx.State, batch: dict) -> jax.Array:
    """The step's mean loss without gradients (validation)."""
    if lay.pipeline is not None:  # the pipeline runs forward and backward together
        return _loss_and_grads(lay, remat, params, batch)[0]
    zero = lay.zero
    if zero.dims is None:
        total, sums = microbatch_loss(lay, remat, params, batch)
        return total / sums.weight

    def per_replica(p, b):  # FSDP: layers gather their weights over `data`
        total, sums = microbatch_loss(lay, remat, zero_.gather_once(zero, p), b)
        return jax.lax.psum(total, "data") / jax.lax.psum(sums.weight, "data")

    specs = compute.only_data(zero.dims, params)
    return jax.shard_map(per_replica, mesh=lay.plan.mesh, in_specs=(specs, P("data")),
                         out_specs=P(), axis_names={"data"})(params, batch)


def match_varying(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` marked varying over the manual axes ``like`` varies over (scan carries must agree)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    axes = tuple(sorted(getattr(mat, "varying", ()) or ()))
    return jax.lax.pcast(x, axes, to="varying") if axes else x

