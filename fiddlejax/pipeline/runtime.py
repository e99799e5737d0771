"""The SPMD pipeline executor: any valid schedule, run as one ``jax.shard_map`` program.

How it runs (DESIGN section 6):

- The schedule's per-stage action lists become a lockstep tick table (``schedules.tick_table``).
  A ``lax.scan`` walks the ticks; on each device a ``lax.switch`` on its own table entry runs
  only that stage's action (idle, forward, backward, or the split input/weight backward), so no
  device computes masked duplicate work.
- A forward calls ``jax.vjp`` on the stage's chunk of layers (under the plan's remat policy) and
  writes the residual leaves to slot ``stash_slots[(microbatch, chunk)]`` of fixed buffers, sized
  by the schedule's peak held count: 1F1B's memory stays flat in the number of microbatches.
  Residuals that are the chunk's own parameters are not copied: the backward passes them again.
- After the switch, one ``ppermute`` each way moves activations forward and cotangents backward
  (cyclically, so interleaved placements work); the receiver's table says which inbox slot, if
  any, takes them. A result made at tick t is usable from tick t+1.
- The prologue (embedding) runs inside the forward of chunk 0 and is differentiated again in its
  backward; the epilogue (head and loss) runs inside the forward of the last chunk, whose
  backward is seeded with the loss cotangent there and then. Gradients of the shared prologue and
  epilogue parameters are summed over ``pipe`` (this also makes tied embeddings exact).
- Weight gradients accumulate over microbatches in the scan carry.
- Split backwards (zero-bubble schedules) run a chunk one layer at a time: I keeps the cotangent
  at every layer's output, so W computes only the weight gradients.
- PipeDream-2BW (``train_2bw``) runs K optimizer steps in one program: two weight versions per
  stage, one scan per step's ticks, and the step's update applied between consecutive scans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from fiddlejax.pipeline import costs, schedules
from fiddlejax.pipeline.partition import partition
from fiddlejax.pipeline.schedules import Action
from fiddlejax.sharding import DEFAULT_RULES, logical_to_spec

# Branch indices of the per-tick switch.
IDLE, F_MID, F_FIRST, F_LAST, F_ONLY, B_MID, B_FIRST, I_MID, I_FIRST, W = range(10)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Tables:
    """Static per-(tick, stage) integer tables the scan body indexes with its stage id."""

    branch: np.ndarray      # [T, p] which switch branch
    microbatch: np.ndarray  # [T, p]
    local_chunk: np.ndarray  # [T, p] index among the stage's chunks
    layers: np.ndarray      # [T, p] layers in the chunk being run
    stash: np.ndarray       # [T, p] stash slot of (microbatch, chunk)
    act_in: np.ndarray      # [T, p] inbox slot a forward reads
    grad_in: np.ndarray     # [T, p] inbox slot a backward reads
    act_recv: np.ndarray    # [T, p] inbox slot for the activation arriving after tick t (-1)
    grad_recv: np.ndarray   # [T, p] inbox slot for the cotangent arriving after tick t (-1)
    seed_slot: np.ndarray   # [T, p] grad inbox slot a last-chunk forward writes its dy into
    version: np.ndarray     # [T, p] weight version the action uses (0, or step % 2 for 2BW)
    step: np.ndarray        # [T, p] optimizer step the action belongs to
    num_stash: int
    num_act: int
    num_grad: int
    step_ends: tuple[int, ...]  # tick after which each step's weight update applies

    def stacked(self) -> np.ndarray:
        cols = [self.branch, self.microbatch, self.local_chunk, self.layers, self.stash,
                self.act_in, self.grad_in, self.act_recv, self.grad_recv, self.seed_slot,
                self.version, self.step]
        return np.stack(cols, axis=-1).astype(np.int32)  # [T, p, 12]


def _allocate(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for [write tick, read tick] intervals; a slot read at t is free for writes at t."""
    ends: list[int] = []
    slots = {}
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for i, e in enumerate(ends):
            if e <= start:
                ends[i] = end
                slots[key] = i
                break
        else:
            slots[key] = len(ends)
            ends.append(end)
    return slots, max(len(ends), 1)


def build_tables(s: schedules.Schedule, counts: list[int]) -> Tables:
    """Turn a validated schedule into the integer tables the scan executes."""
    table = schedules.tick_table(s)
    p, n_chunks = s.stages, s.num_chunks
    place = s.placement
    local = {c: s.chunks_of(place[c]).index(c) for c in range(n_chunks)}
    for c in range(n_chunks - 1):
        if place[c + 1] != (place[c] + 1) % p:
            raise ValueError(
                f"chunk {c + 1} is on stage {place[c + 1]} but the runtime moves activations to "
                f"the next stage cyclically (stage {(place[c] + 1) % p}); use a placement where "
                "chunk c+1 sits on stage (stage of c) + 1 mod stages")
    T = table.num_ticks
    tick = {}
    for t, row in enumerate(table.ticks):
        for a in row:
            if a is not None:
                tick[(a.op, a.microbatch, a.chunk)] = t
    split = s.split_backward
    bwd = "I" if split else "B"
    stash = schedules.stash_slots(s)
    shape = (T, p)
    t_ = {k: np.full(shape, -1 if k.endswith("recv") or k == "seed" else 0, np.int64)
          for k in ("branch", "mb", "lc", "layers", "stash", "act_in", "grad_in", "act_recv",
                    "grad_recv", "seed", "version", "step")}
    # Inbox intervals per stage: activation for F(m, c>0) written after F(m, c-1); cotangent for
    # the backward of (m, c < last) written after its backward of (m, c+1), and the last chunk's
    # loss cotangent written during its own forward.
    act_iv: list[list] = [[] for _ in range(p)]
    grad_iv: list[list] = [[] for _ in range(p)]
    for (op, m, c), t in tick.items():
        st = place[c]
        if op == "F" and c > 0:
            act_iv[st].append((tick[("F", m, c - 1)], t, (m, c)))
        if op == bwd:
            if c < n_chunks - 1:
                grad_iv[st].append((tick[(bwd, m, c + 1)], t, (m, c)))
            else:
                grad_iv[st].append((tick[("F", m, c)], t, (m, c)))
    act_slots, grad_slots = [], []
    num_act = num_grad = 1
    for st in range(p):
        a, na = _allocate(act_iv[st])
        g, ng = _allocate(grad_iv[st])
        act_slots.append(a)
        grad_slots.append(g)
        num_act, num_grad = max(num_act, na), max(num_grad, ng)
    last = n_chunks - 1
    for (op, m, c), t in tick.items():
        st = place[c]
        t_["mb"][t, st] = m
        t_["lc"][t, st] = local[c]
        t_["layers"][t, st] = counts[c]
        t_["stash"][t, st] = stash[st][(m, c)]
        t_["step"][t, st] = s.step_of(Action(op, m, c))
        t_["version"][t, st] = t_["step"][t, st] % 2 if s.kind == "2bw" else 0
        if op == "F":
            t_["branch"][t, st] = (F_ONLY if n_chunks == 1 else F_FIRST if c == 0
                                   else F_LAST if c == last else F_MID)
            if c > 0:
                t_["act_in"][t, st] = act_slots[st][(m, c)]
            if c == last:
                t_["seed"][t, st] = grad_slots[st][(m, c)]
            if c < last:  # arrives at the next chunk's stage at the end of this tick
                t_["act_recv"][t, place[c + 1]] = act_slots[place[c + 1]][(m, c + 1)]
        elif op in ("B", "I"):
            first_branch, mid_branch = (B_FIRST, B_MID) if op == "B" else (I_FIRST, I_MID)
            t_["branch"][t, st] = first_branch if c == 0 else mid_branch
            t_["grad_in"][t, st] = grad_slots[st][(m, c)]
            if c > 0:
                t_["grad_recv"][t, place[c - 1]] = grad_slots[place[c - 1]][(m, c - 1)]
        elif op == "W":
            t_["branch"][t, st] = W
    ends = tuple(schedules.weight_updates(s)) if s.kind == "2bw" else (T,)
    return Tables(t_["branch"], t_["mb"], t_["lc"], t_["layers"], t_["stash"], t_["act_in"],
                  t_["grad_in"], t_["act_recv"], t_["grad_recv"], t_["seed"], t_["version"],
                  t_["step"], num_stash=max(s.held_peak), num_act=num_act, num_grad=num_grad,
                  step_ends=ends)


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
                                        virtual_stages=v if kind == "interleaved-1f1b" else None)
        self.tables = build_tables(self.schedule, self.counts)
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
        flat = index.reshape(-1)
        self.inverse = np.array([int(np.nonzero(flat == layer)[0][0]) for layer in range(L)])

    def _partition(self, params: nnx.State, example: dict | None) -> list[int]:
        """Layers per chunk: uniform, or balanced by parameters / measured FLOPs (PipeDream)."""
        L, n_chunks, method = self.staged.num_layers, self.p * self.v, self.plan.partition
        if method == "uniform" or L == n_chunks:
            return partition(L, n_chunks, "uniform")
        if example is None:
            raise ValueError(f"partition={method!r} needs the model's batch_spec() to measure "
                             "costs; add batch_spec to the model or use partition='uniform'")
        layer, first, last = costs.measure(self.staged, params, example, method)
        return partition(L, n_chunks, method, layer_costs=[layer] * L, first_extra=first,
                         last_extra=last)

    # -- layouts -----------------------------------------------------------------------------
    def _map_stack(self, f, params: nnx.State, g=lambda v: v) -> nnx.State:
        """Apply ``f`` to the stack's variables and ``g`` to the others, keeping the tree."""
        stack = self.staged.stack

        def visit(path, v):
            in_stack = getattr(path[0], "key", None) == stack
            return f(v) if in_stack else g(v)

        return jax.tree_util.tree_map_with_path(visit, params, is_leaf=_is_var)

    def to_internal(self, params: nnx.State) -> nnx.State:
        idx = jnp.asarray(self.index)

        def regroup(v):
            a = v[...]
            padded = jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])
            return v.replace(jnp.take(padded, idx, axis=0))

        return self._map_stack(regroup, params)

    def to_canonical(self, internal: nnx.State) -> nnx.State:
        inv = jnp.asarray(self.inverse)

        def ungroup(v):
            a = v[...]
            return v.replace(jnp.take(a.reshape(-1, *a.shape[3:]), inv, axis=0))

        return self._map_stack(ungroup, internal)

    def param_specs(self, internal: nnx.State) -> nnx.State:
        def names(v):
            return tuple(v.get_metadata().get("out_sharding") or ())

        def stacked(v):  # [p, v, lmax, ...]: stages over `pipe`, the "layers" name dropped
            return v.replace(P("pipe", None, None, *logical_to_spec(names(v)[1:], DEFAULT_RULES)))

        def other(v):
            return v.replace(logical_to_spec(names(v), DEFAULT_RULES))

        return self._map_stack(stacked, internal, other)

    # -- execution ---------------------------------------------------------------------------
    def loss_and_grads(self, params: nnx.State, batch: dict, reduce: Callable, remat: Callable):
        plan = self.plan
        manual = {"pipe"} | ({"data"} if plan.data > 1 else set())
        spec_tree = self._map_stack(lambda v: P("pipe"), params, lambda v: P())
        batch_spec = P("data") if plan.data > 1 else P()

        def per_device(prm, b):
            loss, grads = self._run(prm, b, remat, tuple(sorted(manual)))
            return reduce(loss, grads)

        return jax.shard_map(
            per_device, mesh=plan.mesh, in_specs=(spec_tree, batch_spec),
            out_specs=(P(), spec_tree), axis_names=manual,
        )(params, batch)

    def train_2bw(self, versions: list[nnx.State], opt_state: Any, batches: dict,
                  reduce: Callable, remat: Callable, optimizer: Any, opt_specs: Any):
        """PipeDream-2BW: K optimizer steps in one program, the pipeline never flushed between.

        ``versions`` = [W(t-1), W(t)]; ``batches`` leaves are ``[K, batch, ...]``. Step k's
        microbatches run on W(t+k-1) and W(t+k+1) = W(t+k) + update(grad at W(t+k-1)), applied
        once every stage has finished step k's backwards. Returns (losses [K], gradient norms
        [K], [W(t+K-1), W(t+K)], optimizer state).
        """
        plan = self.plan
        steps = int(jax.tree.leaves(batches)[0].shape[0])
        if steps not in self._tables_2bw:
            sched = schedules.build("2bw", stages=self.p, microbatches=self.m, steps=steps)
            self._tables_2bw[steps] = build_tables(sched, self.counts)
        tables = self._tables_2bw[steps]
        manual = {"pipe"} | ({"data"} if plan.data > 1 else set())
        spec_tree = self._map_stack(lambda v: P("pipe"), versions[0], lambda v: P())
        stacked = jax.tree.leaves(self._map_stack(lambda v: True, versions[0], lambda v: False))
        batch_spec = P(None, "data") if plan.data > 1 else P()

        def norm(grads):
            sq = [jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)]
            local = sum(x for x, st in zip(sq, stacked) if st)
            return jnp.sqrt(jax.lax.psum(local, "pipe") + sum(x for x, st in zip(sq, stacked)
                                                               if not st))

        def per_device(prev, cur, opt, b):
            b = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), b)  # steps' rows in order
            box = {"opt": opt, "norms": []}

            def update(k, current, grads, loss):
                loss, grads = reduce(loss, grads)
                updates, box["opt"] = optimizer.update(grads, box["opt"], current)
                box["norms"].append(norm(grads))
                return optax.apply_updates(current, updates), loss

            losses, new = self._run([prev, cur], b, remat, tuple(sorted(manual)),
                                    tables=tables, update=update)
            return losses, jnp.stack(box["norms"]), new[0], new[1], box["opt"]

        return jax.shard_map(
            per_device, mesh=plan.mesh,
            in_specs=(spec_tree, spec_tree, opt_specs, batch_spec),
            out_specs=(P(), P(), spec_tree, spec_tree, opt_specs), axis_names=manual,
        )(versions[0], versions[1], opt_state, batches)

    def _chunk_fn(self, remat: Callable, uneven: bool, static: bool = False) -> Callable:
        layer = remat(self.staged.layer)

        def chunk(cp, x, n):
            if static:  # measurement: exactly the chunk's n layers, unrolled (n is an int)
                for i in range(n):
                    x = layer(jax.tree.map(lambda a, i=i: a[i], cp), x)
                return x

            def body(h, args):
                i, lp = args
                if uneven:
                    return jax.lax.cond(i < n, lambda: layer(lp, h), lambda: h), None
                return layer(lp, h), None

            steps = jnp.arange(self.lmax)
            return jax.lax.scan(body, x, (steps, cp))[0]

        return chunk

    def _layerwise_fns(self, remat: Callable, uneven: bool, example_lp, example_x):
        """Forward / input-gradient / weight-gradient of a chunk, one layer at a time.

        The split backward of zero-bubble schedules needs the cotangent at every layer's
        output: the input-gradient pass (I) keeps them, and the weight-gradient pass (W) turns
        each into its layer's weight gradient independently, so W never re-runs the chain of
        input gradients. Residuals are per layer (leaves stacked ``[lmax, ...]``), with the
        layer's own parameters left out of them as for whole chunks.
        """
        layer = remat(self.staged.layer)

        def one(lp, h, i, n):
            if uneven:
                return jax.lax.cond(i < n, lambda: layer(lp, h), lambda: h)
            return layer(lp, h)

        y, vjp = jax.vjp(lambda lp, h: one(lp, h, 0, self.lmax), example_lp, example_x)
        leaves, treedef = jax.tree.flatten(vjp)
        lp_leaves = jax.tree.leaves(example_lp)
        src = [next((k for k, c in enumerate(lp_leaves) if leaf is c), None) for leaf in leaves]

        def rebuild(lp, res):
            lp_leaves, it = jax.tree.leaves(lp), iter(res)
            return jax.tree.unflatten(treedef, [next(it) if k is None else lp_leaves[k]
                                                for k in src])

        steps = jnp.arange(self.lmax)

        def forward(cp, x, n):  # -> y, residual leaves [lmax, ...]
            def body(h, args):
                i, lp = args
                h, vjp = jax.vjp(lambda l_, h_: one(l_, h_, i, n), lp, h)
                return h, [r for r, k in zip(jax.tree.leaves(vjp), src) if k is None]

            return jax.lax.scan(body, x, (steps, cp))

        def inputs(cp, res, dy):  # -> dx, cotangents at each layer's output [lmax, ...]
            def body(dh, args):
                lp, r = args
                return rebuild(lp, r)(dh)[1], dh

            return jax.lax.scan(body, dy, (cp, res), reverse=True)

        def weights(cp, res, douts):  # -> the chunk's weight gradients
            def body(_, args):
                lp, r, d = args
                return None, rebuild(lp, r)(d)[0]

            return jax.lax.scan(body, None, (cp, res, douts))[1]

        return forward, inputs, weights

    def stage_flops(self, params: nnx.State, batch: dict, remat: Callable) -> list[dict]:
        """Compiled FLOPs of each stage's whole step: ``{"flops", "dot_flops"}`` per stage.

        XLA counts a ``while`` body once and a ``conditional`` as its costliest branch, so the
        real step (a scan over ticks around a switch) cannot be measured directly. Here each
        stage's program is built from the same branch functions, dispatched statically tick by
        tick with every layer loop unrolled: the count is the work that stage does.
        ``flops`` is ``cost_analysis()``'s, ``dot_flops`` the matrix multiplies alone
        (:func:`costs.hlo_dot_flops`). Needs ``data == tensor == 1``.
        """
        if self.plan.data != 1 or self.plan.tensor != 1:
            raise ValueError("stage_flops needs a mesh with data=1 and tensor=1")
        spec_tree = self._map_stack(lambda v: P("pipe"), params, lambda v: P())
        mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // self.m, *x.shape[1:]),
                                                         x.dtype), batch)
        act = jax.eval_shape(self.staged.prologue, params, mb)
        feed = jax.ShapeDtypeStruct((2 * self.tables.branch.shape[0], *act.shape), act.dtype)
        out = []
        for st in range(self.p):
            def per_device(prm, b, f, st=st):
                return self._run(prm, b, remat, ("pipe",), static_stage=st, feed=f)

            f = jax.shard_map(per_device, mesh=self.plan.mesh, in_specs=(spec_tree, P(), P()),
                              out_specs=(P(), spec_tree, P("pipe")), axis_names={"pipe"})
            compiled = jax.jit(f).lower(params, batch, feed).compile()
            out.append({"flops": float(compiled.cost_analysis()["flops"]),
                        "dot_flops": costs.hlo_dot_flops(compiled.as_text())})
        return out

    def _run(self, params: nnx.State | list[nnx.State], batch: dict, remat: Callable,
             axes: tuple[str, ...], static_stage: int | None = None,
             feed: jax.Array | None = None, tables: Tables | None = None,
             update: Callable | None = None):
        """One stage's share of the schedule (inside ``shard_map``).

        ``params`` is one weight version, or for 2BW the two versions ``[previous, current]``;
        then ``update(k, params, grads, loss)`` applies step k's optimizer update (between the
        scans over the ticks of consecutive steps) and returns (new params, reduced loss).
        """
        s = self.staged
        tb = tables or self.tables
        m = self.m
        stack = s.stack
        versions = params if isinstance(params, list) else [params]
        steps = len(tb.step_ends) if update is not None else 1
        varying = lambda x: jax.lax.pcast(x, axes, to="varying")  # noqa: E731

        def vary(x):
            have = getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ())
            missing = tuple(a for a in axes if a not in have)
            return jax.lax.pcast(x, missing, to="varying") if missing else x

        stage = jax.lax.axis_index("pipe")
        # Split the parameters into the stage's own layers ("local", leaves [v, lmax, ...]) and
        # the replicated rest ("outer"); `assemble` rebuilds the full tree for the model. Each
        # leaf is kept with a leading version axis; what a microbatch reads is made a
        # per-device value, so its gradients stay local until the explicit reductions.
        flat, param_def = jax.tree_util.tree_flatten_with_path(versions[0])
        in_stack = [getattr(path[0], "key", None) == stack for path, _ in flat]
        stack_def = jax.tree.structure(versions[0][stack])

        def split_version(tree):
            leaves = jax.tree.leaves(tree)
            return ([x for x, st in zip(leaves, in_stack) if not st],
                    [x[0] for x, st in zip(leaves, in_stack) if st])

        def stack_versions(trees):
            parts = [split_version(t) for t in trees]
            return {"outer": [jnp.stack(a) for a in zip(*(o for o, _ in parts))],
                    "local": [jnp.stack(a) for a in zip(*(lo for _, lo in parts))]}

        store = stack_versions(versions)

        def outer_at(ver):
            return [vary(jax.lax.dynamic_index_in_dim(o, ver, 0, False)) for o in store["outer"]]

        local_leaves = [x[0] for x in store["local"]]  # shapes only: the prologue skips them

        def assemble(outer_list, stack_list):
            o, k = iter(outer_list), iter(stack_list)
            return jax.tree.unflatten(param_def, [next(k) if st else next(o) for st in in_stack])

        n_mb = steps * m
        mbs = jax.tree.map(lambda x: x.reshape(n_mb, x.shape[0] // n_mb, *x.shape[1:]), batch)
        uneven = len(set(self.counts)) > 1
        static = static_stage is not None
        chunk = self._chunk_fn(remat, uneven, static)

        def prologue(o, mb):
            return s.prologue(assemble(o, local_leaves), mb)

        def epilogue(o, y, mb):
            return s.epilogue(assemble(o, local_leaves), y, mb)

        def get_mb(i):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), mbs)

        def cparams(j, ver=0):
            leaves = [vary(jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(
                a, ver, 0, False), j, 0, False)) for a in store["local"]]
            return jax.tree.unflatten(stack_def, leaves)

        # Shapes of activations and of the chunk's residuals, from a trace whose results are
        # unused (XLA removes the dead code); eval_shape cannot see the manual-axis types.
        act_abs = prologue(outer_at(0), get_mb(0))
        info = {}

        def probe(cp, x):
            y, vjp = jax.vjp(lambda c, h: chunk(c, h, self.lmax), cp, x)
            leaves, treedef = jax.tree.flatten(vjp)
            cp_leaves = jax.tree.leaves(cp)
            src = []
            for leaf in leaves:
                hit = [k for k, c in enumerate(cp_leaves) if leaf is c]
                src.append(("param", hit[0]) if hit else ("stash", None))
            info["treedef"], info["src"] = treedef, src
            return [leaf for leaf, (kind, _) in zip(leaves, src) if kind == "stash"]

        split = self.schedule.split_backward
        if split:
            lw_forward, lw_inputs, lw_weights = self._layerwise_fns(
                remat, uneven, jax.tree.map(lambda a: a[0], cparams(0)), act_abs)
            res_abs = lw_forward(cparams(0), act_abs, self.lmax)[1]
        else:
            res_abs = probe(cparams(0), act_abs)
            res_def, src = info["treedef"], info["src"]

        def zeros(shape, dtype):
            return varying(jnp.zeros(shape, dtype))

        def stash_buffer(r):
            buf = zeros((tb.num_stash, *r.shape), r.dtype)
            space = getattr(jax.typeof(r), "memory_space", None)
            if space is not None and "host" in str(space).lower():  # an offloaded residual
                buf = jax.device_put(buf, space)
            return buf

        stash0 = [stash_buffer(r) for r in res_abs]
        act_box0 = zeros((tb.num_act, *act_abs.shape), act_abs.dtype)
        grad_box0 = zeros((tb.num_grad, *act_abs.shape), act_abs.dtype)
        # Split backward: the cotangent at every layer's output, from I until W.
        wdy0 = zeros((tb.num_stash, self.lmax, *act_abs.shape) if split else (1,),
                     act_abs.dtype)
        # Gradient accumulators per weight version (two steps overlap under 2BW), loss per step.
        g_local0 = [zeros(x.shape, x.dtype) for x in store["local"]]
        g_outer0 = [zeros(x.shape, x.dtype) for x in store["outer"]]
        loss0 = zeros((steps,), jnp.float32)
        inv_m = 1.0 / m

        def write(buf, i, x):
            return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)

        def read(buf, i):
            return jax.lax.dynamic_index_in_dim(buf, i, 0, False)

        def add_at(leaves, idx, upd):
            """``leaves[i][idx] += upd[i]`` for an index tuple ``idx``."""
            def one(g, u):
                start = (*idx, *([0] * u.ndim))
                cur = jax.lax.dynamic_slice(g, start, (1,) * len(idx) + u.shape)
                return jax.lax.dynamic_update_slice(g, cur + u.reshape(cur.shape), start)
            return [one(g, u) for g, u in zip(leaves, jax.tree.leaves(upd))]

        # Static (measurement) mode keeps each chunk's vjp as a Python value instead of in
        # the stash: the same computations, with chunks of any length.
        static_vjps, static_douts = {}, {}

        def layerwise_static(cp, x, n):
            """[(input, vjp) per layer] + [(output, None)]: the split backward, measured."""
            layer, out = remat(s.layer), []
            for i in range(n):
                y, vjp = jax.vjp(layer, jax.tree.map(lambda a, i=i: a[i], cp), x)
                out.append((x, vjp))
                x = y
            return out + [(x, None)]

        def vjp_from_stash(stash, slot, cp):
            if static:
                return static_vjps[slot]
            cp_leaves = jax.tree.leaves(cp)
            it = iter(read(buf, slot) for buf in stash)
            leaves = [cp_leaves[k] if kind == "param" else next(it) for kind, k in src]
            return jax.tree.unflatten(res_def, leaves)

        def make_branches():
            """Fresh branch functions (and scan body) over the current weights: JAX
            caches traced functions by identity, and 2BW changes the weights they
            close over between the scans of consecutive steps."""
            def forward(carry, row, x):
                """Chunk forward on x; stash residuals. Returns (carry, y)."""
                stash, act_box, grad_box, wdy, g_local, g_outer, loss = carry
                cp = cparams(row[2], row[10])
                if split:
                    if static:
                        static_vjps[row[4]] = layerwise_static(cp, x, row[3])
                        return carry, static_vjps[row[4]][-1][0]
                    y, res = lw_forward(cp, x, row[3])
                    stash = [write(buf, row[4], r) for buf, r in zip(stash, res)]
                    return (stash, act_box, grad_box, wdy, g_local, g_outer, loss), y
                y, vjp = jax.vjp(lambda c, h: chunk(c, h, row[3]), cp, x)
                if static:
                    static_vjps[row[4]] = vjp
                    return (stash, act_box, grad_box, wdy, g_local, g_outer, loss), y
                leaves = jax.tree.leaves(vjp)
                kept = [leaf for leaf, (kind, _) in zip(leaves, src) if kind == "stash"]
                stash = [write(buf, row[4], r) for buf, r in zip(stash, kept)]
                return (stash, act_box, grad_box, wdy, g_local, g_outer, loss), y

            def seed_loss(carry, row, y, mb):
                """Last chunk: loss, epilogue grads, and the cotangent its backward will read."""
                stash, act_box, grad_box, wdy, g_local, g_outer, loss = carry
                mb_loss, (d_outer, dy) = jax.value_and_grad(epilogue, argnums=(0, 1))(
                    outer_at(row[10]), y, mb)
                g_outer = add_at(g_outer, (row[10],), [d * inv_m for d in d_outer])
                grad_box = write(grad_box, row[9], dy * inv_m)
                loss = add_at([loss], (row[11],), [mb_loss])[0]
                return (stash, act_box, grad_box, wdy, g_local, g_outer, loss)

            zero_act = zeros(act_abs.shape, act_abs.dtype)

            def br_idle(carry, row):
                return carry, zero_act, zero_act

            def br_f_mid(carry, row):
                x = read(carry[1], row[5])
                carry, y = forward(carry, row, x)
                return carry, y, zero_act

            def br_f_first(carry, row):
                x = prologue(outer_at(row[10]), get_mb(row[1]))
                carry, y = forward(carry, row, x)
                return carry, y, zero_act

            def br_f_last(carry, row):
                x = read(carry[1], row[5])
                carry, y = forward(carry, row, x)
                return seed_loss(carry, row, y, get_mb(row[1])), zero_act, zero_act

            def br_f_only(carry, row):
                mb = get_mb(row[1])
                carry, y = forward(carry, row, prologue(outer_at(row[10]), mb))
                return seed_loss(carry, row, y, mb), zero_act, zero_act

            def backward(carry, row, first: bool, weights: bool, inputs: bool):
                stash, act_box, grad_box, wdy, g_local, g_outer, loss = carry
                cp = cparams(row[2], row[10])
                dy = read(grad_box, row[6])
                if weights:
                    dcp, dx = vjp_from_stash(stash, row[4], cp)(dy)
                    g_local = add_at(g_local, (row[10], row[2]), dcp)
                elif static:  # split backward, measured: the layers' vjps in reverse
                    douts = []
                    for _, vjp in reversed(static_vjps[row[4]][:-1]):
                        douts.insert(0, dy)
                        dy = vjp(dy)[1]
                    static_douts[row[4]] = douts
                    dx = dy
                else:  # split backward: keep every layer's output cotangent for W
                    dx, douts = lw_inputs(cp, [read(buf, row[4]) for buf in stash], dy)
                    wdy = write(wdy, row[4], douts)
                if first and inputs:
                    _, pro_vjp = jax.vjp(lambda o: prologue(o, get_mb(row[1])), outer_at(row[10]))
                    (d_outer,) = pro_vjp(dx)
                    g_outer = add_at(g_outer, (row[10],), d_outer)
                    dx = zero_act
                return (stash, act_box, grad_box, wdy, g_local, g_outer, loss), zero_act, dx

            def br_b_mid(carry, row):
                return backward(carry, row, first=False, weights=True, inputs=True)

            def br_b_first(carry, row):
                return backward(carry, row, first=True, weights=True, inputs=True)

            def br_i_mid(carry, row):
                return backward(carry, row, first=False, weights=False, inputs=True)

            def br_i_first(carry, row):
                return backward(carry, row, first=True, weights=False, inputs=True)

            def br_w(carry, row):
                stash, act_box, grad_box, wdy, g_local, g_outer, loss = carry
                cp = cparams(row[2], row[10])
                if static:
                    dlps = [vjp(d)[0] for (_, vjp), d in zip(static_vjps[row[4]][:-1],
                                                              static_douts[row[4]])]
                    pad = [jax.tree.map(jnp.zeros_like, dlps[0])] * (self.lmax - len(dlps))
                    dcp = jax.tree.map(lambda *a: jnp.stack(a), *dlps, *pad)
                else:
                    dcp = lw_weights(cp, [read(buf, row[4]) for buf in stash], read(wdy, row[4]))
                g_local = add_at(g_local, (row[10], row[2]), dcp)
                return (stash, act_box, grad_box, wdy, g_local, g_outer, loss), zero_act, zero_act

            # A schedule uses whole or split backwards, never both: the other kind is never
            # selected, so it is not built (lax.switch traces every branch).
            whole = [br_idle] * 2 if split else [br_b_mid, br_b_first]
            parts = [br_i_mid, br_i_first, br_w] if split else [br_idle] * 3
            branches = [br_idle, br_f_mid, br_f_first, br_f_last, br_f_only, *whole, *parts]
            p = self.p
            fwd_perm = [(i, (i + 1) % p) for i in range(p)]
            bwd_perm = [(i, (i - 1) % p) for i in range(p)]

            def deliver(box, slot, x):
                ok = slot >= 0
                i = jnp.maximum(slot, 0)
                return write(box, i, jnp.where(ok, x, read(box, i)))

            def receive(carry, row, send_act, send_grad, direct=False):
                stash, act_box, grad_box, wdy, g_local, g_outer, loss = carry
                if direct:
                    recv_act, recv_grad = send_act, send_grad
                elif p > 1:
                    recv_act = jax.lax.ppermute(send_act, "pipe", fwd_perm)
                    recv_grad = jax.lax.ppermute(send_grad, "pipe", bwd_perm)
                else:
                    recv_act, recv_grad = send_act, send_grad
                act_box = deliver(act_box, row[7], recv_act)
                grad_box = deliver(grad_box, row[8], recv_grad)
                return (stash, act_box, grad_box, wdy, g_local, g_outer, loss)

            def tick(carry, rows):
                row = jax.lax.dynamic_index_in_dim(rows, stage, 0, False)
                carry, send_act, send_grad = jax.lax.switch(row[0], branches, carry, row)
                return receive(carry, row, send_act, send_grad), None
            return branches, tick, receive

        carry0 = (stash0, act_box0, grad_box0, wdy0, g_local0, g_outer0, loss0)
        sent = []
        if static:  # measurement only: this stage's actions, dispatched in Python
            branches, _, receive = make_branches()
            carry = carry0
            for t, r in enumerate(tb.stacked()[:, static_stage]):
                row = tuple(int(x) for x in r)
                carry, send_act, send_grad = branches[row[0]](carry, row)
                # The neighbours run other programs here: what arrives is an input (distinct
                # per tick, so XLA cannot merge microbatches) and what leaves is an output
                # (so XLA keeps the work that made it).
                carry = receive(carry, row, feed[2 * t], feed[2 * t + 1], direct=True)
                sent += [send_act, send_grad]
        elif update is None:
            carry, _ = jax.lax.scan(make_branches()[1], carry0, jnp.asarray(tb.stacked()))
        else:  # 2BW: one scan per step's ticks, each followed by that step's update
            table, start, carry, losses = tb.stacked(), 0, carry0, []
            for k, end in enumerate(tb.step_ends):
                carry, _ = jax.lax.scan(make_branches()[1], carry, jnp.asarray(table[start:end]))
                start = end
                stash, act_box, grad_box, wdy, g_local, g_outer, loss = carry
                j = k % 2  # step k ran on version j = W(k-1); version 1-j holds W(k)
                grads = assemble([jax.lax.psum(g[j], "pipe") for g in g_outer],
                                 [g[j][None] for g in g_local])
                current = assemble([o[1 - j] for o in store["outer"]],
                                   [x[1 - j][None] for x in store["local"]])
                new, loss_k = update(k, current, grads, jax.lax.psum(loss[k], "pipe") * inv_m)
                new_outer, new_local = split_version(new)  # W(k+1) replaces W(k-1)
                store["outer"] = [o.at[j].set(n) for o, n in zip(store["outer"], new_outer)]
                store["local"] = [x.at[j].set(n) for x, n in zip(store["local"], new_local)]
                g_local = [g.at[j].set(0) for g in g_local]
                g_outer = [g.at[j].set(0) for g in g_outer]
                carry = (stash, act_box, grad_box, wdy, g_local, g_outer, loss)
                losses.append(loss_k)
            last = (steps - 1) % 2
            return jnp.stack(losses), [
                assemble([o[1 - last] for o in store["outer"]],
                         [x[1 - last][None] for x in store["local"]]),
                assemble([o[last] for o in store["outer"]],
                         [x[last][None] for x in store["local"]]),
            ]
        *_, g_local, g_outer, loss = carry
        loss = jax.lax.psum(loss[0], "pipe") * inv_m
        grads = assemble([jax.lax.psum(g[0], "pipe") for g in g_outer],
                         [g[0][None] for g in g_local])
        if static:
            return loss, grads, jnp.stack(sent)[None]
        return loss, grads


def build(staged, plan, canonical_template: nnx.State, example: dict | None = None) -> Pipeline:
    """The pipeline for ``plan`` (validates layers, microbatches and schedule up front).

    ``example``: abstract inputs of one example (``batch_spec(1)``), for cost-based partitions.
    """
    return Pipeline(staged, plan, canonical_template, example)


__all__ = ["Pipeline", "Tables", "build", "build_tables"]
