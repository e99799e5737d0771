"""The tick scan: one stage's share of a schedule, run inside ``jax.shard_map`` over ``pipe``.

Per tick, each device reads its :class:`~fiddlejax.pipeline.tables.Row`, reads the buffer slots
the row names, runs one action in a ``lax.switch`` (``stage.branches``), writes what the action
returned into the row's slots, and exchanges the tick's message with its neighbours: one
``ppermute`` forward and one backward (one in all when ``pipe`` is 2). Nothing the size of the
stash or of the gradient accumulators passes through the switch, so XLA updates them in place.

PipeDream-2BW runs K optimizer steps in one program: two weight versions, one scan per step's
ticks, and each step's update applied between the scans (``update``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fiddlejax.pipeline import stage as stage_lib
from fiddlejax.pipeline import tables as tb


class Carry(NamedTuple):
    """What the tick scan carries; every field is updated slot by slot."""

    stash: list         # residual buffers [num_stash, lmax, ...], one per residual leaf
    inbox: jax.Array    # [num_inbox, *activation]: messages waiting to be used (+ trash slot)
    wdy: Any            # [num_wdy, lmax, *activation] (split backwards), else None
    g_local: list       # weight gradients of the stage's layers [versions, v, lmax, ...]
    g_outer: list       # gradients of the parameters outside the stack [versions, ...]
    loss: jax.Array     # [steps]: summed microbatch loss sums per optimizer step
    weight: jax.Array   # [steps]: summed microbatch loss weights per optimizer step


def read(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, False)


def write(buf, i, x):
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def add_at(leaves: list, idx: tuple, update) -> list:
    """``leaves[k][idx] += update[k]`` in place, for an index tuple ``idx``."""
    def one(g, u):
        start = (*idx, *([0] * u.ndim))
        cur = jax.lax.dynamic_slice(g, start, (1,) * len(idx) + u.shape)
        return jax.lax.dynamic_update_slice(g, cur + u.reshape(cur.shape).astype(g.dtype), start)
    return [one(g, u) for g, u in zip(leaves, jax.tree.leaves(update))]


class Shard:
    """One device's view of the parameters: the stage's stacked layers and the outer rest.

    Each parameter leaf is kept with a leading version axis (two under 2BW). ``local`` leaves
    are ``[versions, v, lmax, ...]`` (this stage's chunks), ``outer`` leaves ``[versions, ...]``.
    """

    def __init__(self, versions: list[nnx.State], stack: str):
        flat, self.param_def = jax.tree_util.tree_flatten_with_path(versions[0])
        self.in_stack = [getattr(path[0], "key", None) == stack for path, _ in flat]
        self.stack_def = jax.tree.structure(versions[0][stack])
        parts = [self.split(v) for v in versions]
        self.outer = [jnp.stack(a) for a in zip(*(o for o, _ in parts))]
        self.local = [jnp.stack(a) for a in zip(*(lo for _, lo in parts))]

    def split(self, tree) -> tuple[list, list]:
        """(outer leaves, local leaves without the leading device axis)."""
        leaves = jax.tree.leaves(tree)
        return ([x for x, st in zip(leaves, self.in_stack) if not st],
                [x[0] for x, st in zip(leaves, self.in_stack) if st])

    def assemble(self, outer: list, local: list):
        o, k = iter(outer), iter(local)
        return jax.tree.unflatten(self.param_def,
                                  [next(k) if st else next(o) for st in self.in_stack])


def varying(axes: tuple[str, ...]) -> Callable:
    """A function marking values varying over the manual ``axes`` (switch branches agree)."""
    def vary(x):
        have = getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ())
        missing = tuple(a for a in axes if a not in have)
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return vary


def microbatches(batch: dict, n: int) -> dict:
    """``[n * rows, ...]`` leaves as ``[n, rows, ...]``."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def make_context(shard: Shard, staged, mbs: dict, vary: Callable) -> stage_lib.Context:
    """How actions reach ``shard``'s current weights and the microbatches ``mbs``."""
    local, outer = shard.local, shard.outer
    local_shapes = [x[0] for x in local]  # the prologue and epilogue skip the stack

    def chunk_params(j, ver):
        return jax.tree.unflatten(shard.stack_def, [vary(read(read(a, ver), j)) for a in local])

    return stage_lib.Context(
        chunk_params=chunk_params,
        outer=lambda ver: [vary(read(o, ver)) for o in outer],
        prologue=lambda o, mb: staged.prologue(shard.assemble(o, local_shapes), mb),
        epilogue=lambda o, y, mb: staged.weighted_loss(shard.assemble(o, local_shapes), y, mb),
        microbatch=lambda i: jax.tree.map(lambda a: read(a, i), mbs),
        vary=vary)


def idle_row(tables: tb.Tables) -> np.ndarray:
    """A row that does nothing: idle branch, reads and writes only the trash slot."""
    trash = tables.trash
    return np.array(tb.Row(branch=tb.IDLE, microbatch=0, chunk=0, layers=0, version=0, step=0,
                           read=trash, stash=0, wdy=0, from_prev=trash, from_next=trash,
                           from_self=trash), np.int32)


def run(pipeline, versions: list[nnx.State], batch: dict, remat: Callable,
        axes: tuple[str, ...], tables: tb.Tables, update: Callable | None = None):
    """One stage's share of the schedule (inside ``shard_map``).

    ``versions`` is ``[params]``, or for 2BW ``[previous, current]``; then
    ``update(k, params, grads, loss)`` applies step k's optimizer update between the scans over
    the ticks of consecutive steps and returns (new params, reduced loss). Returns the stage's
    (loss sum, loss weight, unnormalized gradients) summed over ``pipe``, or, for 2BW,
    (losses [K], [W(t+K-1), W(t+K)]); ``update`` gets (k, params, grads, loss sum, weight).
    """
    s, m, p, lmax = pipeline.staged, pipeline.m, pipeline.p, pipeline.lmax
    steps = len(tables.step_ends) if update is not None else 1
    split = tables.split
    stage = jax.lax.axis_index("pipe")

    vary = varying(axes)
    shard = Shard(versions, s.stack)
    mbs = microbatches(batch, steps * m)

    def context() -> stage_lib.Context:  # over the current weights (2BW replaces them)
        return make_context(shard, s, mbs, vary)

    ctx = context()
    uneven = len(set(pipeline.counts)) > 1
    # Shapes of activations and residuals, from traces whose results are unused (XLA removes
    # the dead code); eval_shape cannot see the manual-axis types.
    act = ctx.prologue(ctx.outer(0), ctx.microbatch(0))
    cp0 = ctx.chunk_params(0, 0)
    layers = stage_lib.ChunkLayers(remat(s.layer), lmax, uneven,
                                   jax.tree.map(lambda a: a[0], cp0), act)
    res_abs = layers.forward(cp0, act, lmax)[1]

    def zeros(shape, dtype):
        return vary(jnp.zeros(shape, dtype))

    carry = initial_carry(tables, res_abs, act, shard, steps, lmax, zeros)
    nothing = stage_lib.TickOut(
        out=zeros(act.shape, act.dtype), res=None, wdy=None,
        dcp=jax.tree.map(jnp.zeros_like, cp0), d_outer=[jnp.zeros_like(o) for o in ctx.outer(0)],
        loss=zeros((), jnp.float32), weight=zeros((), jnp.float32))
    fwd_perm = [(i, (i + 1) % p) for i in range(p)]
    bwd_perm = [(i, (i - 1) % p) for i in range(p)]

    def make_tick():
        """A fresh scan body over the current weights (JAX caches traces by function)."""
        fns = stage_lib.branches(context(), layers, nothing, split)

        def tick(c: Carry, rows):
            row = tb.Row(*read(rows, stage))
            inp = stage_lib.TickIn(row, read(c.inbox, row.read),
                                   [read(b, row.stash) for b in c.stash],
                                   read(c.wdy, row.wdy) if split else None)
            out = jax.lax.switch(row.branch, fns, inp)
            inbox = c.inbox
            if p > 1:  # the tick's one message, to both neighbours (the same one when p == 2)
                inbox = write(inbox, row.from_prev, jax.lax.ppermute(out.out, "pipe", fwd_perm))
                if p > 2:
                    inbox = write(inbox, row.from_next,
                                  jax.lax.ppermute(out.out, "pipe", bwd_perm))
            inbox = write(inbox, row.from_self, out.out)
            return Carry(
                stash=[write(b, row.stash, r) for b, r in zip(c.stash, out.res)],
                inbox=inbox,
                wdy=write(c.wdy, row.wdy, out.wdy) if split else None,
                g_local=add_at(c.g_local, (row.version, row.chunk), out.dcp),
                g_outer=add_at(c.g_outer, (row.version,), out.d_outer),
                loss=add_at([c.loss], (row.step,), [out.loss])[0],
                weight=add_at([c.weight], (row.step,), [out.weight])[0]), None

        return tick

    if update is None:
        return _one_step(carry, shard, tables, make_tick(), pipeline.tick_unroll)
    return _steps_2bw(carry, shard, tables, make_tick, update)


def _one_step(carry: Carry, shard: Shard, tables: tb.Tables, tick: Callable, unroll: int):
    """All ticks of one step: (loss sum, weight, gradients), each summed over ``pipe``."""
    table = tables.stacked()
    if len(table) % unroll:  # idle ticks to a multiple of the unroll factor
        pad = np.broadcast_to(idle_row(tables), (unroll - len(table) % unroll, *table.shape[1:]))
        table = np.concatenate([table, pad])
    carry = jax.lax.scan(tick, carry, jnp.asarray(table), unroll=unroll)[0]
    grads = shard.assemble([jax.lax.psum(g[0], "pipe") for g in carry.g_outer],
                           [g[0][None] for g in carry.g_local])
    return jax.lax.psum(carry.loss[0], "pipe"), jax.lax.psum(carry.weight[0], "pipe"), grads

def initial_carry(tables: tb.Tables, res_abs: list, act, shard: Shard, steps: int, lmax: int,
                  zeros: Callable) -> Carry:
    """Zeroed buffers sized by the tables (stash slots in the residual's memory space)."""
    def stash_buffer(r):
        buf = zeros((tables.num_stash, *r.shape), r.dtype)
        space = getattr(jax.typeof(r), "memory_space", None)
        if space is not None and "host" in str(space).lower():  # an offloaded residual
            buf = jax.device_put(buf, space)
        return buf

    return Carry(
        stash=[stash_buffer(r) for r in res_abs],
        inbox=zeros((tables.num_inbox, *act.shape), act.dtype),
        wdy=zeros((tables.num_wdy, lmax, *act.shape), act.dtype) if tables.split else None,
        g_local=[zeros(x.shape, x.dtype) for x in shard.local],
        g_outer=[zeros(x.shape, x.dtype) for x in shard.outer],
        loss=zeros((steps,), jnp.float32), weight=zeros((steps,), jnp.float32))


def _steps_2bw(carry: Carry, shard: Shard, tables: tb.Tables, make_tick: Callable,
               update: Callable):
    """PipeDream-2BW: one scan per step's ticks, each followed by that step's update."""
    table = tables.stacked()
    start, losses = 0, []
    for k, end in enumerate(tables.step_ends):
        carry = jax.lax.scan(make_tick(), carry, jnp.asarray(table[start:end]))[0]
        start = end
        j = k % 2  # step k ran on version j = W(k-1); version 1-j holds W(k)
        grads = shard.assemble([jax.lax.psum(g[j], "pipe") for g in carry.g_outer],
                               [g[j][None] for g in carry.g_local])
        current = shard.assemble([o[1 - j] for o in shard.outer],
                                 [x[1 - j][None] for x in shard.local])
        new, loss_k = update(k, current, grads, jax.lax.psum(carry.loss[k], "pipe"),
                             jax.lax.psum(carry.weight[k], "pipe"))
        new_outer, new_local = shard.split(new)  # W(k+1) replaces W(k-1)
        shard.outer = [o.at[j].set(n) for o, n in zip(shard.outer, new_outer)]
        shard.local = [x.at[j].set(n) for x, n in zip(shard.local, new_local)]
        carry = carry._replace(g_local=[g.at[j].set(0) for g in carry.g_local],
                               g_outer=[g.at[j].set(0) for g in carry.g_outer])
        losses.append(loss_k)
    last = (len(tables.step_ends) - 1) % 2
    latest = [shard.assemble([o[v] for o in shard.outer], [x[v][None] for x in shard.local])
              for v in (1 - last, last)]
    return jnp.stack(losses), latest


__all__ = ["Carry", "Shard", "add_at", "initial_carry", "make_context", "microbatches", "read",
           "run", "varying", "write"]
