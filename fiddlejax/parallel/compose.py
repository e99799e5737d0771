"""A model laid out on the mesh: each parallel concern applied in turn, once, before compiling.

The order (as torchtitan's ``parallelize_llama`` applies TP, activation checkpointing, FSDP),
after Gist's encodings are offered to the model's own calls (:class:`Encoding`):

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
Each step is a :class:`~fiddlejax.parallel.concern.Concern` (:data:`CONCERNS`, in that order),
folded over a :class:`~fiddlejax.parallel.concern.Draft`; :func:`assemble` turns the draft into a
:class:`~fiddlejax.parallel.layout.Layout`, which holds no arrays: the step functions read it.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax import layout
from fiddlejax.adaptation import grouping, hetero
from fiddlejax.finetune import dpo, lora
from fiddlejax.parallel import context, exchange, expert, sequence, tensor, zero
from fiddlejax.parallel.concern import Draft, fold
from fiddlejax.parallel.layout import Layout, to_internal
from fiddlejax.parallel.ops import Ops
from fiddlejax.plan import Plan
from fiddlejax.staged import StagedModel
from fiddlejax.state import TrainState


class Encoding:
    """Gist's encodings (``Plan(encodings=...)``): offered as ``ops.encodings`` to the model's
    own prologue, layers, head and loss, whatever else splits them (first: the model is still
    the staged one, which passes them on to every call)."""

    axis, sets, offers = "", frozenset({"staged"}), "encodings"

    def apply(self, draft: Draft) -> Draft:
        if not draft.plan.encodings:
            return draft
        from fiddlejax.memory import gist

        offered = Ops(encodings=gist.parse(list(draft.plan.encodings)))
        return dataclasses.replace(draft, staged=dataclasses.replace(draft.staged,
                                                                     offered=offered))


class Freezing:
    """LoRA: a model with adapters sees the rest of its parameters frozen, on every layout.
    (Defined here: :mod:`fiddlejax.finetune` sits below the parallel concerns.)"""

    axis, sets, offers = "", frozenset({"staged"}), None

    def apply(self, draft: Draft) -> Draft:
        return dataclasses.replace(draft, staged=lora.lay_out(draft.staged, draft.canonical))


class Referencing:
    """DPO with LoRA: the reference scored in the step by the base with its adapters off
    (:class:`fiddlejax.finetune.dpo.InStep`), through every concern the policy goes through."""

    axis, sets, offers = "", frozenset({"staged"}), None

    def apply(self, draft: Draft) -> Draft:
        return dataclasses.replace(draft, staged=dpo.lay_out(draft.staged, draft.canonical))


class Pipe:
    """``pipe``: the layers grouped into stages and chunks, which fixes the internal tree
    (stacked per stage and chunk; with no pipeline, the model's own stacking)."""

    axis, sets, offers = "pipe", frozenset({"pipeline", "internal"}), None

    def apply(self, draft: Draft) -> Draft:
        pipeline = None
        if draft.plan.schedule is not None:
            from fiddlejax.pipeline import runtime

            pipeline = runtime.build(draft.staged, draft.plan, draft.template, draft.example)
        internal = jax.eval_shape(
            lambda c: to_internal(draft.staged, pipeline, draft.plan, c, None), draft.canonical)
        return dataclasses.replace(draft, pipeline=pipeline, internal=internal)


CONCERNS = (Encoding(), tensor.VocabPads(), context.ContextAxis(), sequence.SequenceSplit(),
            expert.ExpertAxis(), Freezing(), Referencing(), Pipe(), tensor.Specs(), zero.Store(),
            exchange.Replicas())


def lay_out(staged: StagedModel, canonical: nnx.State, plan: Plan,
            optimizer: optax.GradientTransformation, name: str,
            example: dict | None = None) -> Layout:
    """Apply the parallel concerns to ``staged`` in the documented order (unequal blocks
    first grouped one group per pipeline chunk: :mod:`fiddlejax.adaptation.grouping`)."""
    if isinstance(staged, hetero.HeteroModel):
        staged = grouping.for_plan(staged, canonical, plan, example, optimizer)
    template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), canonical)
    return assemble(fold(CONCERNS, Draft(plan, name, canonical, template, example, optimizer,
                                         staged)))


def assemble(draft: Draft) -> Layout:
    """The :class:`Layout` of a folded draft: the pipeline running the model as a step sees
    it, and every sharding from the specs and what the stepper keeps."""
    plan, specs, stepper = draft.plan, draft.specs, draft.stepper
    model = draft.model if draft.model is not None else draft.staged
    pipeline = draft.pipeline.running(model, draft.zero.dims) if draft.pipeline else None
    mesh = plan.mesh
    params = layout.shardings(mesh, specs)
    opt = zero.opt_shardings(draft.optimizer, jax.eval_shape(draft.optimizer.init,
                                                             draft.internal), specs, plan)
    if stepper.local_optimizer:  # topk_on="updates": one optimizer state per data replica
        opt = jax.tree.map(lambda s: NamedSharding(mesh, P("data", *s.spec)), opt)
    residual = (jax.tree.map(lambda s: NamedSharding(mesh, P("data", *s.spec)), params)
                if stepper.residual else None)  # top-k: per data replica
    state = TrainState(NamedSharding(mesh, P()), params, opt, residual,
                       params if stepper.versions == 2 else None)
    return Layout(plan, draft.name, draft.staged, model, draft.template, pipeline, draft.zero,
                  specs, params, zero.grad_shardings(plan, specs, draft.internal, params), opt,
                  residual, state, NamedSharding(mesh, P("data")), stepper)
