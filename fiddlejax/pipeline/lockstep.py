"""Collectives inside a stage's layer loops: found before the step runs, and made safe.

A pipeline tick runs each stage's action as loops over its chunk's layers whose trip counts
differ between stages (a stage that does no forward this tick runs its forward loop 0 times).
Collectives over the ``tensor`` axis that GSPMD inserts inside a layer are reached only by the
stages that run the loop. An all-reduce, all-gather or all-to-all joins only its own tensor
group, which is one stage, so that is safe. A collective-permute is not: XLA's CPU runtime
joins every device of the program in each collective-permute (its rendezvous names all of
them, whatever its source-target pairs), so the stages that skip the loop never arrive and
the step hangs (XLA aborts it after a while). GSPMD inserts collective-permutes to reshard
within a layer, e.g. a fused ``(d, 3d)`` query-key-value kernel split over ``tensor``: the
split into q, k and v falls at offsets ``d`` and ``2d``, not on the shard boundary ``1.5 d``.

:func:`needs_lockstep` compiles one layer's forward and backward alone, inside a stage
program whose loop only one stage runs (the structure of a tick), and looks for
collective-permutes. When it finds one the executor runs every stage's loops in lockstep
(``stage.tick``'s ``lockstep``): each tick, every stage runs every loop that any stage runs,
keeping only its own action's results. That is exact and cannot hang, and it costs the
compute of the loops a stage would have skipped (a warning says so and how to avoid it).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax import message

_UNSAFE = re.compile(r"= \S+ (collective-permute(?:-start)?)\(")


def unsafe_collectives(hlo_text: str) -> list[str]:
    """The collectives of a compiled program that every device of it must reach."""
    return _UNSAFE.findall(hlo_text)


def needs_lockstep(pipeline, layer: Callable, params: nnx.State, act: Any) -> bool:
    """Whether one layer of ``pipeline``'s stack, as laid out over ``tensor``, contains a
    collective that would hang a stage loop (see the module docstring); warns when it does.
    Cached per activation shape; False without ``tensor``, or with one stage."""
    plan = pipeline.plan
    if plan.tensor == 1 or pipeline.p == 1:
        return False
    key = tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(act))
    cache = pipeline.__dict__.setdefault("_lockstep", {})
    if key not in cache:
        found = unsafe_collectives(_probe(pipeline, layer, params, act))
        cache[key] = bool(found)
        if found:
            warnings.warn(
                f"the layers of {pipeline.staged.stack!r}, split over tensor={plan.tensor}, "
                f"need {len(found)} collective-permute(s) that GSPMD inserts to reshard inside "
                "a layer (e.g. a fused q/k/v kernel split over `tensor`, whose q|k|v boundaries "
                "are not shard boundaries); a stage loop that other stages skip would hang on "
                "them, so every stage runs every tick's layer loops in lockstep (exact; more "
                "compute per tick). To avoid the cost, split q, k and v over heads as separate "
                "kernels, or leave the fused kernel and its output projection replicated",
                stacklevel=2)
    return cache[key]


def _probe(pipeline, layer: Callable, params: nnx.State, act: Any) -> str:
    """The compiled text of one layer's forward and backward in a loop that only stage 0
    runs, its parameters split over ``pipe`` and ``tensor`` as the pipeline splits them."""
    mesh, stack, p = pipeline.plan.mesh, pipeline.staged.stack, pipeline.p
    lp = params[stack]  # the structure the executor hands its layers
    specs = pipeline.param_specs(params)[stack]

    def one(v, s, d):  # [p, v, lmax, *rest] -> one layer per stage [p, *rest], whole
        value = v.get_value() if isinstance(v, nnx.Variable) else v
        spec = s.get_value() if isinstance(s, nnx.Variable) else s
        rest = (tuple(spec)[3:] + (None,) * value.ndim)[: value.ndim - 3]
        shape = list(value.shape)
        if d >= 0:  # FSDP: inside the step `data` is manual and this is one replica's shard
            shape[d] *= pipeline.plan.data
        return jax.ShapeDtypeStruct((p, *shape[3:]), value.dtype,
                                    sharding=NamedSharding(mesh, P("pipe", *rest)))

    # Variables stay nodes of the structure (a parameter view's prefix trees have them)
    flat_lp, lp_def = jax.tree.flatten(lp)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    sharded = pipeline.data_dims is not None and pipeline.plan.fsdp_gather == "layer"
    dims = ([int(d) for d in jax.tree.leaves(pipeline.data_dims[stack])] if sharded
            else [-1] * len(flat_lp))  # fsdp_gather="step": the step gathered them already
    abstract = [one(v, s, d) for v, s, d in zip(flat_lp, flat_specs, dims, strict=True)]
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        (p, *a.shape), a.dtype, sharding=NamedSharding(mesh, P("pipe"))), act)

    def stage(leaves, h):
        lp_ = jax.tree.unflatten(lp_def, [a[0] for a in leaves])
        h = jax.tree.map(lambda a: a[0], h)

        def body(_, c):
            h, g = c
            out, vjp = jax.vjp(layer, lp_, h)
            dlp, dh = vjp(message.to_vjp(out))
            dh = message.from_vjp(dh, h)
            return (jax.tree.map(lambda a, b, c: (a + b).astype(c.dtype), dh, out, h),
                    [a + d.astype(a.dtype) for a, d in zip(g, jax.tree.leaves(dlp))])

        trips = jnp.where(jax.lax.axis_index("pipe") == 0, 1, 0)
        zeros = [jnp.zeros_like(a) for a in jax.tree.leaves(lp_)]
        h, g = jax.lax.fori_loop(0, trips, body, (h, zeros))
        return jax.tree.map(lambda a: a[None], h), [a[None] for a in g]

    program = jax.shard_map(stage, mesh=mesh, in_specs=(P("pipe"), P("pipe")),
                            out_specs=P("pipe"), axis_names={"pipe"}, check_vma=False)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.jit(program).lower(abstract, x).compile().as_text()


__all__ = ["needs_lockstep", "unsafe_collectives"]
