"""The ``data`` axis as a store: ZeRO-1/2 optimizer-state and gradient shards, ZeRO-3 (FSDP).

- ZeRO-1 (``zero=1``): each optimizer-state leaf also splits over ``data`` on its first free
  dimension that divides; ZeRO-2 (``zero=2``) reduce-scatters the gradients onto those shards.
- ZeRO-3 (``zero=3``): the parameters split over ``data`` too
  (:func:`fiddlejax.compute.fsdp_dims`), and over ``context`` or ``expert`` outside a
  pipeline (:func:`store_also`), and the computation sees them through a
  :class:`~fiddlejax.compute.ParamView` that gathers each layer's weights when it runs
  (``fsdp_gather="layer"``) or the whole tree once per step (``"step"``), in the compute
  dtype, keeping the ``pipe``/``tensor`` split.

:func:`lay_out` decides it once; the functions below apply it inside a step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax import compute
from fiddlejax.compute import vocab
from fiddlejax.mesh import axis_size
from fiddlejax.parallel.concern import Draft
from fiddlejax.parallel.ops import Ops
from fiddlejax.plan import Plan
from fiddlejax.staged import StagedModel


@dataclasses.dataclass(frozen=True)
class Zero:
    """How the parameters and gradients are stored over ``data`` and seen by the computation.

    ``dims``: each leaf's FSDP dimension (-1: replicated), ``None`` without zero=3;
    ``gather_specs``: the leaves' specs once gathered (split over pipe and tensor only);
    ``scatter_dims``: the dimensions whole-gradient sums are reduce-scattered on (ZeRO-2, or
    FSDP gathered once per step), else ``None``; ``view``: how layers see their parameters
    (gathers, casts), ``None`` when they see them as stored.
    """

    dims: Any = None
    gather_specs: Any = None
    scatter_dims: Any = None
    gather_step: bool = False
    gather_dtype: Any = None
    view: compute.ParamView | None = None
    layer_dims: Any = None
    layer_specs: Any = None
    prefetch: bool = False
    vocab: Any = None  # compute.vocab.VocabShards: the embedding and head split by vocabulary


def lay_out(internal: nnx.State, specs: nnx.State, plan: Plan, stack: str,
            pipelined: bool, vocab_services: bool = False) -> tuple[Zero, nnx.State, Any]:
    """``(zero, specs, outer_view)``: the storage over ``data`` for ``plan``, the parameters'
    specs with their FSDP dimensions added, and the view of the tree outside the layer stack
    (a function of the parameters, or ``None`` when the model sees them as stored).

    ``vocab_services``: the model computes its embedding and head with vocabulary slices
    (:mod:`fiddlejax.compute.vocab`); when zero=3 splits them by vocabulary over ``data`` (and
    gathers per layer, outside a pipeline, over ``data`` alone) the view leaves them split."""
    lead = 3 if pipelined else 1  # stack: [pipe, virtual, layers, ...] or [layers, ...]

    def in_stack(path) -> bool:
        return getattr(path[0], "key", None) == stack

    dims, gather_specs = None, specs
    also = store_also(plan, pipelined)

    def shards(spec) -> int:  # data x the ``also`` axes the leaf is not already split over
        return plan.data * math.prod(axis_size(plan.mesh, a)
                                     for a in compute.free_of(also, spec))

    if plan.zero == 3 and shards(P()) > 1:
        if vocab_services and not pipelined and not also and plan.fsdp_gather == "layer":
            specs = vocab.free_vocab(specs, internal, dict(plan.mesh.shape))
        dims = compute.fsdp_dims(internal, specs, shards,
                                 lambda path: lead if in_stack(path) else 0)
        axes = ("data", *also) if plan.data > 1 else also
        specs = compute.with_data_axis(specs, dims, axes if also else "data")
    dtype = None if plan.compute_dtype == "float32" else jnp.dtype(plan.compute_dtype)
    gather_step = dims is not None and plan.fsdp_gather == "step"
    if gather_step and also:
        raise ValueError(
            f"fsdp_gather='step' gathers the FSDP shards over data once per step, but with "
            f"{also[0]}={axis_size(plan.mesh, also[0])} zero=3 also shards them over "
            f"{also[0]}; use fsdp_gather='layer'")
    per_use = dims if not gather_step else None
    view = (compute.ParamView(dtype, plan.matmul_dtype, also, plan.mesh)
            if per_use is not None or dtype is not None else None)
    # Whole gradient sums are reduce-scattered after the microbatches: FSDP gathered once per
    # step, or ZeRO-2 (onto the optimizer state's shards).
    scatter_dims = dims if gather_step else None
    if plan.zero == 2 and plan.data > 1:
        scatter_dims = jax.tree.map(
            lambda v, sp: data_dim(sp.get_value(), v.shape, plan.data), internal, specs,
            is_leaf=lambda x: isinstance(x, nnx.Variable))
    zero = Zero(dims, gather_specs, scatter_dims, gather_step, dtype)
    if view is None:
        return zero, specs, None
    used = per_use if per_use is not None else jax.tree.map(lambda _: -1, internal)
    layer_dims = jax.tree.map(lambda d: d - lead if d >= 0 else -1, used[stack])
    layer_specs = jax.tree.map(  # one layer's: the stacking dimensions dropped
        lambda _, v: P(*tuple(v.get_value() if isinstance(v, nnx.Variable) else v)[lead:]),
        layer_dims, gather_specs[stack])
    outer = jax.tree_util.tree_map_with_path(lambda path, d: -1 if in_stack(path) else d, used)
    shards = None
    if (vocab_services and per_use is not None and not pipelined and not also
            and vocab.splits_vocab(outer, internal)):
        shards = vocab.VocabShards("data")
        outer = jax.tree.map(lambda d, v: -1 if vocab.vocab_axis(v) >= 0 else d, outer,
                             internal, is_leaf=lambda x: isinstance(x, nnx.Variable))
    zero = dataclasses.replace(zero, view=view, layer_dims=layer_dims, layer_specs=layer_specs,
                               prefetch=plan.fsdp_prefetch and per_use is not None
                               and not pipelined, vocab=shards)
    return zero, specs, lambda p: view.tree(p, outer, gather_specs)


class Store:
    """The ``data`` axis as a store: ZeRO's shards and FSDP's dimensions added to the specs,
    and the view through which the model sees its parameters (gathers, casts)."""

    axis, sets, offers = "data", frozenset({"zero", "specs", "model"}), "vocab"

    def apply(self, draft: Draft) -> Draft:
        zero, specs, outer = lay_out(draft.internal, draft.specs, draft.plan, draft.staged.stack,
                                     draft.pipeline is not None, vocab_services(draft.staged))
        offered = None if zero.vocab is None else Ops(vocab=zero.vocab)  # prologue, head, loss
        model = None if outer is None else compute.ViewedModel(draft.staged, outer, offered)
        return dataclasses.replace(draft, zero=zero, specs=specs, model=model)


def vocab_services(staged) -> bool:
    """Whether ``staged`` runs a model whose own embedding, head and loss compute with
    vocabulary slices (``vocab_services``; :mod:`fiddlejax.compute.vocab`), offered as
    ``ops.vocab`` to their ``ops`` arguments: not through a layout's wrapper, a loss of the
    user's or logits cut back from padding."""
    if type(staged) is not StagedModel or staged.loss_fn is not None:
        return False
    if staged.vocab_pads or staged.loss_layout is not None:
        return False
    return bool(getattr(staged.graphdef.nodes[0].type, "vocab_services", False))


def store_also(plan: Plan, pipelined: bool) -> tuple[str, ...]:
    """The axes besides ``data`` zero=3 shards the parameters over, outside a pipeline:
    ``context`` (its replicas hold the same parameters; Megatron and MaxText shard over both)
    or ``expert`` (more data parallelism outside the MoE layers: the dense weights shard over
    it too, as MaxText's and FSDP2's do; the experts' own are split over it already)."""
    if plan.zero != 3 or pipelined:
        return ()
    return tuple(a for a in ("context", "expert") if axis_size(plan.mesh, a) > 1)


def grad_shardings(plan: Plan, specs: nnx.State, internal: nnx.State, params: Any) -> Any:
    """ZeRO-2: the reduced gradients split over ``data`` as the optimizer state is; else the
    parameters' own shardings ``params``."""
    if not (plan.zero == 2 and plan.data > 1):
        return params
    return jax.tree.map(
        lambda sp, v: NamedSharding(plan.mesh, on_first_free_dim(sp, v.shape, plan.data)),
        specs, internal, is_leaf=lambda x: isinstance(x, P))


def opt_shardings(optimizer, opt_abstract, specs, plan: Plan):
    """Optimizer-state shardings mirror the parameters'; ZeRO-1 also splits them over ``data``."""
    mesh = plan.mesh

    def spec_for(leaf, spec):
        s = spec if isinstance(spec, P) else spec[...]
        if plan.zero and plan.data > 1 and "data" not in jax.tree.leaves(tuple(s)):
            s = on_first_free_dim(s, leaf.shape, plan.data)
        return NamedSharding(mesh, s)

    def unwrap(x):
        return x.get_value() if isinstance(x, nnx.Variable) else x

    plain = jax.tree.map(lambda v: v.get_value(), specs,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))

    def leaf_sharding(leaf, spec):  # a masked leaf holds nothing: any sharding covers it
        return NamedSharding(mesh, P()) if masked(leaf) else spec_for(unwrap(leaf), spec)

    return optax.tree_map_params(
        optimizer, leaf_sharding, opt_abstract, plain,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
        is_leaf=lambda x: isinstance(x, P | nnx.Variable))


def gather_once(zero: Zero, params: nnx.State) -> nnx.State:
    """A replica's parameters as its step uses them: ``fsdp_gather="step"`` gathers the FSDP
    shards (in the compute dtype) once, before the first microbatch; else as given (the layers
    gather per use)."""
    if not zero.gather_step:
        return params
    return compute.gather_whole(params, zero.dims, zero.gather_specs, zero.gather_dtype)


def vary_replicated(zero: Zero, params: nnx.State) -> nnx.State:
    """Replicated parameters marked varying over ``data``, so autodiff returns each replica's
    own gradients (not an implicit psum) for the plan's reduction; FSDP shards vary already."""
    if zero.dims is None:
        return jax.lax.pcast(params, ("data",), to="varying")
    return jax.tree.map(
        lambda d, v: v if d >= 0 else jax.lax.pcast(v, ("data",), to="varying"),
        zero.dims, params)


def scatter_specs(plan: Plan, zero: Zero, params: nnx.State) -> Any:
    """ZeRO-2: the reduced gradients' specs over ``data`` (the optimizer state's shards);
    ``None`` otherwise (gradients sharded as the parameters)."""
    if plan.zero != 2 or zero.scatter_dims is None:
        return None
    return compute.only_data(zero.scatter_dims, params)


def masked(x) -> bool:
    """An optax.MaskedNode, bare or in an nnx.Variable: no state for this parameter."""
    if isinstance(x, nnx.Variable):
        x = x.get_value()
    return isinstance(x, optax.MaskedNode)


def data_dim(spec: P, shape: tuple[int, ...], data: int) -> int:
    """The dimension ZeRO shards a leaf's optimizer state (and, with zero=2, its reduced
    gradient) on over ``data``; -1: none."""
    parts = tuple(on_first_free_dim(spec, shape, data))
    return parts.index("data") if "data" in parts else -1


def on_first_free_dim(spec: P, shape: tuple[int, ...], data: int) -> P:
    """``spec`` with ``data`` on the first free dimension that ``data`` divides (ZeRO-1/2's
    optimizer shards; FSDP's own dimension is :func:`fiddlejax.compute.add_data_axis`'s)."""
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for d, (size, ax) in enumerate(zip(shape, parts)):
        if ax is None and size % data == 0 and size >= data:
            parts[d] = "data"
            return P(*parts)
    return P(*parts)
