"""The ``expert`` axis: MoE experts split over devices, their tokens sent by all-to-all.

Outside the MoE layers ``expert`` is more data parallelism (DeepSpeed-MoE, Megatron, MaxText):
each data replica's rows are split over ``expert`` (the axis is ``Auto``, like ``context``:
the partitioner runs everything token-wise on ``1/S`` of the rows and reduces the dense
weights' gradients over it). The experts' stacked weights (logical name ``"expert"``) are split
over it on their expert dimension, ``E / S`` experts per device. Inside an MoE layer
(:func:`dropless`) each shard routes its own tokens, sends each (token, choice) pair to the
shard that owns its expert (an all-to-all), the local experts run their grouped matmul, and the
results come back by the reverse all-to-all to be combined with the gates. Routing and the
router losses happen outside, token-wise, so they are the same numbers on every layout.

**Written for the partitioner**, as :mod:`.ring` is: every array keeps a leading axis of
shards pinned to ``expert`` and each shard's work is a ``vmap`` over it. The one manual piece
is the all-to-all itself (:func:`_all_to_all`), a ``shard_map`` over ``expert`` whose body is
one ``jax.lax.all_to_all``: being linear it has no residuals, so it differentiates inside the
step's manual region and the layer scan, where a ``shard_map`` around the whole dispatch does
not on jax 0.10 (its residuals come out sharded over ``data`` before ``expert``, which Shardy
refuses: "manual axis after free axis"). Left to the partitioner, the same axis swap lowers to
an all-gather of every shard's whole buffer (``S`` times the bytes).

**Static shapes, nothing dropped.** ``ragged_all_to_all`` would send only the real pairs, but
XLA's CPU has no kernel for it (``UNIMPLEMENTED``), and an all-to-all needs one buffer size for
every destination. A shard of ``n`` tokens can send one destination at most ``n * min(k, E /
S)`` pairs (a token's ``k`` choices are distinct experts), so that is the buffer: ``[S, n *
min(k, E / S), d]`` per shard, out and back. Against the ``n * k`` pairs really sent, that is
``S * min(k, E / S) / k`` times the bytes and the receiving grouped matmul's rows: 2x at ``S =
2`` (E = 4, k = 2), 4x for Mixtral's 8 experts, top-2, on ``expert = 8``
(``benchmarks/results/expert_parallel.md`` has the measurements). Padding rows are zeros; they
are run by the last local expert and thrown away, so they add nothing to the output or the
gradients.

**Any loss, on every layout.** With ``tensor`` too, a loss gets its inputs with only their
rows split (:func:`loss_inputs`): XLA's partitioner aborts on a gather along vocabulary-split
logits whose rows are split over ``expert`` (optax's integer-label cross-entropy).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax.mesh import axis_size
from fiddlejax.parallel.concern import Draft
from fiddlejax.parallel.ops import Ops, extend


@dataclasses.dataclass(frozen=True)
class Split:
    """Experts split over ``size`` devices of ``mesh``'s ``expert`` axis."""

    size: int
    mesh: object = None

    def local(self, num_experts: int) -> int:
        """Experts per device; refuses a count the axis does not divide."""
        if num_experts % self.size:
            good = [s for s in range(1, num_experts + 1) if num_experts % s == 0]
            raise ValueError(
                f"expert={self.size} splits the experts over devices, but this MoE layer has "
                f"num_experts={num_experts}, not a multiple of {self.size}; use mesh expert "
                f"in {good}")
        return num_experts // self.size


def buffer_rows(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows of one destination's all-to-all buffer: the most pairs ``tokens`` can send it."""
    return tokens * min(top_k, local_experts)


def _send_plan(experts: jax.Array, num_experts: int, shards: int, rows: int):
    """For the choice-major pairs of one shard's ``experts [n, k]``: ``order`` (sorted by
    expert), each sorted pair's slot in the ``[shards * rows]`` send buffer, its local expert."""
    flat = experts.T.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    owner = flat[order]
    local = num_experts // shards
    dest = owner // local
    per_dest = jnp.zeros((shards,), jnp.int32).at[dest].add(1)
    rank = jnp.arange(order.shape[0], dtype=jnp.int32) - (jnp.cumsum(per_dest) - per_dest)[dest]
    return order, dest * rows + rank, owner % local


def dropless(split: Split, x: jax.Array, gates: jax.Array, experts: jax.Array, ws: tuple,
             matmuls: Callable) -> jax.Array:
    """:func:`fiddlejax.models.moe.dropless` with the experts split over ``expert``: ``x [N,
    d]`` (rows split over ``expert``), ``gates``, ``experts [N, k]``, the experts' stacked
    weights ``ws`` (``[E, ...]`` each) and ``matmuls(rows, sizes, ws, most)``, the model's
    grouped matmul of rows sorted by expert (``sizes[e]`` rows each; the rows past their sum
    are the buffers' padding, thrown away after; ``most[e]``: no shard's expert ``e`` has
    more rows, the same on every shard)."""
    s, e = split.size, ws[0].shape[0]
    local = split.local(e)
    big, k = experts.shape
    if big % s:
        raise ValueError(f"expert={s} splits an MoE layer's {big} tokens over its shards; "
                         f"make the tokens per microbatch a multiple of {s}")
    n, d = big // s, x.shape[1]
    rows = buffer_rows(n, k, local)

    def keep(a):  # the leading axis (the shards) on `expert`
        return _constrain(a, split, P("expert"))

    def shards(a):
        return keep(a.reshape(s, a.shape[0] // s, *a.shape[1:]))

    xs, gs, es = shards(x), shards(gates), shards(experts)
    order, slot, lexp = jax.vmap(lambda i: _send_plan(i, e, s, rows))(es)
    token = order % n

    def pack(x, t, sl, le):  # one source's send buffer [S * rows, d] and its tags
        buf = jnp.zeros((s * rows, d), x.dtype).at[sl].set(x[t])
        return buf, jnp.full((s * rows,), local, jnp.int32).at[sl].set(le)  # local: padding

    send, tag = jax.vmap(pack)(xs, token, slot, lexp)
    recv = _all_to_all(send.reshape(s, s, rows, d), split)      # [dst, src, rows, d]
    rtag = _all_to_all(tag.reshape(s, s, rows), split)

    rtag = rtag.reshape(s, s * rows)
    sizes = jax.vmap(lambda t: jnp.zeros((local + 1,), jnp.int32).at[t].add(1)[:local])(rtag)
    # the most rows any shard's expert j got: one loop length for every shard (a vmapped loop
    # whose length differs by shard would select between its buffers at every step)
    most = jnp.max(keep(sizes), axis=0)

    def run(recv, rtag, sizes, w):  # one shard's experts on what arrived, sorted by local
        sort = jnp.argsort(rtag, stable=True)  # expert; the padding last, past every group
        ys = matmuls(recv[sort], sizes, w, most)
        return jnp.zeros_like(ys).at[sort].set(ys)

    wl = tuple(shards(w) for w in ws)  # [S, E / S, ...]: each shard's own experts
    y = keep(jax.vmap(run)(recv.reshape(s, s * rows, d), rtag, sizes, wl))
    back = _all_to_all(y.reshape(s, s, rows, d), split)          # [src, dst, rows, d]

    def combine(back, sl, o, t, g):
        ys = back.reshape(s * rows, d)[sl]
        gate = g.T.reshape(-1)[o].astype(ys.dtype)
        return jnp.zeros((n, d), ys.dtype).at[t].add(ys * gate[:, None])

    out = keep(jax.vmap(combine)(back, slot, order, token, gs))
    return out.reshape(big, d)


def with_capacity(split: Split, buf: jax.Array, ws: tuple, run: Callable) -> jax.Array:
    """The capacity dispatch's experts with the experts split over ``expert``: the sequences'
    buffers ``buf [B, E, C, d]`` (rows split over ``expert``) cut by destination, sent by one
    all-to-all, run by each shard's ``E / S`` experts (``run(buf, ws)``) and sent back. The
    buffers are already static (capacity ``C`` per expert and sequence): nothing is padded
    beyond what the capacity dispatch holds on one device."""
    s, e = split.size, ws[0].shape[0]
    local = split.local(e)
    b, _, c, d = buf.shape
    if b % s:  # too few sequences to split: the partitioner runs it where the weights are
        return run(buf, ws)

    def keep(a):
        return _constrain(a, split, P("expert"))

    # [src, B / S, dst, E / S, C, d] -> [src, dst, ...] -> all-to-all -> [dst, src, ...]
    out = keep(buf.reshape(s, b // s, s, local, c, d)).swapaxes(1, 2)
    recv = _all_to_all(out, split)
    wl = tuple(keep(w.reshape(s, local, *w.shape[1:])) for w in ws)
    y = keep(jax.vmap(run)(recv, wl))                      # [dst, src, B / S, E / S, C, d]
    back = _all_to_all(y, split).swapaxes(1, 2)              # [src, B / S, dst, E / S, C, d]
    return keep(back).reshape(b, e, c, d)


def _all_to_all(a: jax.Array, split: Split) -> jax.Array:
    """``a[i, j]`` -> ``a[j, i]``, the leading axis on ``expert`` before and after: shard
    ``i``'s block ``j`` to shard ``j``, one ``jax.lax.all_to_all``."""
    def swap(b):  # b: [1, S, ...], this shard's row
        return jax.lax.all_to_all(b, "expert", 1, 0, tiled=True).swapaxes(0, 1)

    mesh = jax.sharding.get_abstract_mesh()
    mesh = split.mesh if mesh.empty else mesh
    spec = P("expert")
    out = jax.shard_map(swap, mesh=mesh, in_specs=spec, out_specs=spec,
                        axis_names={"expert"})(_constrain(a, split, spec))
    return _constrain(out, split, spec)


def _constrain(x: jax.Array, split: Split, spec: P) -> jax.Array:
    """``x`` split as ``spec`` says (the other axes left to the partitioner: ``tensor``)."""
    mesh = jax.sharding.get_abstract_mesh()
    mesh = split.mesh if mesh.empty else mesh
    spec = P(*spec, *([P.UNCONSTRAINED] * (x.ndim - len(spec))))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_rows(x, split: Split):
    """``x`` with its leading (row) axis split over ``expert`` (arrays whose rows divide)."""
    if getattr(x, "ndim", 0) < 1 or x.shape[0] % split.size:
        return x
    return _constrain(x, split, P("expert"))


def loss_inputs(outputs, batch: dict, split: Split, tensor: int):
    """What reaches a loss under ``expert`` x ``tensor``: every array of ``outputs`` and
    ``batch`` whose leading axis is the batch's rows with those rows split over ``expert`` x
    ``tensor`` (over ``expert`` alone where they do not divide) and its other axes whole.

    Left to the partitioner, the head's logits reach the loss with their rows split over
    ``expert`` and their vocabulary over ``tensor``; in the step's region manual over ``data``,
    XLA's SPMD partitioner (jax 0.10) then aborts the process (``spmd_partitioner_util.cc``:
    "Check failed: partition_group_list.num_replica_groups() * ...") on a gather or a sort
    along the vocabulary: the ``take_along_axis`` of optax's integer-label cross-entropy or of
    a hand-written one, ``jnp.sort``. With only the rows split, every op of a loss is row-wise
    or a reduction over rows, which it partitions. Per device the logits keep their bytes (an
    all-to-all over ``tensor`` moves them); the values are the same. The cotangents leave the
    other way through :func:`head_input`."""
    leaves = jax.tree.leaves(batch)
    if not leaves or getattr(leaves[0], "ndim", 0) < 1:
        return outputs, batch
    rows, s = leaves[0].shape[0], split.size
    axes = ("expert", "tensor") if rows % (s * tensor) == 0 else "expert" if rows % s == 0 else None
    lay = functools.partial(_rows_only, rows=rows, axes=axes, split=split)
    return jax.tree.map(lay, outputs), jax.tree.map(lay, batch)


def head_input(x, split: Split):
    """The head's input with its rows split over ``expert`` and its other axes whole, so that
    its gradient reaches the layers so (:func:`loss_inputs`' rows split over ``tensor`` too
    would carry on into the MoE dispatch's gathers, where the partitioner aborts likewise)."""
    leaves = jax.tree.leaves(x)
    if not leaves or getattr(leaves[0], "ndim", 0) < 1:
        return x
    rows = leaves[0].shape[0]
    axes = "expert" if rows % split.size == 0 else None
    return jax.tree.map(functools.partial(_rows_only, rows=rows, axes=axes, split=split), x)


def _rows_only(a, rows: int, axes, split: Split):
    """``a`` (when its leading axis is the ``rows``) split over ``axes`` there, whole elsewhere."""
    if getattr(a, "ndim", 0) < 1 or a.shape[0] != rows:
        return a
    mesh = jax.sharding.get_abstract_mesh()
    mesh = split.mesh if mesh.empty else mesh
    return jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, P(axes, *([None] * (a.ndim - 1)))))


class ExpertModel:
    """A staged model whose batch rows are split over ``expert`` (each layer's input too) and
    whose MoE layers send tokens to their experts' devices. Everything else is the wrapped
    model's. Only inputs are constrained: a pipeline runs the prologue and the layers inside
    conditionals, whose branches' results must keep one sharding (the partitioner's)."""

    def __init__(self, inner, split: Split):
        self._inner, self.split = inner, split

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _rows(self, tree):
        return jax.tree.map(lambda a: constrain_rows(a, self.split), tree)

    def prologue(self, params, batch):
        return self._inner.prologue(params, self._rows(batch))

    def layer(self, layer_params, x, ops: Ops | None = None):
        return self._inner.layer(layer_params, self._rows(x), extend(ops, expert=self.split))

    def weighted_loss(self, params, x, batch):
        if getattr(self._inner, "loss_layout", None) is not None:  # see loss_inputs
            x = head_input(x, self.split)
        return self._inner.weighted_loss(params, x, self._rows(batch))

    def outputs(self, params, x, batch):
        if getattr(self._inner, "loss_layout", None) is not None:
            x = head_input(x, self.split)
        return self._inner.outputs(params, x, self._rows(batch))

    def epilogue(self, params, x, batch):
        total, sums = self.weighted_loss(params, x, batch)
        return total / sums.weight


def lay_out(staged, plan, canonical) -> object:
    """The ``expert`` step of :func:`fiddlejax.parallel.compose.lay_out`: ``staged`` itself
    when ``expert`` is 1, else an :class:`ExpertModel`; refuses a model with no parameter split
    over ``expert`` and expert counts the axis does not divide, before anything compiles."""
    size = axis_size(plan.mesh, "expert")
    if size == 1:
        return staged
    split = experts(canonical, plan.axis_rules)
    if not split:
        raise ValueError(
            f"expert={size} splits MoE experts over devices, but no parameter of this model "
            "has a dimension named 'expert' (an MoE layer's stacked experts, e.g. "
            "fiddlejax.models.moe.MoE's w_gate [E, d, f]); use mesh expert=1 (data=... for "
            "more data parallelism), or name the experts' dimension with "
            "fj.sharding.annotate(model, {regex: ('expert', ...)})")
    for path, count in split.items():
        if count % size:
            good = [s for s in range(1, count + 1) if count % s == 0]
            raise ValueError(
                f"expert={size} splits the experts over devices, but {path} holds "
                f"{count} experts, not a multiple of {size}; use mesh expert in {good}")
    tensor = axis_size(plan.mesh, "tensor")
    if tensor > 1 and dataclasses.is_dataclass(staged):  # see loss_inputs
        staged = dataclasses.replace(staged, loss_layout=functools.partial(
            loss_inputs, split=Split(size, plan.mesh), tensor=tensor))
    return ExpertModel(staged, Split(size, plan.mesh))


class ExpertAxis:
    """The ``expert`` concern: MoE experts split over the axis, rows split between the layers
    (more data parallelism); the dispatch is offered to blocks as ``ops.expert``."""

    axis, sets, offers = "expert", frozenset({"staged"}), "expert"

    def apply(self, draft: Draft) -> Draft:
        return dataclasses.replace(draft, staged=lay_out(draft.staged, draft.plan,
                                                         draft.canonical))


def experts(canonical, rules) -> dict[str, int]:
    """``{path: size}`` of each parameter dimension the ``rules`` map to ``expert``."""
    from fiddlejax import sharding

    specs = sharding.param_specs(canonical, rules)
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    shapes = jax.tree.leaves(canonical)
    for (path, spec), leaf in zip(flat, shapes, strict=True):
        for dim, axes in enumerate(spec):
            if axes == "expert" or (isinstance(axes, tuple) and "expert" in axes):
                name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                out[name] = leaf.shape[dim]
    return out


__all__ = ["ExpertAxis", "ExpertModel", "Split", "buffer_rows", "constrain_rows", "dropless",
           "experts", "lay_out", "loss_inputs", "with_capacity"]
