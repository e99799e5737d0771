"""Static per-stage FLOPs of a pipelined step: the work each stage really does.

XLA counts a ``while`` body once and a ``conditional`` as its costliest branch, so the real step
(a scan over ticks around a switch) cannot be measured directly. Here each stage's program is
built from the same model functions, its actions dispatched in Python in tick order with every
layer loop unrolled, so ``cost_analysis`` counts exactly that stage's work. Messages from other
stages come in as distinct inputs per tick (so XLA cannot merge microbatches) and messages to
them go out as outputs (so XLA keeps the work that made them).

The prologue and the head run over every device (vocabulary parallel, ``executor.Ends``), so
their FLOPs for the step's microbatches are measured once and split evenly over the stages.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from fiddlejax import message
from fiddlejax.pipeline import costs, executor


def stage_flops(pipeline, params: nnx.State, batch: dict, remat: Callable) -> list[dict]:
    """Compiled FLOPs of each stage's whole step: ``{"flops", "dot_flops"}`` per stage.

    ``flops`` is ``cost_analysis()``'s, ``dot_flops`` the matrix multiplies alone
    (:func:`costs.hlo_dot_flops`). Needs ``data == tensor == 1``.
    """
    plan = pipeline.plan
    if plan.data != 1 or plan.tensor != 1:
        raise ValueError("stage_flops needs a mesh with data=1 and tensor=1")
    spec_tree = pipeline.stack_specs(params)
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // pipeline.m, *x.shape[1:]),
                                                     x.dtype), batch)
    act = jax.eval_shape(pipeline.staged.prologue, params, mb)
    ticks = pipeline.schedule_run.ticks.num_ticks
    feed = jax.tree.map(lambda a: jax.ShapeDtypeStruct((ticks, *a.shape), a.dtype), act)
    edges = _edge_flops(pipeline, params, mb, act)
    out = []
    for st in range(pipeline.p):
        def per_device(prm, f, st=st):
            return _stage_program(pipeline, remat, st, prm, f)

        f = jax.shard_map(per_device, mesh=plan.mesh, in_specs=(spec_tree, P()),
                          out_specs=(spec_tree, P("pipe")), axis_names={"pipe"})
        compiled = jax.jit(f).lower(params, feed).compile()
        out.append({"flops": float(compiled.cost_analysis()["flops"]) + edges["flops"],
                    "dot_flops": costs.hlo_dot_flops(compiled.as_text()) + edges["dot_flops"]})
    return out


def _edge_flops(pl, params: nnx.State, mb: dict, act) -> dict:
    """Each stage's share of the step's prologue and head work (forward and backward)."""
    s = pl.staged

    def edges(prm, b, y, dx):
        x, pro_vjp = jax.vjp(lambda q: s.prologue(q, b), prm)
        loss, (g, dy) = jax.value_and_grad(s.epilogue, argnums=(0, 1), allow_int=True)(prm, y, b)
        return x, loss, g, message.from_vjp(dy, y), pro_vjp(message.to_vjp(dx))

    compiled = jax.jit(edges).lower(params, mb, act, act).compile()
    share = pl.m / pl.p
    return {"flops": float(compiled.cost_analysis()["flops"]) * share,
            "dot_flops": costs.hlo_dot_flops(compiled.as_text()) * share}


def _stage_program(pl, remat: Callable, st: int, prm, feed):
    """Stage ``st``'s layer work in tick order, unrolled: (gradients, messages sent)."""
    s, sched = pl.staged, pl.schedule_run
    place, last = sched.placement, sched.num_chunks - 1
    shard = executor.Shard([prm], s.stack)
    vary = executor.varying(("pipe",))
    local = shard.local  # [1, v, lmax, ...]: the device's slice of pipe
    chunk_params = executor.chunk_params(local, shard.stack_def, vary)
    layer = remat(s.layer)
    g_local = [jnp.zeros_like(x) for x in local]
    held, douts, own, sent = {}, {}, {}, []

    def incoming(key, t):  # a message from this stage itself, else one from a neighbour
        return own.pop(key) if key in own else jax.tree.map(lambda a: vary(a[t]), feed)

    def emit(key, to_stage, value):
        if to_stage == st:
            own[key] = value
        else:
            sent.append(value)

    def add_layers(j, grads):
        pad = [jax.tree.map(jnp.zeros_like, grads[0])] * (pl.lmax - len(grads))
        return executor.add_at(g_local, (0, j), jax.tree.map(lambda *a: jnp.stack(a),
                                                             *grads, *pad))

    for t, actions in enumerate(sched.ticks.ticks):
        a = actions[st]
        if a is None:
            continue
        op, i, c = a
        j = sched.chunks_of(st).index(c)
        cp = chunk_params(j, 0)
        layer_params = [jax.tree.map(lambda x, k=k: x[k], cp) for k in range(pl.counts[c])]
        if op == "F":  # chunk 0's input comes from the prologue, the last one's output goes
            x = incoming(("x", i, c), t)  # to the head: both over every device (edges)
            vjps = []
            for lp in layer_params:
                x, vjp = jax.vjp(layer, lp, x)
                vjps.append(vjp)
            held[(i, c)] = vjps
            if c == last:
                sent.append(x)
            else:
                emit(("x", i, c + 1), place[c + 1], x)
        elif op in ("B", "I"):
            dy, grads, outs = incoming(("dy", i, c), t), [], []
            for vjp in reversed(held[(i, c)]):
                outs.insert(0, dy)
                dlp, dx = vjp(message.to_vjp(dy))
                dy = message.from_vjp(dx, dy)
                grads.insert(0, dlp)
            if op == "B":
                g_local = add_layers(j, grads)
            else:
                douts[(i, c)] = outs
            if c == 0:
                sent.append(dy)
            else:
                emit(("dy", i, c - 1), place[c - 1], dy)
        else:  # W: weight gradients from the cotangents I kept
            grads = [vjp(message.to_vjp(d))[0] for vjp, d in zip(held[(i, c)],
                                                                  douts.pop((i, c)))]
            g_local = add_layers(j, grads)
    grads = shard.assemble([jnp.zeros_like(o[0]) for o in shard.outer],
                           g_local)
    sent = sent or [jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), feed)]
    return grads, jax.tree.map(lambda *a: jnp.stack(a)[None], *sent)


__all__ = ["stage_flops"]
