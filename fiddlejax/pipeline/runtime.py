"""The SPMD pipeline: any valid schedule, run as one ``jax.shard_map`` program over ``pipe``.

This module holds a model's pipeline *layout* (which layers each stage holds, and the mapping
between the canonical parameter tree and the internal ``[pipe, virtual, layers, ...]`` one) and
the entry points; the pieces live beside it, one idea each (see docs/architecture.md):

- ``tables``: a schedule turned into per-(tick, stage) rows with named columns and buffer slots;
- ``stage``: what one stage does in one tick (forward, backward, split input/weight halves);
- ``executor``: the scan over ticks, the in-place buffers, the messages between stages, 2BW;
- ``measure``: the per-stage FLOPs of a step, by static dispatch.

The layer stack is split over ``pipe`` and run by the stage programs (``jax.shard_map`` manual
over ``pipe``, one per tick). The parameters outside it (embedding, head) are not replicated
per stage: they stay sharded over ``pipe`` x ``tensor`` (the vocabulary axis), and the prologue
and the head and loss run between the stage programs over every device, partitioned by GSPMD
(vocabulary parallelism; ``executor.Ends``). Tied embeddings stay one parameter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from fiddlejax.pipeline import costs, executor, measure, schedules
from fiddlejax.pipeline.partition import partition
from fiddlejax.pipeline.tables import Row, Tables, build_tables
from fiddlejax.sharding import logical_to_spec
from fiddlejax.state import in_param_dtypes


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


class Pipeline:
    """One model's pipeline layout and executor for one plan."""

    def __init__(self, staged, plan, canonical_template: nnx.State, example: dict | None = None):
        self.staged, self.plan = staged, plan
        p, v, m = plan.pipe, plan.virtual_stages, plan.microbatches
        self.p, self.v, self.m = p, v, m
        n_chunks = p * v
        L = staged.num_layers
        self.counts = self._partition(canonical_template, example)
        kind = plan.schedule
        self.schedule = schedules.build(kind, stages=p, microbatches=m,
                                        virtual_stages=v if schedules.interleaves(kind) else None)
        self.schedule_run = executed(self.schedule, plan.split_backward)
        self.tables = build_tables(self.schedule_run, self.counts)
        self.lmax = max(self.counts)
        # Internal stack index [p, v, lmax] -> canonical layer (or L: a zero pad layer).
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        index = np.full((p, v, self.lmax), L, np.int64)
        for c in range(n_chunks):
            st = self.schedule.placement[c]
            j = self.schedule.chunks_of(st).index(c)
            index[st, j, : self.counts[c]] = starts[c] + np.arange(self.counts[c])
        self.index = index
        self._tables_2bw: dict[int, Tables] = {}
        # FSDP (zero=3): each internal leaf's dimension sharded over `data` (-1: none); None
        # without FSDP. Known once the storage is laid out: see :meth:`running`.
        self.data_dims = None
        # Ticks per scan iteration. Measurement only: cost_analysis counts a loop body once, so
        # bytes(unroll=2) - bytes(unroll=1) is one tick's memory traffic.
        self.tick_unroll = 1
        flat = index.reshape(-1)
        self.inverse = np.array([int(np.nonzero(flat == layer)[0][0]) for layer in range(L)])

    def running(self, model, data_dims) -> Pipeline:
        """This pipeline (its stages and tables unchanged) running ``model``, the staged model
        as a step runs it (through FSDP's parameter view, if any), with each internal leaf's
        ``data`` dimension ``data_dims`` (None without FSDP): a new object, so the stage plan
        the storage was laid out from is never changed after the fact."""
        out = copy.copy(self)
        out.staged, out.data_dims, out._tables_2bw = model, data_dims, {}
        return out

    def _partition(self, params: nnx.State, example: dict | None) -> list[int]:
        """Layers per chunk: uniform, or balanced by parameters / measured FLOPs (PipeDream)."""
        L, n_chunks, method = self.staged.num_layers, self.p * self.v, self.plan.partition
        if method == "uniform" or L == n_chunks:
            return partition(L, n_chunks, "uniform")
        if example is None:
            raise ValueError(f"partition={method!r} needs the model's batch_spec() to measure "
                             "costs; add batch_spec to the model or use partition='uniform'")
        layer, first, last = costs.measure(self.staged, params, example, method)
        # The prologue and head run over every device (executor.Ends), not on the end stages:
        # they cost every stage the same, so only the layers are balanced.
        del first, last
        return partition(L, n_chunks, method, layer_costs=[layer] * L)

    # -- layouts -----------------------------------------------------------------------------
    def _map_stack(self, f, params: nnx.State, g=lambda v: v) -> nnx.State:
        """Apply ``f`` to the stack's variables and ``g`` to the others, keeping the tree."""
        stack = self.staged.stack

        def visit(path, v):
            in_stack = getattr(path[0], "key", None) == stack
            return f(v) if in_stack else g(v)

        return jax.tree_util.tree_map_with_path(visit, params, is_leaf=_is_var)

    def _routes(self, to_canonical: bool) -> list[tuple] | None:
        """How chunks move between the internal and the canonical layout, for equal chunks
        (L = p x v x n; ``None`` otherwise): canonical device k holds chunks k v .. k v + v - 1
        (its L / p layers, in order), chunk c sits in slot j of stage s. Rounds of moves, each
        one ``ppermute`` (no device sends or receives twice): ``(pairs, take, put)``, device i
        sending its slot ``take[i]`` and a receiving device writing slot ``put[i]``."""
        p, v, n = self.index.shape
        if self.staged.num_layers != p * v * n:
            return None
        moves = []  # (from device, its slot, to device, slot there)
        for c, st in enumerate(self.schedule.placement):
            j = self.schedule.chunks_of(st).index(c)
            moves.append((st, j, c // v, c % v) if to_canonical else (c // v, c % v, st, j))
        rounds: list[list] = []
        for m in moves:  # first fit: a round takes a move if its devices are still free there
            for r in rounds:
                if all(m[0] != o[0] and m[2] != o[2] for o in r):
                    r.append(m)
                    break
            else:
                rounds.append([m])
        out = []
        for r in rounds:
            take, put = np.zeros(p, np.int32), np.zeros(p, np.int32)
            for a, ja, b, jb in r:
                take[a], put[b] = ja, jb
            out.append(([(a, b) for a, _, b, _ in r], take, put))
        return out

    def _moved(self, a: jax.Array, rest: tuple, rounds: list, to_canonical: bool) -> jax.Array:
        """``a`` regrouped along ``rounds`` (``_routes``), each device sending its chunks to
        where they go (``[p, v, n, ...]`` <-> ``[L, ...]``, both split over ``pipe``;
        ``rest``: the other dimensions' split). Every axis is manual, so nothing is
        gathered: left to the partitioner, a regrouped stack is replicated, a whole model per
        device."""
        p, v, n = self.index.shape

        def regroup(x):
            me = jax.lax.axis_index("pipe")
            src = x[0] if to_canonical else x.reshape(v, n, *x.shape[1:])
            out = jnp.zeros_like(src)
            for pairs, take, put in rounds:
                sent = src[jnp.asarray(take)[me]]
                if any(i != k for i, k in pairs):
                    sent = jax.lax.ppermute(sent, "pipe", pairs)
                gets = np.zeros(p, bool)
                gets[[k for _, k in pairs]] = True
                slot = jnp.asarray(put)[me]
                out = out.at[slot].set(jnp.where(jnp.asarray(gets)[me], sent, out[slot]))
            return out.reshape(v * n, *out.shape[2:]) if to_canonical else out[None]

        internal, canonical = P("pipe", None, None, *rest), P("pipe", *rest)
        return jax.shard_map(
            regroup, mesh=self.plan.mesh,
            in_specs=internal if to_canonical else canonical,
            out_specs=canonical if to_canonical else internal)(a)

    def _cyclic(self) -> bool:
        """Equal chunks placed cyclically (1f1b, interleaved): the canonical order is the
        internal ``[p, v, n]`` read as ``[v, p, n]``, a transpose that XLA splits with an
        all-to-all (cheaper there than moving chunk by chunk)."""
        p, v, n = self.index.shape
        L = self.staged.num_layers
        return L == p * v * n and np.array_equal(
            self.inverse, np.arange(L).reshape(p, v, n).transpose(1, 0, 2).reshape(-1))

    def stack_rows(self, a: jax.Array) -> jax.Array:
        """An array ``[L, ...]`` with one row per layer of the stack, laid out as the stack's
        parameters are inside (``[pipe, virtual, layers, ...]``; padding rows zero)."""
        p, v, n = self.index.shape
        if self._cyclic():
            return jnp.swapaxes(a.reshape(v, p, n, *a.shape[1:]), 0, 1)
        padded = jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])
        return jnp.take(padded, jnp.asarray(self.index), axis=0)

    def to_internal(self, params: nnx.State, shardings: nnx.State | None = None) -> nnx.State:
        """The stack as ``[pipe, virtual, layers, ...]``: a transpose for cyclic layouts; with
        the internal ``shardings``, other equal chunks move chunk by chunk between the stages
        (``_moved``); else (uneven partitions, or shapes alone) a gather, which XLA
        replicates."""
        idx, cyclic = jnp.asarray(self.index), self._cyclic()
        routes = None if cyclic else self._routes(False)
        p, v, n = self.index.shape

        def regroup(var, sharding=None):
            a = var[...]
            if cyclic:
                return var.replace(jnp.swapaxes(a.reshape(v, p, n, *a.shape[1:]), 0, 1))
            if routes is not None and sharding is not None:
                rest = _spec_of(sharding, a.ndim + 2)[3:]  # canonical [L, ...] -> internal
                return var.replace(self._moved(a, rest, routes, to_canonical=False))
            padded = jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])
            return var.replace(jnp.take(padded, idx, axis=0))

        if shardings is None:
            return self._map_stack(regroup, params)
        stack = self.staged.stack
        return jax.tree_util.tree_map_with_path(
            lambda path, var, sh: regroup(var, sh) if getattr(path[0], "key", None) == stack
            else var, params, shardings, is_leaf=_is_var)

    def to_canonical(self, internal: nnx.State, shardings: nnx.State) -> nnx.State:
        """The stack as ``[layers, ...]`` in canonical order, every leaf keeping its internal
        ``shardings`` (the layer axis over ``pipe`` when it divides): left to itself XLA
        replicates the regrouped layers, a whole model per device (a 70B checkpoint could not
        be saved). Cyclic layouts transpose, other equal chunks move chunk by chunk; uneven
        partitions still gather."""
        L, stack, cyclic = self.staged.num_layers, self.staged.stack, self._cyclic()
        routes = None if cyclic else self._routes(True)

        def visit(path, var, sharding):
            a = var[...]
            spec = _spec_of(sharding, a.ndim)
            if getattr(path[0], "key", None) == stack:
                if routes is not None:
                    return var.replace(self._moved(a, spec[3:], routes, to_canonical=True))
                layers = "pipe" if L % self.p == 0 else None
                if cyclic:
                    a = jnp.swapaxes(a, 0, 1).reshape(L, *a.shape[3:])
                    if self.v == 1 and spec[2] is not None:  # ZeRO's data split on the
                        more = spec[2] if isinstance(spec[2], tuple) else (spec[2],)
                        layers = ("pipe", *more)  # layers of a stage: a plain reshape
                else:
                    a = jnp.take(a.reshape(-1, *a.shape[3:]), jnp.asarray(self.inverse), axis=0)
                spec = (layers, *spec[3:])
            return var.replace(jax.lax.with_sharding_constraint(
                a, jax.sharding.NamedSharding(self.plan.mesh, P(*spec))))

        return jax.tree_util.tree_map_with_path(visit, internal, shardings, is_leaf=_is_var)

    def param_specs(self, internal: nnx.State) -> nnx.State:
        def names(v):
            return tuple(v.get_metadata().get("out_sharding") or ())

        rules = self.plan.axis_rules

        def stacked(v):  # [p, v, lmax, ...]: stages over `pipe`, the "layers" name dropped
            return v.replace(P("pipe", None, None, *logical_to_spec(names(v)[1:], rules)))

        def other(v):  # outside the stack: also split over `pipe` (no replica per stage)
            return v.replace(outer_spec(v, names(v), rules, self.p))

        return self._map_stack(stacked, internal, other)

    def stack_specs(self, params: nnx.State) -> nnx.State:
        """Per-stage specs (``stage_flops``): the stack split over ``pipe``, the rest
        replicated."""
        return self._map_stack(lambda v: P("pipe"), params, lambda v: P())

    def data_specs(self, params: nnx.State) -> Any:
        """``shard_map`` specs over ``data``: each FSDP dimension (zero=3), else replicated."""
        if self.data_dims is None:
            return jax.tree.map(lambda _: P(), params)
        from fiddlejax.compute import only_data

        return only_data(self.data_dims, params)

    def _over_data(self, f: Callable, in_specs: tuple, out_specs: Any) -> Callable:
        """``f`` per data replica (``shard_map`` manual over ``data``; itself when data == 1)."""
        if self.plan.data == 1:
            return f
        return jax.shard_map(f, mesh=self.plan.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names={"data"})

    # -- execution ---------------------------------------------------------------------------
    def loss_and_grads(self, params: nnx.State, batch: dict, reduce: Callable, remat: Callable,
                       gather: Callable = lambda prm: prm, grad_specs: Any = None):
        """Loss, gradients and metrics of one step: ``reduce(loss sum, Sums, gradients)`` turns
        each data replica's sums into the step's weighted mean over ``data``; ``gather`` makes a
        replica's parameters what its ticks use (FSDP gathered once per step; the gradients
        are then of its result); ``grad_specs``: the reduced gradients' specs over ``data``
        (ZeRO-2), else the parameters'."""
        specs = self.data_specs(params)

        def per_replica(prm, b):
            return reduce(*executor.run(self, [gather(prm)], b, remat, self.tables))

        return self._over_data(per_replica, (specs, P("data")),
                               (P(), grad_specs or specs, P()))(params, batch)

    def train_2bw(self, versions: list[nnx.State], opt_state: Any, batches: dict,
                  reduce: Callable, remat: Callable, optimizer: Any, opt_specs: Any):
        """PipeDream-2BW: K optimizer steps in one program, the pipeline never flushed between.

        ``versions`` = [W(t-1), W(t)]; ``batches`` leaves are ``[K, batch, ...]``. Step k's
        microbatches run on W(t+k-1) and W(t+k+1) = W(t+k) + update(grad at W(t+k-1)), applied
        once every stage has finished step k's backwards. Returns (losses [K], reported
        metrics [K], gradient norms [K], [W(t+K-1), W(t+K)], optimizer state).
        """
        steps = int(jax.tree.leaves(batches)[0].shape[0])
        if steps not in self._tables_2bw:
            sched = schedules.build("2bw", stages=self.p, microbatches=self.m, steps=steps)
            self._tables_2bw[steps] = build_tables(
                executed(sched, self.plan.split_backward), self.counts)
        tables = self._tables_2bw[steps]
        specs = self.data_specs(versions[0])

        def per_replica(prev, cur, opt, b):
            b = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), b)  # steps' rows in order
            box = {"opt": opt, "norms": []}

            def update(k, current, grads, total, sums):
                loss, grads, metrics = reduce(total, sums, grads)
                updates, box["opt"] = optimizer.update(in_param_dtypes(grads, current),
                                                       box["opt"], current)
                box["norms"].append(optax.tree.norm(grads))
                return optax.apply_updates(current, updates), (loss, metrics)

            (losses, metrics), new = executor.run(self, [prev, cur], b, remat, tables, update)
            return losses, metrics, jnp.stack(box["norms"]), new[0], new[1], box["opt"]

        return self._over_data(
            per_replica, (specs, specs, opt_specs, P(None, "data")),
            (P(), P(), P(), specs, specs, opt_specs))(versions[0], versions[1], opt_state,
                                                      batches)

    def stage_flops(self, params: nnx.State, batch: dict, remat: Callable) -> list[dict]:
        """Compiled FLOPs of each stage's step (see :mod:`fiddlejax.pipeline.measure`)."""
        return measure.stage_flops(self, params, batch, remat)


def _spec_of(sharding, ndim: int) -> tuple:
    """A leaf's sharding spec, one entry per dimension, bare or in an ``nnx.Variable``
    (parameter shardings are held in Variables, the optimizer state's parameter-shaped ones
    bare; a part of the state an optimizer masks out has a replicated ``P()``)."""
    spec = tuple((sharding.get_value() if _is_var(sharding) else sharding).spec)
    return spec + (None,) * (ndim - len(spec))


def outer_spec(v, names: tuple, rules, p: int) -> P:
    """A parameter outside the stack: its tensor-parallel spec, with ``pipe`` added on its
    vocabulary dimension (else its largest free one ``p`` divides). Small leaves (norms) stay
    replicated."""
    from fiddlejax.compute import SMALL

    spec = logical_to_spec(names, rules)
    parts = [*spec, *([None] * (v.ndim - len(spec)))]
    if p == 1 or int(np.prod(v.shape)) < SMALL:
        return spec
    if "vocab" in names and v.shape[names.index("vocab")] % p == 0:
        d = names.index("vocab")
    else:
        free = [d for d in range(v.ndim) if parts[d] is None and v.shape[d] % p == 0]
        if not free:
            return spec
        d = max(free, key=lambda d: (v.shape[d], -d))
    have = parts[d]
    parts[d] = "pipe" if have is None else ("pipe", *(have if isinstance(have, tuple) else
                                                       (have,)))
    return P(*parts)


def executed(schedule: schedules.Schedule, split: bool | None = None) -> schedules.Schedule:
    """The schedule the runtime runs: whole backwards split into I then W (``split=True``), or
    as written (``False``). ``None``: split when that lowers the lockstep bubble (a tick lasts
    as long as its slowest action; split, all cost one unit), except on the CPU, where
    simulated devices share cores, a bubble costs no wall time and each extra tick costs its
    fixed overhead (measured: benchmarks/results/pipeline_efficiency.md). There a split
    schedule (zb-h1, zb-v, interleaved-zb) runs each I with its W as one whole backward, in
    the I's place (``schedules.join_backward``): one tick and one VJP instead of two (a W
    recomputes the layer's inner cotangents), in its order, holding no more."""
    cpu = jax.default_backend() == "cpu"
    if schedule.split_backward:
        return schedules.join_backward(schedule) if split is None and cpu else schedule
    if split is False:
        return schedule
    cut = schedules.split_backward(schedule)
    if split:
        return cut
    lower = cut.ticks.weighted_bubble_fraction < schedule.ticks.weighted_bubble_fraction - 1e-9
    return cut if lower and not cpu else schedule


def build(staged, plan, canonical_template: nnx.State, example: dict | None = None) -> Pipeline:
    """The pipeline for ``plan`` (validates layers, microbatches and schedule up front).

    ``example``: abstract inputs of one example (``batch_spec(1)``), for cost-based partitions.
    """
    return Pipeline(staged, plan, canonical_template, example)


__all__ = ["Pipeline", "Row", "Tables", "build", "build_tables", "executed"]
