"""The tick scan: a schedule run per data replica, the stages as one ``shard_map`` per tick.

Per tick: the prologue runs over every device if a microbatch enters chunk 0 (``Ends``, the
``tables.Edge`` columns); then each device reads its :class:`~fiddlejax.pipeline.tables.Row`
and runs its action (``stage.tick``: loops over its chunk's layers, the buffers updated in
place) and exchanges the tick's message with its neighbours: one ``ppermute`` forward and one
backward (one in all when ``pipe`` is 2); then the head and loss run over every device if the
last chunk finished a microbatch, and their cotangent seeds that chunk's backward next tick.

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
from jax.sharding import PartitionSpec as P

from fiddlejax import message
from fiddlejax.compute import grad_dtype
from fiddlejax.pipeline import lockstep as lockstep_lib
from fiddlejax.pipeline import stage as stage_lib
from fiddlejax.pipeline import tables as tb


class Local(NamedTuple):
    """One device's buffers, each with a leading ``pipe`` axis (one slice per stage; inside the
    stage program the device keeps its size-1 slice of that axis, see ``stage.Buffers``)."""

    stash: list         # residual buffers [num_stash, lmax, ...], one per residual leaf
    inbox: Any          # [num_inbox, *message]: messages waiting to be used (+ trash slot)
    wdy: Any            # [num_wdy, lmax, *message] (split backwards), else None
    g_local: list       # weight gradients of the stage's layers [versions, v, lmax, ...]
    seed: jax.Array     # [1]: inbox slot the head's cotangent goes to next tick (trash if none)


class Carry(NamedTuple):
    """What the tick scan carries; every field is updated slot by slot."""

    local: Local
    g_outer: list       # gradients of the parameters outside the stack [versions, ...]
    dy: Any             # the head's cotangent for the last chunk's backward (delivered next tick)
    loss: jax.Array     # [steps]: summed microbatch loss sums per optimizer step
    sums: Any           # staged.Sums of [steps]: summed loss weights and reported metrics


def read(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, False)


def add_at(leaves: list, idx: tuple, update) -> list:
    """``leaves[k][idx] += update[k]`` in place, for an index tuple ``idx``."""
    return [stage_lib.add_at(g, idx, u) for g, u in zip(leaves, jax.tree.leaves(update))]


class Shard:
    """The parameters as the step holds them: the stacked layers and the outer rest.

    ``local`` leaves are ``[pipe, v, lmax, ...]``, or ``[pipe, 2, v, lmax, ...]`` under 2BW
    (two versions; one version gets no axis: inserting a size-1 axis lets XLA pick another
    layout and copy the parameters), sharded over ``pipe``. ``outer`` leaves are
    ``[versions, ...]``, sharded as the parameters are (a vocabulary over ``pipe`` x ``tensor``).
    """

    def __init__(self, versions: list[nnx.State], stack: str):
        flat, self.param_def = jax.tree_util.tree_flatten_with_path(versions[0])
        self.in_stack = [getattr(path[0], "key", None) == stack for path, _ in flat]
        self.stack_def = jax.tree.structure(versions[0][stack])
        parts = [self.split(v) for v in versions]
        self.outer = [jnp.stack(a) for a in zip(*(o for o, _ in parts))]
        self.versioned = len(versions) > 1
        self.local = [jnp.stack(a, axis=1) if self.versioned else a[0]
                      for a in zip(*(lo for _, lo in parts))]

    def at(self, version, chunk) -> tuple:
        """The index of a chunk's layers in a stage's ``[1, (versions,) v, lmax, ...]`` leaf."""
        return (0, version, chunk) if self.versioned else (0, chunk)

    def split(self, tree) -> tuple[list, list]:
        """(outer leaves, stack leaves)."""
        leaves = jax.tree.leaves(tree)
        return ([x for x, st in zip(leaves, self.in_stack) if not st],
                [x for x, st in zip(leaves, self.in_stack) if st])

    def assemble(self, outer: list, local: list | None = None):
        """The parameter tree; without ``local`` the stack's leaves are placeholders (for the
        prologue and head, which do not read them)."""
        o, k = iter(outer), iter(self.local if local is None else local)
        return jax.tree.unflatten(self.param_def,
                                  [next(k) if st else next(o) for st in self.in_stack])


def varying(axes: tuple[str, ...]) -> Callable:
    """A function marking values varying over the manual ``axes`` (loop carries agree)."""
    def vary(x):
        have = getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ())
        missing = tuple(a for a in axes if a not in have)
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return vary


def microbatches(batch: dict, n: int) -> dict:
    """``[n * rows, ...]`` leaves as ``[n, rows, ...]``."""
    return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)


def chunk_params(local: list, stack_def, vary: Callable) -> Callable:
    """``(chunk, version) ->`` that chunk's layer params ``[lmax, ...]``, for ``local`` leaves
    ``[versions, v, lmax, ...]`` (the per-stage FLOP programs of ``measure``)."""
    def chunk(j, ver):
        return jax.tree.unflatten(stack_def, [vary(read(read(a, ver), j)) for a in local])

    return chunk


def idle_row(tables: tb.Tables) -> np.ndarray:
    """A row that does nothing: idle branch, reads and writes only the trash slot."""
    trash = tables.trash
    return np.array(tb.Row(branch=tb.IDLE, microbatch=0, chunk=0, layers=0, version=0, step=0,
                           read=trash, stash=0, wdy=0, from_prev=trash, from_next=trash,
                           from_self=trash), np.int32)


class Ends:
    """The pipeline's two ends, run by every device: the prologue before the stage programs and
    the head and loss after them (``jax.shard_map`` manual over ``pipe`` for the stages only).

    The parameters outside the stack (embedding, head) stay sharded over ``pipe`` x ``tensor``
    and the GSPMD partitioner splits the lookups, logits, softmax and their gradients over all
    those devices (vocabulary parallelism): no stage holds a replica, none carries the head alone.
    """

    def __init__(self, staged, shard: Shard, mbs: dict, vary: Callable):
        self.staged, self.shard, self.mbs, self.vary = staged, shard, mbs, vary

    def microbatch(self, i):
        return jax.tree.map(lambda a: read(a, jnp.maximum(i, 0)), self.mbs)

    def outer(self, ver) -> list:
        return [self.vary(read(o, ver)) for o in self.shard.outer]

    def prologue(self, outer: list, i):
        return self.staged.prologue(self.shard.assemble(outer), self.microbatch(i))

    def loss(self, outer: list, y, i):
        return self.staged.weighted_loss(self.shard.assemble(outer), y, self.microbatch(i))

    def embed(self, e: tb.Edge, like):
        """The message entering chunk 0 this tick (zeros when no microbatch starts)."""
        return jax.lax.cond(
            e.embed >= 0,
            lambda: jax.tree.map(self.vary, message.cast(
                self.prologue(self.outer(e.embed_version), e.embed), like)),
            lambda: jax.tree.map(self.vary, message.zeros(like)))

    def after(self, c: Carry, e: tb.Edge, msg, first: int, last: int) -> Carry:
        """The head and loss on the last chunk's output (stage ``last``'s message) when a
        microbatch finished (its cotangent goes to ``c.dy``), and the prologue's gradients from
        chunk 0's input cotangent (stage ``first``'s) when its backward ran. The messages are
        read inside the conditionals, so no tick without an end moves them."""
        def head(g_outer, loss, sums, dy):
            (total, w), (d_outer, dy_new) = jax.value_and_grad(
                self.loss, argnums=(0, 1), has_aux=True, allow_int=True)(
                    self.outer(e.head_version), at(msg, last), e.head)
            leaves, tree = jax.tree.flatten(sums)
            return (add_at(g_outer, (e.head_version,), d_outer),
                    add_at([loss], (e.head_step,), [total])[0],
                    jax.tree.unflatten(tree, add_at(leaves, (e.head_step,), w)),
                    message.from_vjp(dy_new, dy))

        g_outer, loss, sums, dy = jax.lax.cond(
            e.head >= 0, head, lambda *a: a, c.g_outer, c.loss, c.sums, c.dy)

        def embed_grad(g_outer):
            dx = at(msg, first)
            _, vjp = jax.vjp(lambda o: jax.tree.map(self.vary, message.cast(
                self.prologue(o, e.embed_grad), dx)), self.outer(e.embed_grad_version))
            return add_at(g_outer, (e.embed_grad_version,), vjp(message.to_vjp(dx))[0])

        g_outer = jax.lax.cond(e.embed_grad >= 0, embed_grad, lambda g: g, g_outer)
        return c._replace(g_outer=g_outer, dy=dy, loss=loss, sums=sums)


def at(msg, k: int):
    """Stage ``k``'s message out of the tick's ``[pipe, *message]`` ones."""
    return jax.tree.map(lambda a: a[k], msg)


def run(pipeline, versions: list[nnx.State], batch: dict, remat: Callable,
        tables: tb.Tables, update: Callable | None = None):
    """One data replica's pipelined step (inside ``shard_map`` over ``data`` when data > 1).

    ``versions`` is ``[params]``, or for 2BW ``[previous, current]``; then
    ``update(k, params, grads, loss sum, Sums)`` applies step k's optimizer update between the
    scans over the ticks of consecutive steps and returns (new params, reduced loss and
    metrics). Returns (loss sum, ``staged.Sums``, unnormalized gradients), or, for 2BW,
    (losses and metrics [K], [W(t+K-1), W(t+K)]).
    """
    s, m, lmax, split = pipeline.staged, pipeline.m, pipeline.lmax, tables.split
    steps = len(tables.step_ends) if update is not None else 1
    data = ("data",) if pipeline.plan.data > 1 else ()
    vary, vary_data = varying((*data, "pipe")), varying(data)
    mesh = jax.sharding.get_abstract_mesh()
    mesh = pipeline.plan.mesh if mesh.empty else mesh
    place = pipeline.schedule_run.placement
    first, last = place[0], place[-1]
    shard = Shard(versions, s.stack)
    ends = Ends(s, shard, microbatches(batch, steps * m), vary_data)
    act = ends.prologue(ends.outer(0), 0)  # its structure (the trace is dead code)
    sums = jax.eval_shape(lambda o, y: ends.loss(o, y, 0)[1], ends.outer(0), act)
    layer = remat(s.layer)
    # collectives inside a layer that every device must reach: run the loops in lockstep
    # (probed on the layer as the model wrote it: the FSDP view's gathers over `data` need the
    # manual `data` axis of the step, and only the `tensor` split decides)
    lockstep = lockstep_lib.needs_lockstep(pipeline, s.layer, versions[0], act)

    def stage_program(f, n_in: int, n_rest: int = 2):
        """``f`` on each stage's slice ``[1, ...]`` of its first ``n_in`` arguments (the
        ``n_rest`` others replicated)."""
        return jax.shard_map(f, mesh=mesh, in_specs=(P("pipe"),) * n_in
                             + (P(),) * n_rest, out_specs=P("pipe"), axis_names={"pipe"})

    def stage_layers(local: list) -> stage_lib.Layers:
        example = jax.tree.unflatten(shard.stack_def, [vary(stage_lib.read_at(
            a, (*shard.at(0, 0), 0))) for a in local])
        return stage_lib.Layers(layer, example, jax.tree.map(vary, message.zeros(act)))

    def init(local: list, _x0, _dy) -> Local:
        return initial_local(tables, stage_layers(local).residuals, act, local, lmax, vary)

    local0 = stage_program(init, 1)(shard.local, act, act)

    def make_tick():
        """A fresh scan body over the current weights (2BW replaces them between steps)."""
        def stage_tick(buf: Local, row, local: list, x0, dy, trips):
            return local_tick(buf, row, local, shard, stage_layers(local),
                              jax.tree.map(vary, x0), jax.tree.map(vary, dy),
                              pipeline.p, split, tables.trash, vary,
                              trips if lockstep else None)

        stages = stage_program(stage_tick, 3, 3)

        def tick(c: Carry, xs):
            rows, e = xs
            e = tb.Edge(*e)
            trips = stage_lib.lockstep_trips(rows) if lockstep else jnp.zeros((4,), jnp.int32)
            local, msg = stages(c.local, rows, shard.local, ends.embed(e, act), c.dy, trips)
            return ends.after(c._replace(local=local), e, msg, first, last), None

        return tick

    zeros = lambda *a: vary_data(jnp.zeros(*a))  # noqa: E731
    g_outer = [vary_data(jnp.zeros_like(o, grad_dtype(o.dtype))) for o in shard.outer]
    carry = Carry(local0, g_outer,
                  jax.tree.map(vary_data, message.zeros(act)), zeros((steps,), jnp.float32),
                  jax.tree.map(lambda a: zeros((steps, *a.shape), a.dtype if a.shape
                                               else jnp.float32), sums))
    if update is None:
        return _one_step(carry, shard, tables, make_tick(), pipeline.tick_unroll)
    return _steps_2bw(carry, shard, tables, make_tick, update)


def local_tick(buf: Local, row: tb.Row, local: list, shard: Shard, layers: stage_lib.Layers,
               x0, dy, p: int, split: bool, trash: int, vary: Callable, lockstep=None):
    """One stage's tick: deliver the head's cotangent, run the row's action on its input, pass
    the message to the neighbours (``lockstep``: see ``stage.tick``). Returns (buffers,
    message)."""
    read_at, write_at = stage_lib.read_at, stage_lib.write_at
    row = tb.Row(*row[0])
    inbox = write_at(buf.inbox, (0, buf.seed[0]), dy)  # the head's cotangent from last tick
    first = (row.branch == tb.F_FIRST) | (row.branch == tb.F_ONLY)
    x = read_at(inbox, (0, row.read))
    x = message.where(first, message.cast(x0, x), x)

    at = shard.at(row.version, row.chunk)

    def params(i):  # layer i of the row's chunk and version, read in place
        return jax.tree.unflatten(shard.stack_def, [vary(read_at(a, (*at, i))) for a in local])

    bufs, msg = stage_lib.tick(layers, params, stage_lib.Buffers(buf.stash, buf.g_local,
                                                                 buf.wdy), row, at, x, split, vary,
                                 lockstep)
    msg = message.cast(msg, x)
    if p > 1:  # the tick's one message, to both neighbours (the same one when p == 2)
        inbox = write_at(inbox, (0, row.from_prev),
                         jax.lax.ppermute(msg, "pipe", [(i, (i + 1) % p) for i in range(p)]))
        if p > 2:
            inbox = write_at(inbox, (0, row.from_next),
                             jax.lax.ppermute(msg, "pipe", [(i, (i - 1) % p) for i in range(p)]))
    inbox = write_at(inbox, (0, row.from_self), msg)
    to_head = (row.branch == tb.F_LAST) | (row.branch == tb.F_ONLY)
    seed = buf.seed * 0 + jnp.where(to_head, row.from_self, trash)
    return Local(stash=bufs.stash, inbox=inbox, wdy=bufs.wdy, g_local=bufs.grad,
                 seed=seed), jax.tree.map(lambda a: a[None], msg)


def _ticks(tables: tb.Tables, unroll: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(rows [T, p, fields], edges [T, fields]), padded with idle ticks to a multiple of
    ``unroll``."""
    table, edges = tables.stacked(), tables.edges()
    if len(table) % unroll:
        n = unroll - len(table) % unroll
        table = np.concatenate([table, np.broadcast_to(idle_row(tables), (n, *table.shape[1:]))])
        edges = np.concatenate([edges, np.full((n, edges.shape[1]), -1, np.int32)])
    return table, edges


def _one_step(carry: Carry, shard: Shard, tables: tb.Tables, tick: Callable, unroll: int):
    """All ticks of one step: (loss sum, Sums, gradients)."""
    table, edges = _ticks(tables, unroll)
    carry = jax.lax.scan(tick, carry, (jnp.asarray(table), jnp.asarray(edges)), unroll=unroll)[0]
    grads = shard.assemble([g[0] for g in carry.g_outer], carry.local.g_local)
    return carry.loss[0], jax.tree.map(lambda a: a[0], carry.sums), grads


def initial_local(tables: tb.Tables, res_abs: list, act, local: list, lmax: int,
                  vary: Callable) -> Local:
    """A stage's zeroed buffers sized by the tables; ``res_abs``: one layer's residuals (stash
    slots in the residual's memory space)."""
    def zeros(shape, dtype):  # with the device's slice [1] of the pipe axis
        return vary(jnp.zeros((1, *shape), dtype))

    def stash_buffer(r):
        buf = zeros((tables.num_stash, lmax, *r.shape), stage_lib.storage_dtype(r.dtype))
        space = getattr(jax.typeof(r), "memory_space", None)
        if space is not None and "host" in str(space).lower():  # an offloaded residual
            buf = jax.device_put(buf, space)
        return buf

    return Local(
        stash=[stash_buffer(r) for r in res_abs],
        inbox=jax.tree.map(vary, message.zeros(act, (1, tables.num_inbox))),
        wdy=jax.tree.map(vary, message.zeros(act, (1, tables.num_wdy, lmax)))
        if tables.split else None,
        g_local=[vary(jnp.zeros_like(x, grad_dtype(x.dtype))) for x in local],
        seed=vary(jnp.full((1,), tables.trash, jnp.int32)))


def _steps_2bw(carry: Carry, shard: Shard, tables: tb.Tables, make_tick: Callable,
               update: Callable):
    """PipeDream-2BW: one scan per step's ticks, each followed by that step's update."""
    table, edges = _ticks(tables)
    start, losses = 0, []
    for k, end in enumerate(tables.step_ends):
        xs = (jnp.asarray(table[start:end]), jnp.asarray(edges[start:end]))
        carry = jax.lax.scan(make_tick(), carry, xs)[0]
        start = end
        j = k % 2  # step k ran on version j = W(k-1); version 1-j holds W(k)
        grads = shard.assemble([g[j] for g in carry.g_outer],
                               [g[:, j] for g in carry.local.g_local])
        current = shard.assemble([o[1 - j] for o in shard.outer],
                                 [x[:, 1 - j] for x in shard.local])
        new, loss_k = update(k, current, grads, carry.loss[k],
                             jax.tree.map(lambda a, k=k: a[k], carry.sums))
        new_outer, new_local = shard.split(new)  # W(k+1) replaces W(k-1)
        shard.outer = [o.at[j].set(n) for o, n in zip(shard.outer, new_outer)]
        shard.local = [x.at[:, j].set(n) for x, n in zip(shard.local, new_local)]
        carry = carry._replace(
            g_outer=[g.at[j].set(0) for g in carry.g_outer],
            local=carry.local._replace(g_local=[g.at[:, j].set(0) for g in carry.local.g_local]))
        losses.append(loss_k)
    last = (len(tables.step_ends) - 1) % 2
    latest = [shard.assemble([o[v] for o in shard.outer], [x[:, v] for x in shard.local])
              for v in (1 - last, last)]
    return jax.tree.map(lambda *a: jnp.stack(a), *losses), latest


__all__ = ["Carry", "Ends", "Local", "Shard", "add_at", "initial_local", "local_tick",
           "chunk_params", "microbatches", "read", "run", "varying"]
