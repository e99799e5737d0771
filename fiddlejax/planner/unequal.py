"""The planner's view of a model of unequal blocks, measured as its pipeline runs it.

A pipeline over unequal blocks (:mod:`fiddlejax.adaptation.hetero`) runs one *group* of
blocks per chunk, each group's parameters one row padded to the largest group's, its
residuals packed into buffers sized for the largest group's, and the activation in a transfer
buffer as wide as the widest group boundary. To the runtime these are ``pipe x
virtual_stages`` equal layers of unequal cost, and that is the :class:`ModelSpec` given here:
one layer per group, the largest group's parameters, residuals and boundary, and each group's
measured training FLOPs as ``layer_costs`` (the timing model runs each stage at its groups'
pace). A group's forward holds its residuals twice at its peak, as ``jax.vjp`` leaves them
and packed into the stash's buffers (its backward, as unpacked from them): the working set is
two of the largest group's residual sets (``act``), the stash one (``act_stashed``). Every
measurement comes from XLA (``cost_analysis`` and ``memory_analysis`` of each block compiled
alone, :func:`fiddlejax.adaptation.grouping.block_costs`), so a spec holds for the groups it
was made for: make one per grouping (``trainer.staged``), predict its layout.
"""

from __future__ import annotations

import math
from typing import Any

from fiddlejax.planner.space import Layout
from fiddlejax.planner.workload import ModelSpec


def spec(staged: Any, params: Any, example: dict, *, name: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``staged``, a model of unequal blocks grouped for its plan
    (``trainer.staged``), with its canonical ``params`` (``fj.split_model``'s) and ``example``,
    a batch of one sample (the model's ``batch_spec(1)``).

    FLOPs are per sample, forward only (training ~3x, as :class:`ModelSpec` counts them).
    Every parameter is replicated over ``tensor`` (a group's parameters are one flat buffer).
    """
    import jax

    from fiddlejax.adaptation import grouping
    from fiddlejax.adaptation.adapt import _shape_key

    groups = getattr(staged, "groups", None)
    if groups is None or not hasattr(staged, "regrouped"):
        raise TypeError(f"{type(staged).__name__} is not a model of unequal blocks; planner."
                        "workload.from_flax measures stacked models")
    blocks = grouping.block_costs(staged, params, example)
    io = staged.checked[_shape_key(example)][3]
    per_group = [blocks[a:b] for a, b in groups]
    flops = [sum(c["flops"] for c in g) / 3.0 for g in per_group]
    group_params = [int(sum(c["params"] for c in g)) for g in per_group]
    nbytes = {jax.numpy.dtype(v.dtype).itemsize for leaves in staged._block_leaves()
              for _, v in leaves}
    if len(nbytes) != 1:
        raise ValueError(f"{staged.callsite}: blocks of mixed parameter dtypes; the planner "
                         "prices one parameter dtype")
    width = nbytes.pop()
    # what each group's backward needs beyond its parameters, in elements of the parameters'
    # dtype (block_costs' bytes hold both)
    kept = [sum(c["bytes"] - c["params"] * width for c in g) / width for g in per_group]
    boundary = max(math.prod(io[a][0].shape[1:]) for a, _ in groups)
    boundary = max(boundary, math.prod(io[-1][1].shape[1:]))
    pro_flops, epi_flops = _outer_flops(staged, params, example)
    outer = [int(math.prod(v.shape)) for p, v in _outer_leaves(staged, params)]
    return ModelSpec(
        name=name or staged.callsite.split(".")[0].lower(), num_layers=len(groups), seq_len=1,
        hidden=boundary, layer_params=(0, max(group_params)), prologue_params=(0, sum(outer)),
        epilogue_params=(0, 0), layer_flops=sum(flops) / len(flops),
        prologue_flops=pro_flops, epilogue_flops=epi_flops,
        act={"none": (0.0, 2 * max(kept)), "full": (0.0, float(boundary))},
        act_stashed=(0.0, max(kept)), act_none_full=2 * max(kept), boundary=boundary,
        tp_allreduces=0,
        layer_costs=tuple(flops), outer_leaves=tuple((n, False) for n in outer))


def layout(plan: Any, global_batch: int) -> Layout:
    """The planner's :class:`Layout` of ``plan`` (a ``fj.Plan``) at ``global_batch``."""
    mesh = plan.mesh.shape
    data, pipe = mesh.get("data", 1), mesh.get("pipe", 1)
    per = global_batch // (data * plan.microbatches)
    return Layout(tensor=mesh.get("tensor", 1), pipe=pipe, data=data,
                  virtual_stages=plan.virtual_stages, microbatch_size=per,
                  global_batch=global_batch, schedule=plan.schedule if pipe > 1 else None,
                  zero=plan.zero)


def _outer_leaves(staged: Any, params: Any) -> list:
    from flax import nnx

    keys = staged.block_keys
    return [(p, v) for p, v in nnx.to_flat_state(params)
            if not any(p[:len(k)] == k for k in keys)]


def _outer_flops(staged: Any, params: Any, example: dict) -> tuple[float, float]:
    """Forward FLOPs per sample of the prologue (up to the first block) and of the epilogue
    (after the last block, the loss included): a third of their compiled training FLOPs."""
    import jax
    import numpy as np

    grouped = staged.to_staged(params)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype),
                            (grouped, example))

    def flops(f) -> float:
        cost = jax.jit(jax.grad(f, allow_int=True)).lower(*abstract).compile().cost_analysis()
        return float((cost or {}).get("flops", 0.0)) / 3.0

    def pro(p, b):
        return sum(x.sum() for x in jax.tree.leaves(staged.prologue(p, b)) if x.dtype.kind == "f")

    def epi(p, b):  # the head on a message of the stack's output's shape
        total, sums = staged.weighted_loss(p, staged.prologue(p, b), b)
        return total / sums.weight

    first = flops(pro)
    return first, max(flops(epi) - first, 0.0)


__all__ = ["layout", "spec"]
