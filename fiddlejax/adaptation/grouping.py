"""Unequal blocks cut into pipeline groups: each block's measured cost, PipeDream's program.

A pipeline runs at the pace of its slowest stage. Blocks that differ cost different amounts
(a CNN's early blocks work on large images with few channels, its late ones on small images
with many), so :func:`for_plan` measures every block on one example, compiled alone
(:func:`block_costs`: training FLOPs from ``cost_analysis``, the bytes a forward keeps for its
backward from ``memory_analysis``), and :func:`fiddlejax.pipeline.partition.balanced`, the
dynamic program of PipeDream, picks the contiguous groups whose largest cost is smallest.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fiddlejax.adaptation import dropout
from fiddlejax.adaptation.adapt import _shape_key
from fiddlejax.adaptation.hetero import HeteroModel
from fiddlejax.adaptation.side_inputs import activation
from fiddlejax.pipeline import schedules
from fiddlejax.pipeline.partition import partition


def block_costs(model: HeteroModel, params: nnx.State, example: dict,
                method: str = "cost") -> list[dict]:
    """Per block, measured on one example (``batch_spec(1)``): ``flops``, its compiled
    training FLOPs (forward and backward, ``cost_analysis``); ``params``, its parameter count;
    ``bytes``, what its training forward keeps for the backward plus its parameters
    (``memory_analysis``: output and argument bytes). ``method="params"`` measures counts only.
    """
    staged = model.to_staged(params)
    per = model._block_leaves()
    counts = [sum(math.prod(v.shape) for _, v in leaves) for leaves in per]
    if method == "params":
        return [{"params": float(c)} for c in counts]
    model._check_split(staged, example)
    io = model.checked[_shape_key(example)][3]
    outer = nnx.State({k: v for k, v in staged.items() if k != model.stack})
    blocks = [nnx.from_flat_state([(sub, v) for sub, v in leaves]) for leaves in per]

    def sides(o, b):  # the side inputs the blocks get (the prologue's work up to them)
        with dropout.keys(None, 0):
            args, kwargs = model._first_call(model._outer(o), b)
        return args[1:], kwargs

    def forward(i):
        def f(bp, h, o, b):
            args, kwargs = sides(o, b)
            with dropout.keys(None, i):
                return activation(model._block(i, bp, 0)(h, *args, **kwargs), model.block_output)
        return f

    def prologue_flops(o, b):  # the side inputs' own cost, measured alone and taken off
        return [a for a in jax.tree.leaves(sides(o, b)) if isinstance(a, jax.Array)]

    base = _compiled(prologue_flops, outer, example)
    out = []
    for i, (h, _) in enumerate(io):
        f = forward(i)

        def train(bp, x, o, b, f=f):
            y, vjp = jax.vjp(lambda p, xx: f(p, xx, o, b), bp, x)
            return vjp(jnp.ones_like(y))

        def kept(bp, x, o, b, f=f):  # what the backward needs, parameters left out
            leaves = jax.tree.leaves(jax.vjp(lambda p, xx: f(p, xx, o, b), bp, x)[1])
            mine = {id(v) for v in jax.tree.leaves(bp)}
            return [v for v in leaves if id(v) not in mine]

        flops = _compiled(train, blocks[i], h, outer, example).cost_analysis()
        mem = _compiled(kept, blocks[i], h, outer, example).memory_analysis()
        base_flops = float((base.cost_analysis() or {}).get("flops", 0.0))
        nbytes = sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize for _, v in per[i])
        out.append({"flops": max(float((flops or {}).get("flops", 0.0)) - base_flops, 0.0),
                    "params": float(counts[i]),
                    "bytes": float(mem.output_size_in_bytes + nbytes)})
    return out


def _compiled(f, *args):
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    return jax.jit(f).lower(*abstract).compile()


def state_bytes(model: HeteroModel, optimizer: Any) -> list[float]:
    """Per block, the bytes of its training state: parameters, their float32 gradient
    accumulators and ``optimizer``'s state for them (``jax.eval_shape`` of its ``init``)."""
    out = []
    for leaves in model._block_leaves():
        tree = {str(i): jax.ShapeDtypeStruct(v.shape, v.dtype) for i, (_, v) in enumerate(leaves)}
        state = jax.eval_shape(optimizer.init, tree)
        out.append(float(sum(math.prod(x.shape) * (x.dtype.itemsize + 4)
                             for x in tree.values())
                         + sum(math.prod(x.shape) * x.dtype.itemsize
                               for x in jax.tree.leaves(state))))
    return out


def for_plan(model: HeteroModel, params: nnx.State, plan: Any,
             example: dict | None = None, optimizer: Any = None) -> HeteroModel:
    """``model`` grouped for ``plan``: one group per pipeline chunk (``pipe x
    virtual_stages``), or one group without a pipeline; blocks per group by ``plan.partition``
    (:func:`fiddlejax.pipeline.partition.partition`): ``uniform`` counts, or PipeDream's
    dynamic program over each block's parameter count (``params``) or measured training FLOPs
    (``cost``, on the model's ``batch_spec(1)``). With ``plan.memory_budget`` (and
    ``optimizer``), each group's training state (:func:`state_bytes`) must fit the budget: a
    per-device bound on what the partition decides (activations depend on the batch, which is
    not known yet). With ``virtual_stages`` > 1 the split balances each pipeline stage's
    chunks together (the schedule's placement), not each chunk alone."""
    chunks = plan.pipe * plan.virtual_stages if plan.schedule else 1
    if chunks > model.unit:
        raise ValueError(f"{model.callsite}: {model.unit} unequal blocks cannot fill "
                         f"pipe x virtual_stages = {chunks} stages; use at most {model.unit}")
    if plan.partition == "uniform" or chunks == 1:
        return model.regrouped(partition(model.unit, chunks, "uniform"))
    if plan.partition == "cost" and example is None:
        raise ValueError(f"partition='cost' measures each block of {model.callsite} on an "
                         "example: give the model batch_spec(batch_size) (a dict of "
                         "jax.ShapeDtypeStruct), or use partition='params' or 'uniform'")
    field = "flops" if plan.partition == "cost" else "params"
    costs = [c[field] for c in block_costs(model, params, example, plan.partition)]
    bound = plan.memory_budget if optimizer is not None else None
    memory = state_bytes(model, optimizer) if bound is not None else None
    placement = None  # interleaved: a stage runs several chunks, their sum sets its pace
    if plan.virtual_stages > 1:
        placement = schedules.build(plan.schedule, plan.pipe, plan.microbatches,
                                    plan.virtual_stages).placement
    try:
        counts = partition(model.unit, chunks, plan.partition, layer_costs=costs,
                           layer_memory=memory, memory_budget=bound, placement=placement)
    except ValueError as e:
        if bound is None:
            raise
        raise ValueError(f"{model.callsite}: the training state of its unequal blocks (parameters,"
                         f" float32 gradients, optimizer state) does not fit Plan(memory_budget="
                         f"{bound}) in any split: {e}") from None
    return model.regrouped(counts)


__all__ = ["block_costs", "for_plan", "state_bytes"]
