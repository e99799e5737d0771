"""A model laid out on the mesh: each parallel concern applied in turn, once, before compiling.

The order (as torchtitan's ``parallelize_llama`` applies TP, activation checkpointing, FSDP):

1. ``tensor`` (:mod:`fiddlejax.parallel.tensor`): vocabularies padded for their split;
2. ``pipe`` (:mod:`fiddlejax.pipeline.runtime`): layers grouped into stages and chunks;
3. the parameters' specs over ``tensor`` (and ``pipe``), checked to divide the mesh;
4. ``data`` as a store (:mod:`fiddlejax.parallel.zero`): FSDP dimensions and the view the
   layers see, ZeRO's gradient and optimizer-state shards;
5. ``data`` as replicas (:mod:`fiddlejax.parallel.exchange`, :mod:`fiddlejax.parallel.data`):
   how the gradients are exchanged (dense, top-k, PipeDream-2BW), which shapes the state.

Between 1 and 2, ``context`` (:mod:`fiddlejax.parallel.context`): sequences split over the
``context`` axis, the model wrapped so its batches are cut and its attention joins the shards
(it has no parameters of its own); then sequence parallelism over ``tensor``
(:mod:`fiddlejax.parallel.sequence`, ``Plan(sequence_parallel=True)``); then ``expert``
(:mod:`fiddlejax.parallel.expert`): rows split over ``expert`` between the layers, the MoE
layers' tokens sent to their experts' devices; last, a model with LoRA adapters sees the rest
of its parameters frozen (:mod:`fiddlejax.finetune.lora`).
The result, a :class:`~fiddlejax.parallel.layout.Layout`, holds no arrays; the step functions
read it.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax import compute, layout
from fiddlejax.finetune import lora
from fiddlejax.parallel import context, exchange, expert, sequence, tensor
from fiddlejax.parallel import zero as zero_
from fiddlejax.parallel.layout import Layout, to_internal
from fiddlejax.plan import Plan
from fiddlejax.staged import StagedModel
from fiddlejax.state import TrainState


def lay_out(staged: StagedModel, canonical: nnx.State, plan: Plan,
            optimizer: optax.GradientTransformation, name: str,
            example: dict | None = None) -> Layout:
    """Apply the parallel concerns to ``staged`` in the documented order."""
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), canonical)
    staged = tensor.with_vocab_pads(staged, canonical, plan)
    staged = context.lay_out(staged, plan, example)
    staged = sequence.lay_out(staged, plan, example)
    staged = expert.lay_out(staged, plan, canonical)
    staged = lora.lay_out(staged, canonical)  # adapters: the rest frozen, on every layout
    pipeline = None
    if plan.schedule is not None:
        from fiddlejax.pipeline import runtime

        pipeline = runtime.build(staged, plan, template, example)
    internal = jax.eval_shape(lambda c: to_internal(staged, pipeline, plan, c, None), canonical)
    specs = tensor.param_specs(internal, plan, pipeline, name)
    zero, specs, outer_view = zero_.lay_out(internal, specs, plan, staged.stack,
                                            pipeline is not None, vocab_services(staged))
    model = staged if outer_view is None else compute.ViewedModel(staged, outer_view,
                                                                  zero.vocab)
    if pipeline is not None:
        pipeline = pipeline.running(model, zero.dims)
    mesh = plan.mesh
    params = layout.shardings(mesh, specs)
    stepper = exchange.pick(plan)
    stepper.check(optimizer)
    opt = zero_.opt_shardings(optimizer, jax.eval_shape(optimizer.init, internal), specs, plan)
    if stepper.local_optimizer:  # topk_on="updates": one optimizer state per data replica
        opt = jax.tree.map(lambda s: NamedSharding(mesh, P("data", *s.spec)), opt)
    residual = (jax.tree.map(lambda s: NamedSharding(mesh, P("data", *s.spec)), params)
                if stepper.residual else None)  # top-k: per data replica
    state = TrainState(NamedSharding(mesh, P()), params, opt, residual,
                       params if stepper.versions == 2 else None)
    return Layout(plan, name, staged, model, template, pipeline, zero, specs, params,
                  zero_.grad_shardings(plan, specs, internal, params), opt, residual, state,
                  NamedSharding(mesh, P("data")), stepper)


def vocab_services(staged) -> bool:
    """Whether ``staged`` runs a model whose own embedding, head and loss compute with
    vocabulary slices (``vocab_services``; :mod:`fiddlejax.compute.vocab`): not through a
    layout's wrapper, a loss of the user's or logits cut back from padding."""
    if type(staged) is not StagedModel or staged.loss_fn is not None:
        return False
    if staged.vocab_pads or staged.loss_layout is not None:
        return False
    return bool(getattr(staged.graphdef.nodes[0].type, "vocab_services", False))
