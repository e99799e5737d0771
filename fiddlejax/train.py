"""``parallelize``: a Flax model, an optax optimizer and a Plan become a Trainer of jitted steps.

The Trainer composes; it decides nothing about an axis itself.
:func:`fiddlejax.adaptation.split.split_model` turns the model into pure functions,
:func:`fiddlejax.parallel.compose.lay_out` applies the parallel concerns in their documented order
(tensor, pipe, ZeRO/FSDP over data, the gradient exchange), :mod:`fiddlejax.parallel.data` and
:mod:`fiddlejax.parallel.exchange` are the step, and :mod:`fiddlejax.canonical` converts states to
and from the model's own tree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from fiddlejax import batches, canonical, checks, staged
from fiddlejax.adaptation import dropout
from fiddlejax.adaptation.split import split_model
from fiddlejax.finetune import lora
from fiddlejax.memory import remat
from fiddlejax.parallel import compose, data
from fiddlejax.parallel.exchange import Program
from fiddlejax.plan import Plan
from fiddlejax.state import TrainState

__all__ = ["Trainer", "TrainState", "parallelize"]


class Trainer:
    """Pure, jitted functions for one model, optimizer and plan. Build with :func:`parallelize`."""

    def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation, plan: Plan,
                 loss: staged.Loss | None = None, layers: str | None = None, block_output=None):
        if plan.remat == "auto" and not plan.memory_budget:
            raise ValueError("remat='auto' needs Plan(memory_budget=<bytes per device>)")
        self.plan, self.mesh, self.optimizer = plan, plan.mesh, optimizer
        self.model_name = type(model).__name__
        source, self._init_params = split_model(model, loss, layers, block_output)
        self._batch_spec = getattr(model, "batch_spec", None)
        example = self._batch_spec(1) if self._batch_spec is not None else None
        self.layout = compose.lay_out(source, self._init_params, plan, optimizer,
                                      self.model_name, example)
        lay = self.layout
        for name in ("param_shardings", "grad_shardings", "opt_shardings", "residual_shardings",
                     "state_shardings", "batch_sharding", "stepper"):
            setattr(self, name, getattr(lay, name))
        self._value_ranges = checks.value_ranges(model)  # host batches: always (free)
        self._names_checked = False
        # remat="auto" is resolved on the first batch, when the step's shapes are known.
        self.remat_policy = None if plan.remat == "auto" else plan.remat
        self._remat = None if plan.remat == "auto" else remat.layer_remat(plan.remat, lay.zero)
        shardings = (self.state_shardings, None)
        jit = dict(in_shardings=shardings, out_shardings=shardings, donate_argnums=0)
        self._step = jax.jit(self._step_impl, **jit)  # gated: a device batch's ids, in-graph
        self._compiled: dict = {}  # precompile's executables, by the placed batch's signature
        self._gated_step = jax.jit(checks.skip_bad_ids(self._step_impl, self._value_ranges), **jit)
        self._steps = jax.jit(lambda s, b: lay.stepper.steps(self._program(), s,
                                                             self._indexed(b, s.step, steps=True)),
                              in_shardings=shardings, out_shardings=shardings, donate_argnums=0)
        self._loss_and_grads = jax.jit(lambda s, b: _canonical_grads(
            lay, self._program().loss_and_grads(s.params, self._indexed(b, s.step))))
        self._loss = jax.jit(lambda s, b: data.loss(lay, self._remat, s.params, b))
        self._to_canonical = jax.jit(lay.to_canonical)

    @property
    def staged(self):
        """The model as its steps run it (a StagedModel, seen through the FSDP view if any)."""
        return self.layout.model

    @property
    def pipeline(self):
        """The pipeline layout and executor (``fiddlejax.pipeline.runtime.Pipeline``), or None
        without a pipeline schedule: its schedule, tables, stage FLOPs."""
        return self.layout.pipeline

    @property
    def canonical_template(self) -> nnx.State:
        """The model's parameters as ShapeDtypeStructs (the canonical tree)."""
        return self.layout.template

    def _program(self) -> Program:
        return Program(self.layout, self._remat, self.optimizer)

    def _step_impl(self, state: TrainState, batch: dict):
        return self.layout.stepper.step(self._program(), state, self._indexed(batch, state.step))

    def _indexed(self, batch: dict, step, steps: bool = False) -> dict:
        """A model with dropout gets each row's step and global example index in its batch
        (:mod:`.adaptation.dropout`: masks from (step, example, layer), equal on every layout)."""
        if not getattr(self.layout.source, "dropout", False):
            return batch
        if steps:  # [K, batch, ...]: step + k for the k-th
            return jax.vmap(dropout.with_indices)(batch, step + jax.numpy.arange(
                jax.tree.leaves(batch)[0].shape[0], dtype=jax.numpy.int32))
        return dropout.with_indices(batch, step)

    # -- states --------------------------------------------------------------------------------
    def init(self, params: nnx.State | Callable[[nnx.State], nnx.State] | None = None
             ) -> TrainState:
        """A sharded TrainState from the model's weights, canonical ``params``, or a loader of
        them at :attr:`canonical_shardings` (``model.pretrained_params``; donated, no copy)."""
        donate = callable(params)
        params = params(self.canonical_shardings) if donate else (
            self._init_params if params is None else params)
        checks.check_canonical(params, self.layout.template, self.model_name)
        return jax.jit(self._init_impl, out_shardings=self.state_shardings, donate_argnums=(
            (0,) if donate else ()))(params)

    @functools.cached_property
    def canonical_shardings(self) -> nnx.State:
        """Where each canonical parameter lives, as a loader for :meth:`init` places it."""
        return canonical.param_shardings(self.layout, self.abstract_state().params)

    def _init_impl(self, params: nnx.State) -> TrainState:
        lay, n = self.layout, self.plan.data
        internal = lay.to_internal(params, None)
        residual = (jax.tree.map(lambda x: jax.numpy.zeros((n, *x.shape), x.dtype), internal)
                    if lay.stepper.residual else None)
        opt_state = self.optimizer.init(internal)
        if lay.stepper.local_optimizer:  # every replica starts from the same optimizer state
            opt_state = jax.tree.map(lambda x: jax.numpy.broadcast_to(x, (n, *np.shape(x))),
                                     opt_state)
        prev = internal if lay.stepper.versions == 2 else None  # 2BW: W(-1) = W(0)
        return TrainState(jax.numpy.zeros((), jax.numpy.int32), internal, opt_state, residual,
                          prev)

    def abstract_state(self) -> TrainState:
        """The TrainState as shapes, dtypes and shardings, allocating nothing (also for a model
        built with ``nnx.eval_shape``): the input of :meth:`lower_step` for measurements."""
        shapes = jax.eval_shape(self._init_impl, self.layout.template)
        return jax.tree.map(
            lambda s, sub: jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub),
            self.state_shardings, shapes, is_leaf=lambda x: isinstance(x, NamedSharding))

    def params(self, state: TrainState) -> nnx.State:
        """The parameters in the canonical layout of ``nnx.state(model, nnx.Param)``."""
        return self._to_canonical(state.params)

    def to_canonical_state(self, state: TrainState) -> TrainState:
        """``state`` with params and optimizer state in the canonical layout (for checkpoints;
        see :mod:`fiddlejax.canonical`)."""
        return self.state_converters()[0].copied(state)

    def from_canonical_state(self, canonical_state: TrainState) -> TrainState:
        """The inverse of :meth:`to_canonical_state`, placed with this trainer's shardings."""
        return self.state_converters()[1].copied(canonical_state)

    def state_converters(self) -> tuple[Callable, Callable]:
        """The jitted ``(to_canonical, to_internal)`` state conversions (lowerable)."""
        if not hasattr(self, "_converters"):  # built on first use: most trainers never need them
            self._converters = canonical.converters(self.layout, self.optimizer)
        return self._converters

    # -- steps ---------------------------------------------------------------------------------
    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One optimizer step on a global batch; returns the new state and metrics.

        ``state`` is consumed (donated): continue from the returned one. A step whose loss or
        gradient norm is not finite keeps the old parameters (``metrics["nonfinite_skipped"]``
        is 1). Ids of a NumPy batch are checked on the host; a batch already on the device is
        skipped so too when it holds ids outside the vocabulary (``metrics["bad_ids"]``, their
        count, computed in-graph)."""
        checks.check_not_donated(state)
        if self.plan.check_inputs:  # opt-in: ids in range before the step, a finite loss after
            return _checked_step(self, state, batch)
        on_device = self._value_ranges and isinstance(batch, dict) and any(
            isinstance(x, jax.Array) for x in batch.values())
        batch = self._prepare(state, batch)
        step = self._gated_step if on_device else self._compiled.get(  # host batches: checked
            _signature(batch), self._step)                              # on the host
        return step(state, batch)

    def precompile(self, state: TrainState, batch: dict) -> None:
        """Compile :meth:`step` for host batches shaped like ``batch`` (``state`` may be
        abstract) apart from running it: the job frees the compiler's memory in between."""
        batch = self._prepare(state, batch)
        self._compiled[_signature(batch)] = self._step.lower(state, batch).compile()

    def steps(self, state: TrainState, batches_: dict) -> tuple[TrainState, dict]:
        """``K`` optimizer steps in one jitted program; ``batches_`` leaves are
        ``[K, batch, ...]``. Metrics come back per step (``metrics["loss"]`` has shape ``[K]``).
        With ``schedule="2bw"`` the pipeline runs the K steps without a flush between them."""
        checks.check_not_donated(state, "trainer.steps")
        batches_ = batches.place_steps(batches_, self.batch_sharding, self.check_batch,
                                       self._value_ranges)
        if self._remat is None:
            _choose_remat(self, state, jax.tree.map(lambda x: x[0], batches_))
        return self._steps(state, batches_)

    def loss_and_grads(self, state: TrainState, batch: dict) -> tuple[jax.Array, nnx.State]:
        """Mean loss and its gradients, in the canonical layout of the model's parameters."""
        return self._loss_and_grads(state, self._prepare(state, batch))

    def loss(self, state: TrainState, batch: dict) -> jax.Array:
        """Mean loss of ``batch`` without updating anything (for validation)."""
        return self._loss(state, self._prepare(state, batch))

    # -- batches and remat ---------------------------------------------------------------------
    def shard_batch(self, batch: dict) -> dict:
        """Check a global batch and place it sharded over ``data`` (this process's rows when
        several processes run: see :mod:`fiddlejax.batches`)."""
        return batches.place(batch, self.batch_sharding, self.check_batch, self._value_ranges)

    def check_batch(self, batch: dict) -> None:
        """Raise a clear error for a batch this trainer cannot take, before compiling."""
        batches.check(batch, self.plan, self._batch_spec, self.model_name)

    def _prepare(self, state: TrainState, batch: dict) -> dict:
        batch = self.shard_batch(batch)
        if not self._names_checked:
            self._names_checked = True
            remat.check_names(self.remat_policy, self.layout.source, self.layout.template,
                              batch, self.model_name)
        if self._remat is None:
            _choose_remat(self, state, batch)
        return batch

    # -- measurement ---------------------------------------------------------------------------
    def memory(self, batch_size: int | None = None, batch: dict | None = None) -> dict:
        """Per-device bytes of one compiled training step, from XLA's ``memory_analysis``,
        without allocating the model or the batch. Give ``batch_size`` (for a model with
        ``batch_spec``) or ``batch`` (arrays or ``jax.ShapeDtypeStruct``s). Returns
        ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs written over donated
        arguments), ``temp_bytes`` and ``peak_bytes`` = argument + output + temp - alias."""
        if batch is None:
            if batch_size is None or self._batch_spec is None:
                raise ValueError("memory() needs batch_size= (for a model with batch_spec) or "
                                 "batch= (a dict of arrays or jax.ShapeDtypeStructs)")
            batch = self._batch_spec(batch_size)
        batch = {k: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self.batch_sharding)
                 for k, x in batch.items()}
        return _compiled_memory(self.compiled_step(self.abstract_state(), batch))

    def compiled_step(self, state: TrainState, batch: dict):
        """The compiled step, for ``memory_analysis()``, ``cost_analysis()`` and ``as_text()``."""
        return self.lower_step(state, batch).compile()

    def lower_step(self, state: TrainState, batch: dict):
        """The lowered step; ``state`` may be abstract (``jax.eval_shape(trainer.init)``)."""
        return self._step.lower(state, self._prepare(state, batch))

    def lower_steps(self, state: TrainState, batches_: dict):
        """The lowered ``steps`` (K optimizer steps on batches ``[K, batch, ...]`` in one
        program; 2BW's unflushed pipeline); ``state`` may be abstract."""
        if self._remat is None:
            self._prepare(state, jax.tree.map(lambda x: x[0], batches_))
        return self._steps.lower(state, batches_)

    def lower_loss_and_grads(self, state: TrainState, batch: dict, *, canonical: bool = True):
        """The lowered ``loss_and_grads``; ``state`` may be abstract. ``canonical=False`` keeps
        the gradients in the trainer's own layout, as a step consumes them (measurements of
        the step's memory without the conversion to the model's tree)."""
        batch = self._prepare(state, batch)
        if canonical:
            return self._loss_and_grads.lower(state, batch)
        return jax.jit(self._program().loss_and_grads).lower(state.params, batch)

    def step_function(self, donate: bool = False) -> Callable:
        """``step`` as a jitted function, without :meth:`step`'s checks; takes a batch placed by
        :meth:`shard_batch`. By default it does not donate its state (timing loops that run one
        state many times); ``donate=True`` updates it in place, as :meth:`step` does."""
        if self._remat is None:
            raise ValueError("remat='auto' picks its policy on the first step: call step once")
        return jax.jit(self._step_impl, in_shardings=(self.state_shardings, None),
                       out_shardings=(self.state_shardings, None),
                       donate_argnums=0 if donate else ())

    def stage_flops(self, state: TrainState, batch: dict) -> list[dict]:
        """Compiled FLOPs of each pipeline stage's share of one step (data = tensor = 1)."""
        if self.pipeline is None:
            raise ValueError("stage_flops needs a pipeline schedule")
        if self._remat is None:
            _choose_remat(self, state, self.shard_batch(batch))
        return self.pipeline.stage_flops(state.params, batch, self._remat)


def _canonical_grads(lay, loss_grads):
    loss, grads, _ = loss_grads  # the reported metrics are the step's
    return loss, lay.to_canonical(grads)


def parallelize(model: nnx.Module, optimizer: optax.GradientTransformation, plan: Plan,
                loss: staged.Loss | None = None, layers: str | None = None,
                block_output: Callable[[Any], jax.Array] | None = None) -> Trainer:
    """Lay ``model`` out by ``plan`` and return its :class:`Trainer`.

    ``loss(outputs, batch)`` replaces the model's own ``loss``: a scalar mean, or a pair
    ``(sum, weight)`` for a weighted mean (see :mod:`fiddlejax.staged`). ``layers`` names the
    attribute holding the repeated blocks of a model that does not declare the staged protocol
    (a dotted path such as ``"decoder.blocks"``); ``block_output(out)`` picks the activation
    from what each of those blocks returns (default: the first array; training drops the rest,
    e.g. Mamba2's states: ``block_output=lambda out: out[0]``).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a fiddlejax.Plan, got {type(plan).__name__}")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be a Flax NNX module (nnx.Module), got "
                        f"{type(model).__name__}")
    if not (callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, e.g. "
                        f"optax.adamw(1e-3), got {optimizer!r}")
    if lora.has_adapters(nnx.state(model, nnx.Param)):  # LoRA: only the adapters train
        optimizer = lora.optimizer(optimizer)
    return Trainer(model, optimizer, plan, loss, layers, block_output)


def _checked_step(trainer: Trainer, state: TrainState, batch: dict) -> tuple:
    """``plan.check_inputs``' step: ids in range before it, a finite loss after."""
    n = int(state.step) + 1
    checks.check_values(batch, trainer._value_ranges, n)
    state, metrics = trainer._step(state, trainer._prepare(state, batch))
    checks.check_finite(metrics, n, state)
    return state, metrics


def _choose_remat(trainer: Trainer, state: TrainState, batch: dict) -> None:
    """``remat="auto"``: the policy with the fewest FLOPs whose compiled step fits the budget."""
    def lower(policy):
        trainer._remat = remat.layer_remat(policy, trainer.layout.zero)
        return jax.jit(trainer._step_impl).lower(state, batch)

    policy = remat.choose(lower, trainer.plan.memory_budget)
    trainer._remat = remat.layer_remat(policy, trainer.layout.zero)
    trainer.remat_policy = policy


def _signature(batch: dict) -> tuple:
    """A placed batch's structure, shapes and dtypes: which executable runs it."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, tuple((np.shape(x), np.dtype(x.dtype)) for x in leaves)


def _compiled_memory(compiled) -> dict:
    """Per-device bytes of a compiled step, read from XLA (exact on every backend):
    ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs written over donated
    arguments), ``temp_bytes`` and ``peak_bytes`` = argument + output + temp - alias."""
    m = compiled.memory_analysis()
    out = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
           "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes}
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                         - out["alias_bytes"])
    return out
