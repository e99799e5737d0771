"""``parallelize``: a Flax model, an optax optimizer and a Plan become a Trainer of jitted steps.

One step is one jitted program: ``jax.shard_map`` manual over ``data`` (and ``pipe`` when
pipelining) computes each replica's loss and gradients, with ``tensor`` left to the GSPMD
partitioner for Megatron-style tensor parallelism; gradients are reduced over ``data`` with the
plan's all-reduce algorithm; the optimizer update runs on the sharded parameters (optimizer
state sharded over ``data`` too with ZeRO-1).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax import checks, compute, layout, sharding, staged, stepping
from fiddlejax.plan import Plan
from fiddlejax.split import split_model


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step updates: the step counter, internal-layout parameters, optimizer state.

    ``residual`` is the top-k error-feedback memory (``Plan(grad_allreduce="topk")``): per data
    replica, what its gradient exchange has not sent yet, leaves ``[data, *param.shape]`` sharded
    over ``data``. ``None`` (no leaves) for every other plan.

    ``prev_params`` is PipeDream-2BW's older weight version W(t-1) (``Plan(schedule="2bw")``),
    on which the next step's gradients are computed; ``None`` for every other plan.
    """

    step: jax.Array
    params: nnx.State
    opt_state: Any
    residual: Any = None
    prev_params: Any = None


class Trainer:
    """Pure, jitted functions for one model, optimizer and plan. Build with :func:`parallelize`."""

    def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation, plan: Plan,
                 loss: staged.Loss | None = None, layers: str | None = None):
        self.plan = plan
        self.mesh = plan.mesh
        self.optimizer = optimizer
        self.model_name = type(model).__name__
        self.staged, canonical = split_model(model, loss, layers=layers)
        # Vocabulary padded for `tensor` is sliced off the outputs before any loss sees it.
        self.staged = dataclasses.replace(
            self.staged, vocab_pads=layout.vocab_pads(canonical, self._vocab_multiple))
        self._model_staged = self.staged  # as the model computes (no FSDP gathers, no casts)
        self._names_checked = False
        self._batch_spec = getattr(model, "batch_spec", None)
        self._value_ranges = checks.value_ranges(model) if plan.check_inputs else {}
        self._canonical_template = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), canonical)
        self._init_params = canonical
        if plan.remat == "auto" and not plan.memory_budget:
            raise ValueError("remat='auto' needs Plan(memory_budget=<bytes per device>)")
        self.remat_policy = None if plan.remat == "auto" else plan.remat
        if plan.schedule is not None:
            from fiddlejax.pipeline import runtime

            example = self._batch_spec(1) if self._batch_spec is not None else None
            self._pipeline = runtime.build(self.staged, plan, self._canonical_template, example)
        else:
            self._pipeline = None
        internal = jax.eval_shape(self._to_internal, canonical)
        spec_tree = (self._pipeline.param_specs(internal) if self._pipeline
                     else layout.specs(internal, plan.axis_rules))
        layout.check_divisible(internal, spec_tree, self.mesh)
        sharding.tensor_unused(spec_tree, plan.tensor, self.model_name)
        spec_tree = self._view_params(internal, spec_tree)
        # remat="auto" is resolved on the first batch, when the step's shapes are known.
        self._remat = None if plan.remat == "auto" else self._layer_remat(plan.remat)
        self.param_shardings = layout.shardings(self.mesh, spec_tree)
        # ZeRO-2: the reduced gradients split over `data` as the optimizer state is
        self.grad_shardings = self.param_shardings
        if plan.zero == 2 and plan.data > 1:
            self.grad_shardings = jax.tree.map(
                lambda sp, v: NamedSharding(self.mesh, _add_data_axis(sp, v.shape, plan.data)),
                spec_tree, internal, is_leaf=lambda x: isinstance(x, P))
        opt_abstract = jax.eval_shape(optimizer.init, internal)
        self.opt_shardings = _opt_shardings(optimizer, opt_abstract, spec_tree, plan)
        # How a step exchanges gradients and steps (dense, top-k, 2BW): chosen once.
        self.stepper = stepping.pick(plan)
        # topk_on="updates": one optimizer state per data replica (leading `data` dimension).
        if self.stepper.local_optimizer:
            self.opt_shardings = jax.tree.map(
                lambda s: NamedSharding(self.mesh, P("data", *s.spec)), self.opt_shardings)
        # The top-k residual is per data replica: a leading `data` dimension on each leaf.
        self.residual_shardings = (jax.tree.map(
            lambda s: NamedSharding(self.mesh, P("data", *s.spec)), self.param_shardings)
            if self.stepper.residual else None)
        if self.stepper.versions == 2 and not _leafwise(optimizer):
            raise ValueError(
                "schedule='2bw' applies the optimizer inside the pipeline, one stage at a time "
                "(as PipeDream-2BW does), so each parameter's update may depend only on its own "
                "gradient; this optimizer mixes parameters (optax.clip_by_global_norm?). Use "
                "an elementwise one, e.g. optax.adamw without a global-norm clip "
                "(fiddlejax train: optimizer.clip=0), or another schedule")
        self.state_shardings = TrainState(
            NamedSharding(self.mesh, P()), self.param_shardings, self.opt_shardings,
            self.residual_shardings, self.param_shardings if self.stepper.versions == 2 else None)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self._step = jax.jit(self._step_impl, in_shardings=(self.state_shardings, None),
                             out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._steps = jax.jit(self._steps_impl, in_shardings=(self.state_shardings, None),
                              out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._loss_and_grads = jax.jit(self._loss_and_grads_impl)
        self._loss = jax.jit(self._loss_impl)
        self._to_canonical_jit = jax.jit(self._to_canonical)

    # -- layouts -----------------------------------------------------------------------------
    @property
    def _vocab_multiple(self) -> int:
        """Vocabularies are padded to a multiple of the devices that split them: ``tensor``,
        and ``pipe`` too in a pipeline (its embedding and head are not replicated per stage)."""
        return self.plan.tensor * (self.plan.pipe if self.plan.schedule is not None else 1)

    def _view_params(self, internal: nnx.State, spec_tree: nnx.State) -> nnx.State:
        """Set up how the computation sees the parameters (``fiddlejax.compute``): FSDP
        dimensions under zero=3 and the compute dtype; returns the parameters' specs."""
        plan, s = self.plan, self.staged
        lead = 3 if self._pipeline else 1  # stack: [pipe, virtual, layers, ...] or [layers, ...]

        def in_stack(path) -> bool:
            return getattr(path[0], "key", None) == s.stack

        self._dims = None
        self._gather_specs = spec_tree  # the gathered leaves: split over pipe and tensor
        if plan.zero == 3 and plan.data > 1:
            self._dims = compute.fsdp_dims(internal, spec_tree, plan.data,
                                           lambda path: lead if in_stack(path) else 0)
            spec_tree = compute.with_data_axis(spec_tree, self._dims)
        dtype = None if plan.compute_dtype == "float32" else jnp.dtype(plan.compute_dtype)
        # fsdp_gather="step": the whole tree is gathered (and cast) once per step
        # (_gather_once); the layers then see it as it is.
        self._gather_dtype = dtype
        self._gather_step = self._dims is not None and plan.fsdp_gather == "step"
        per_use = self._dims if not self._gather_step else None
        self._view = (compute.ParamView(dtype)
                      if per_use is not None or dtype is not None else None)
        # Gradients reduce-scattered whole after the microbatches: FSDP gathered once, or
        # ZeRO-2 (onto the optimizer state's shards).
        self._scatter_dims = self._dims if self._gather_step else None
        if plan.zero == 2 and plan.data > 1:
            self._scatter_dims = jax.tree.map(
                lambda v, sp: _data_dim(sp.get_value(), v.shape, plan.data), internal,
                spec_tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
        if self._pipeline is not None:
            self._pipeline.data_dims = self._dims
        if self._view is None:
            return spec_tree
        dims = per_use if per_use is not None else jax.tree.map(lambda _: -1, internal)
        self._layer_dims = jax.tree.map(lambda d: d - lead if d >= 0 else -1, dims[s.stack])
        self._layer_specs = jax.tree.map(  # one layer's: the stacking dimensions dropped
            lambda _, v: P(*tuple(v.get_value() if isinstance(v, nnx.Variable) else v)[lead:]),
            self._layer_dims, self._gather_specs[s.stack])
        outer = jax.tree_util.tree_map_with_path(
            lambda path, d: -1 if in_stack(path) else d, dims)
        self.staged = compute.ViewedModel(
            s, lambda p: self._view.tree(p, outer, self._gather_specs))
        if self._pipeline is not None:
            self._pipeline.staged = self.staged
        return spec_tree

    def _layer_remat(self, remat) -> Callable[[Callable], Callable]:
        """Remat policy ``remat`` for one layer, seeing its parameters through the view."""
        if self._view is None:
            return _resolve_remat(remat)
        from fiddlejax.memory import policies

        jax_policy = policies.resolve(None if remat == "none" else remat).jax_policy
        return lambda f: self._view.layer(f, self._layer_dims, jax_policy, self._layer_specs)

    def _to_internal(self, canonical: nnx.State, shardings: Any = None) -> nnx.State:
        """``shardings``: the internal tree's (default: the parameters'; an optimizer-state
        tree passes its own, ZeRO's ``data`` split included)."""
        # An adapted model's blocks are stacked first (fiddlejax.adapt), then vocabularies padded.
        params = layout.pad_vocab(self.staged.to_staged(canonical), self._vocab_multiple)
        if self._pipeline is None:
            return params
        # the shardings exist once __init__ has them (its own shape-only call goes without)
        if shardings is None:
            shardings = getattr(self, "param_shardings", None)
        return self._pipeline.to_internal(params, shardings)

    def _to_canonical(self, internal: nnx.State, shardings: Any = None) -> nnx.State:
        params = (self._pipeline.to_canonical(internal, shardings or self.param_shardings)
                  if self._pipeline else internal)
        return layout.unpad_vocab(self.staged.to_model(params), self._canonical_template)

    # -- the computation ---------------------------------------------------------------------
    def _microbatch_loss(self, params: nnx.State, batch: dict) -> tuple[jax.Array, jax.Array]:
        """(loss sum, weight) of one microbatch (see ``staged.StagedModel.weighted_loss``)."""
        s = self.staged
        layer = self._remat(s.layer)
        x = s.prologue(params, batch)
        x = jax.lax.scan(lambda h, lp: (layer(lp, h), None), x, params[s.stack])[0]
        return s.weighted_loss(params, x, batch)

    def _local_loss_and_grads(self, params: nnx.State, batch: dict):
        """(loss sum, weight, gradients of the sum) of one data-parallel replica's batch, summed
        over its microbatches (inside shard_map); :meth:`_replica_mean` normalizes them."""
        m = self.plan.microbatches
        vg = jax.value_and_grad(self._microbatch_loss, has_aux=True)

        def one(mb):
            (total, weight), grads = vg(params, mb)
            return total, weight, grads

        if m == 1:
            total, weight, grads = one(batch)
            return total, weight, jax.tree.map(
                lambda g: g.astype(compute.grad_dtype(g.dtype)), grads)
        mbs = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, one(mb)), None

        zero = match_varying(jnp.zeros((), jnp.float32), jax.tree.leaves(params)[0])
        # float32 sums even for weights gathered once in bf16 (fsdp_gather="step")
        zeros = (zero, zero, jax.tree.map(
            lambda x: jnp.zeros_like(x, compute.grad_dtype(x.dtype)), params))
        return jax.lax.scan(body, zeros, mbs)[0]

    def _replica_mean(self, total, weight, grads):
        """A replica's loss sum and gradients scaled so that their mean over ``data`` is the
        step's weighted mean: ``x * data / (sum of all replicas' weights)``. For a mean loss
        (weight 1 per microbatch) that is ``x / microbatches``, as for equal-sized shards."""
        n = self.plan.data
        all_weight = jax.lax.psum(weight, "data") if n > 1 else weight
        scale = n / all_weight
        return total * scale, jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)

    def _reduce_sums(self, total, weight, grads):
        """The step's loss and gradients from one replica's sums (the pipeline's ``reduce``)."""
        return self._reduce(*self._replica_mean(total, weight, grads))

    def _reduce(self, loss, grads):
        n = self.plan.data
        if n == 1:  # no data parallelism: nothing to reduce
            return loss, grads
        loss = jax.lax.pmean(loss, "data")
        if self._scatter_dims is not None:  # whole sums (ZeRO-2, FSDP gathered once)
            grads = compute.scatter_whole(grads, self._scatter_dims, self._gather_specs)
        sharded = self._dims if self._dims is not None else self._scatter_dims
        if sharded is not None:  # sharded leaves arrive reduce-scattered (summed): divide
            grads = jax.tree.map(lambda d, g: jax.tree.map(
                lambda a: a / n if d >= 0 else jax.lax.pmean(a, "data"), g), sharded, grads)
        elif self.plan.grad_allreduce in ("xla", "topk"):  # topk: the exact mean (no residual)
            grads = jax.lax.pmean(grads, "data")
        else:
            from fiddlejax import collectives

            grads = collectives.allreduce_tree(grads, "data", algorithm=self.plan.grad_allreduce,
                                               bucket_bytes=self.plan.bucket_bytes)
            grads = jax.tree.map(lambda g: g / n, grads)
        return loss, grads

    def _sharded_loss_and_grads(self, params: nnx.State, batch: dict, residual: Any = None):
        """Replica-mean loss and gradients; with a top-k ``residual`` also the new residual.

        Without a residual the gradients are the exact mean (``pmean``) even for a top-k plan:
        that is what ``loss_and_grads`` reports; only ``step`` exchanges sparsified gradients.
        """
        if residual is not None:
            return self.stepper.loss_and_grads(self, params, batch, residual)
        with _encodings(self.plan.encodings):
            if self._pipeline is not None:
                return self._pipeline.loss_and_grads(params, batch, self._reduce_sums,
                                                     self._remat, self._gather_once,
                                                     self._zero2_specs(params))

            def per_replica(p, b):
                if self.plan.data > 1:
                    # Mark the replicated params as varying over `data` so autodiff returns
                    # each replica's own gradients (instead of an implicit psum) and the
                    # plan's all-reduce algorithm does the reduction. FSDP shards vary already.
                    p = self._vary_replicated(p)
                return self._reduce_sums(*self._local_loss_and_grads(self._gather_once(p), b))

            if self.plan.data == 1:  # nothing to make manual; GSPMD handles `tensor`
                return per_replica(params, batch)
            specs = P() if self._dims is None else compute.only_data(self._dims, params)
            grad_specs = self._zero2_specs(params) or specs
            return jax.shard_map(
                per_replica, mesh=self.mesh, in_specs=(specs, P("data")),
                out_specs=(P(), grad_specs), axis_names={"data"},
            )(params, batch)

    def _zero2_specs(self, params: nnx.State) -> Any:
        """ZeRO-2: the reduced gradients' specs over ``data`` (the optimizer state's
        shards); ``None`` otherwise (gradients sharded as the parameters)."""
        if self.plan.zero != 2 or self._scatter_dims is None:
            return None
        return compute.only_data(self._scatter_dims, params)

    def _gather_once(self, params: nnx.State) -> nnx.State:
        """A replica's parameters as its step uses them: ``fsdp_gather="step"`` gathers the
        FSDP shards (in the compute dtype) once, before the first microbatch; else as given
        (the layers gather per use)."""
        if not self._gather_step:
            return params
        return compute.gather_whole(params, self._dims, self._gather_specs, self._gather_dtype)

    def _vary_replicated(self, params: nnx.State) -> nnx.State:
        if self._dims is None:
            return jax.lax.pcast(params, ("data",), to="varying")
        return jax.tree.map(lambda d, v: v if d >= 0 else jax.lax.pcast(v, ("data",),
                                                                         to="varying"),
                            self._dims, params)

    def _loss_impl(self, state: TrainState, batch: dict) -> jax.Array:
        if self._pipeline is not None:  # the pipeline runs forward and backward together
            return self._sharded_loss_and_grads(state.params, batch)[0]
        with _encodings(self.plan.encodings):
            if self._dims is None:
                total, weight = self._microbatch_loss(state.params, batch)
                return total / weight

            def per_replica(p, b):  # FSDP: layers gather their weights over `data`
                total, weight = self._microbatch_loss(self._gather_once(p), b)
                return jax.lax.psum(total, "data") / jax.lax.psum(weight, "data")

            specs = compute.only_data(self._dims, state.params)
            return jax.shard_map(per_replica, mesh=self.mesh, in_specs=(specs, P("data")),
                                 out_specs=P(), axis_names={"data"})(state.params, batch)

    def _loss_and_grads_impl(self, state: TrainState, batch: dict):
        loss, grads = self._sharded_loss_and_grads(state.params, batch)
        return loss, self._to_canonical(grads)

    def _steps_impl(self, state: TrainState, batches: dict):
        """K optimizer steps on batches ``[K, batch, ...]`` in one program (metrics ``[K]``)."""
        return self.stepper.steps(self, state, batches)

    def _step_impl(self, state: TrainState, batch: dict):
        return self.stepper.step(self, state, batch)

    def _encodings(self):
        return _encodings(self.plan.encodings)

    # -- public API --------------------------------------------------------------------------
    def init(self, params: nnx.State | None = None) -> TrainState:
        """A sharded TrainState from the model's weights (or from canonical ``params``)."""
        canonical = self._init_params if params is None else params
        self._check_canonical(canonical)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(canonical)):
            raise ValueError(
                f"{self.model_name} is abstract (built with nnx.eval_shape): it has no weights "
                "to initialise. Measure it with trainer.memory(batch_size) or "
                "trainer.lower_step(trainer.abstract_state(), batch), or pass real params")
        return jax.jit(self._init_impl, out_shardings=self.state_shardings)(canonical)

    def _init_impl(self, canonical: nnx.State) -> TrainState:
        internal = self._to_internal(canonical)
        residual = (jax.tree.map(lambda x: jnp.zeros((self.plan.data, *x.shape), x.dtype),
                                 internal) if self.stepper.residual else None)
        opt_state = self.optimizer.init(internal)
        if self.stepper.local_optimizer:  # every replica starts from the same optimizer state
            opt_state = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (self.plan.data, *jnp.shape(x))), opt_state)
        prev = internal if self.stepper.versions == 2 else None  # 2BW's first step: W(-1) = W(0)
        return TrainState(jnp.zeros((), jnp.int32), internal, opt_state, residual, prev)

    def abstract_state(self) -> TrainState:
        """The TrainState as shapes, dtypes and shardings, allocating nothing (also for a model
        built with ``nnx.eval_shape``): the input of :meth:`lower_step` for measurements."""
        shapes = jax.eval_shape(self._init_impl, self._canonical_template)
        def place(s, sub):  # sub: an array's shape, possibly inside an nnx.Variable
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                sub)

        return jax.tree.map(place, self.state_shardings, shapes,
                            is_leaf=lambda x: isinstance(x, NamedSharding))

    def memory(self, batch_size: int | None = None, batch: dict | None = None) -> dict:
        """Per-device bytes of one compiled training step, from XLA's ``memory_analysis``,
        without allocating the model or the batch.

        Give ``batch_size`` (the global batch, for a model with ``batch_spec``) or ``batch``
        (arrays or ``jax.ShapeDtypeStruct``s). Returns ``argument_bytes`` (state and batch),
        ``output_bytes``, ``alias_bytes`` (outputs written over donated arguments),
        ``temp_bytes`` and ``peak_bytes`` = argument + output + temp - alias.
        """
        if batch is None:
            if batch_size is None or self._batch_spec is None:
                raise ValueError("memory() needs batch_size= (for a model with batch_spec) or "
                                 "batch= (a dict of arrays or jax.ShapeDtypeStructs)")
            batch = self._batch_spec(batch_size)
        batch = {k: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self.batch_sharding)
                 for k, x in batch.items()}
        m = self.lower_step(self.abstract_state(), batch).compile().memory_analysis()
        out = {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
               "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes}
        out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                             - out["alias_bytes"])
        return out

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One optimizer step on a global batch; returns the new state and metrics."""
        if self.plan.check_inputs:  # opt-in: ids in range before the step, a finite loss after
            n = int(state.step) + 1
            checks.check_values(batch, self._value_ranges, n)
            state, metrics = self._step(state, self._prepare(state, batch))
            checks.check_finite(metrics, n)
            return state, metrics
        return self._step(state, self._prepare(state, batch))

    def steps(self, state: TrainState, batches: dict) -> tuple[TrainState, dict]:
        """``K`` optimizer steps in one jitted program; ``batches`` leaves are ``[K, batch, ...]``.

        Metrics come back per step (``metrics["loss"]`` has shape ``[K]``). With
        ``schedule="2bw"`` the pipeline runs the K steps without a flush between them.
        """
        if not isinstance(batches, dict) or not batches:
            raise TypeError("batches must be a dict of arrays shaped [steps, batch, ...]")
        ks = {np.shape(v)[0] if np.ndim(v) > 1 else None for v in batches.values()}
        if len(ks) != 1 or None in ks:
            raise ValueError("batches must share a leading steps dimension: [steps, batch, ...]")
        self.check_batch({k: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype)
                          for k, v in batches.items()})
        sharding = NamedSharding(self.mesh, P(None, "data"))
        batches = jax.tree.map(lambda x: jax.device_put(x, sharding), batches)
        if self._remat is None:
            self._choose_remat(state, jax.tree.map(lambda x: x[0], batches))
        return self._steps(state, batches)

    def loss_and_grads(self, state: TrainState, batch: dict) -> tuple[jax.Array, nnx.State]:
        """Mean loss and its gradients, in the canonical layout of the model's parameters."""
        return self._loss_and_grads(state, self._prepare(state, batch))

    def loss(self, state: TrainState, batch: dict) -> jax.Array:
        """Mean loss of ``batch`` without updating anything (for validation)."""
        return self._loss(state, self._prepare(state, batch))

    def params(self, state: TrainState) -> nnx.State:
        """The parameters in the canonical layout of ``nnx.state(model, nnx.Param)``."""
        return self._to_canonical_jit(state.params)

    def to_canonical_state(self, state: TrainState) -> TrainState:
        """``state`` with params and optimizer state in the canonical layout (for checkpoints).

        optax states mirror the params, so every param-shaped subtree takes the same exact
        conversion as the params (reshapes and vocabulary unpadding); counters pass through.
        A top-k residual converts per replica and keeps its leading ``data`` dimension (resuming
        is exact; restoring it onto a different ``data`` size is refused by its shape).
        """
        return self._state_converters()[0](state)

    def from_canonical_state(self, canonical: TrainState) -> TrainState:
        """The inverse of :meth:`to_canonical_state`, placed with this trainer's shardings."""
        return self._state_converters()[1](canonical)

    def _state_converters(self):
        if not hasattr(self, "_converters"):  # built on first use: most trainers never need them
            def convert(fn, s: TrainState) -> TrainState:
                def whole(tree, shardings=None):  # fn converts whole parameter trees
                    if not any(_masked(x) for x in jax.tree.leaves(tree, is_leaf=_masked)):
                        return fn(tree, shardings)  # (an adapted model's trees differ in structure)
                    # Parameters a part of the state leaves out (optax.MaskedNode: Muon's AdamW
                    # half, optax.masked) ride through as the parameters and are put back after.
                    filled = jax.tree.map(lambda x, p: p if _masked(x) else x, tree, s.params,
                                          is_leaf=_masked)
                    return jax.tree.map(lambda x, y: x if _masked(x) else y, tree,
                                        fn(filled, shardings), is_leaf=_masked)

                def opt_convert(o):  # each parameter-shaped tree with its own shardings
                    own = iter(_param_trees(self.optimizer, self.opt_shardings))
                    return optax.tree_map_params(self.optimizer, lambda t: whole(t, next(own)),
                                                 o, is_leaf=lambda _: True)

                # topk_on="updates": per-replica optimizer states convert replica by replica
                per_replica = self.stepper.local_optimizer
                opt = (jax.vmap(opt_convert) if per_replica else opt_convert)(s.opt_state)
                residual = None if s.residual is None else jax.vmap(fn)(s.residual)
                prev = None if s.prev_params is None else fn(s.prev_params)
                return TrainState(s.step, fn(s.params), opt, residual, prev)

            self._converters = (
                jax.jit(partial(convert, self._to_canonical)),
                jax.jit(partial(convert, self._to_internal), out_shardings=self.state_shardings))
        return self._converters

    def _choose_remat(self, state: TrainState, batch: dict) -> None:
        """``remat="auto"``: the policy with the fewest FLOPs whose compiled step fits."""
        from fiddlejax.memory import choose_policy

        def make_step(policy):
            self._remat = self._layer_remat(policy)
            return jax.jit(self._step_impl).lower(state, batch)

        policy = choose_policy(make_step, int(self.plan.memory_budget))
        self._remat, self.remat_policy = self._layer_remat(policy), policy

    def _prepare(self, state: TrainState, batch: dict) -> dict:
        batch = self.shard_batch(batch)
        if not self._names_checked:
            self._names_checked = True
            self._check_remat_names(batch)
        if self._remat is None:
            self._choose_remat(state, batch)
        return batch

    def _check_remat_names(self, batch: dict) -> None:
        """A name-based remat policy on a layer that tags none of its names would silently
        equal remat='full': refuse it (traced on shapes, nothing runs)."""
        if self.remat_policy in (None, "none", "auto"):
            return
        from fiddlejax.memory import policies

        s = self._model_staged
        params = s.to_staged(self._canonical_template)
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                             params[s.stack])
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), batch)
        x = jax.eval_shape(s.prologue, params, rows)
        checks.check_remat_names(policies.resolve(self.remat_policy), s.layer, layer, x,
                                 self.model_name)

    def shard_batch(self, batch: dict) -> dict:
        """Check a global batch and place it sharded over ``data``.

        With several processes each passes only its own rows, the slice of the global batch its
        devices own on ``data`` (``fiddlejax.distributed.data_shard(mesh)`` says which).
        """
        if isinstance(batch, dict) and batch and all(
                isinstance(x, jax.ShapeDtypeStruct) for x in batch.values()):  # for lowering
            self.check_batch(batch)
            return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.batch_sharding)
                    for k, x in batch.items()}
        if jax.process_count() == 1 or not isinstance(batch, dict):
            self.check_batch(batch)
            return jax.tree.map(lambda x: jax.device_put(x, self.batch_sharding), batch)
        from fiddlejax import distributed

        count = distributed.data_shard(self.mesh)[1]
        self.check_batch({k: jax.ShapeDtypeStruct((np.shape(x)[0] * count, *np.shape(x)[1:]),
                                                  x.dtype) for k, x in batch.items()})
        return {k: jax.make_array_from_process_local_data(
                    self.batch_sharding, np.asarray(x), (np.shape(x)[0] * count, *np.shape(x)[1:]))
                for k, x in batch.items()}

    def check_batch(self, batch: dict) -> None:
        """Raise a clear error for a batch this trainer cannot take, before compiling."""
        if not isinstance(batch, dict):
            raise TypeError(f"batch must be a dict of arrays, got {type(batch).__name__}")
        if self._batch_spec is not None:  # 1-D tokens must not pass as a batch of scalars
            checks.check_rank(batch, self._batch_spec(1), self.model_name)
        sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
        bs = set(sizes.values())
        if len(bs) != 1 or None in bs:
            raise ValueError(f"batch arrays must share a leading batch dimension; got {sizes}")
        b = bs.pop()
        per = self.plan.data * self.plan.microbatches
        if b % per:
            raise ValueError(
                f"global batch size {b} is not divisible by data={self.plan.data} x "
                f"microbatches={self.plan.microbatches} = {per}; use a multiple of {per} "
                f"such as {max(per, b - b % per)}"
            )
        if self._batch_spec is None:
            return
        want = self._batch_spec(b)
        # Extra keys are allowed: a loss passed to parallelize may read more (e.g. a mask).
        if not set(want) <= set(batch):
            raise ValueError(
                f"{self.model_name} expects batch keys {sorted(want)}, got {sorted(batch)}")
        for k, spec in want.items():
            x = batch[k]
            if tuple(np.shape(x)) != tuple(spec.shape) or np.dtype(x.dtype) != spec.dtype:
                raise ValueError(
                    f"batch[{k!r}] is {np.dtype(x.dtype).name}{list(np.shape(x))}, but "
                    f"{self.model_name} expects {np.dtype(spec.dtype).name}{list(spec.shape)}")

    def _check_canonical(self, params: nnx.State) -> None:
        want = jax.tree.map(lambda a: (a.shape, a.dtype), self._canonical_template)
        got = jax.tree.map(lambda a: (tuple(a.shape), a.dtype), params)
        if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
            raise ValueError(f"params do not match {self.model_name}'s parameter tree and shapes")

    @property
    def pipeline(self):
        """The pipeline layout and executor (``fiddlejax.pipeline.runtime.Pipeline``), or None
        without a pipeline schedule: its schedule, tables, stage FLOPs."""
        return self._pipeline

    def compiled_step(self, state: TrainState, batch: dict):
        """The compiled step, for ``memory_analysis()``, ``cost_analysis()`` and ``as_text()``."""
        return self.lower_step(state, batch).compile()

    def lower_step(self, state: TrainState, batch: dict):
        """The lowered step; ``state`` may be abstract (``jax.eval_shape(trainer.init)``)."""
        return self._step.lower(state, self._prepare(state, batch))

    def lower_steps(self, state: TrainState, batches: dict):
        """The lowered ``steps`` (K optimizer steps on batches ``[K, batch, ...]`` in one
        program; 2BW's unflushed pipeline); ``state`` may be abstract."""
        if self._remat is None:
            first = jax.tree.map(lambda x: x[0], batches)
            self._prepare(state, first)
        return self._steps.lower(state, batches)

    def lower_loss_and_grads(self, state: TrainState, batch: dict, *, canonical: bool = True):
        """The lowered ``loss_and_grads``; ``state`` may be abstract. ``canonical=False`` keeps
        the gradients in the trainer's own layout, as a step consumes them (measurements of
        the step's memory without the conversion to the model's tree)."""
        batch = self._prepare(state, batch)
        if canonical:
            return self._loss_and_grads.lower(state, batch)
        return jax.jit(self._sharded_loss_and_grads).lower(state.params, batch)

    def step_function(self) -> Callable:
        """``step`` as a jitted function that does not donate its state (for timing loops that
        run one state many times); takes a batch placed by :meth:`shard_batch`."""
        if self._remat is None:
            raise ValueError("remat='auto' picks its policy on the first step: call step once")
        return jax.jit(self._step_impl, in_shardings=(self.state_shardings, None),
                       out_shardings=(self.state_shardings, None))

    def stage_flops(self, state: TrainState, batch: dict) -> list[dict]:
        """Compiled FLOPs of each pipeline stage's share of one step (data = tensor = 1)."""
        if self._pipeline is None:
            raise ValueError("stage_flops needs a pipeline schedule")
        return self._pipeline.stage_flops(state.params, batch, self._resolved_remat(state,
                                                                                    batch))

    def _resolved_remat(self, state, batch):
        if self._remat is None:
            self._choose_remat(state, self.shard_batch(batch))
        return self._remat


def parallelize(model: nnx.Module, optimizer: optax.GradientTransformation, plan: Plan,
                loss: staged.Loss | None = None, layers: str | None = None) -> Trainer:
    """Lay ``model`` out by ``plan`` and return its :class:`Trainer`.

    ``loss(outputs, batch)`` replaces the model's own ``loss``: a scalar mean, or a pair
    ``(sum, weight)`` for a weighted mean (see :mod:`fiddlejax.staged`). ``layers`` names the
    attribute holding the repeated blocks of a model that does not declare the staged protocol
    (a dotted path such as ``"decoder.blocks"``).
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
    return Trainer(model, optimizer, plan, loss, layers)


def _leafwise(optimizer: optax.GradientTransformation) -> bool:
    """Whether a parameter's update ignores the other parameters' gradients (a quick probe)."""
    params = {"a": jnp.ones(3), "b": jnp.ones(3)}
    state = optimizer.init(params)
    small, _ = optimizer.update({"a": jnp.full(3, 0.5), "b": jnp.full(3, 0.5)}, state, params)
    large, _ = optimizer.update({"a": jnp.full(3, 0.5), "b": jnp.full(3, 1e3)}, state, params)
    return bool(jnp.allclose(small["a"], large["a"]))


def _resolve_remat(remat) -> Callable[[Callable], Callable]:
    if remat in (None, "none"):
        return lambda f: f
    from fiddlejax.memory import policies

    policy = policies.resolve(remat)
    return lambda f: policies.remat_layer(f, policy)


def _encodings(encodings):
    if not encodings:
        return contextlib.nullcontext()
    from fiddlejax.memory import gist

    return gist.encodings(list(encodings))


def _opt_shardings(optimizer, opt_abstract, spec_tree, plan: Plan):
    """Optimizer-state shardings mirror the parameters'; ZeRO-1 also splits them over ``data``."""
    mesh = plan.mesh

    def spec_for(leaf, spec):
        s = spec if isinstance(spec, P) else spec[...]
        if plan.zero and plan.data > 1 and "data" not in jax.tree.leaves(tuple(s)):
            s = _add_data_axis(s, leaf.shape, plan.data)
        return NamedSharding(mesh, s)

    def unwrap(x):
        return x.get_value() if isinstance(x, nnx.Variable) else x

    specs = jax.tree.map(lambda v: v.get_value(), spec_tree,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))

    def leaf_sharding(leaf, spec):  # a masked leaf holds nothing: any sharding covers it
        return NamedSharding(mesh, P()) if _masked(leaf) else spec_for(unwrap(leaf), spec)

    return optax.tree_map_params(
        optimizer,
        leaf_sharding,
        opt_abstract,
        specs,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
        is_leaf=lambda x: isinstance(x, P | nnx.Variable),
    )


def _param_trees(optimizer, opt_tree) -> list:
    """The parameter-shaped subtrees of an optimizer-state-shaped tree, in the order
    ``optax.tree_map_params`` visits them."""
    found: list = []
    optax.tree_map_params(optimizer, lambda t: found.append(t) or t, opt_tree,
                          is_leaf=lambda _: True)
    return found


def _masked(x) -> bool:
    """An optax.MaskedNode, bare or in an nnx.Variable: no state for this parameter."""
    if isinstance(x, nnx.Variable):
        x = x.get_value()
    return isinstance(x, optax.MaskedNode)


def _data_dim(spec: P, shape: tuple[int, ...], data: int) -> int:
    """The dimension ZeRO shards a leaf's optimizer state (and, with zero=2, its reduced
    gradient) on over ``data``; -1: none."""
    parts = tuple(_add_data_axis(spec, shape, data))
    return parts.index("data") if "data" in parts else -1


def _add_data_axis(spec: P, shape: tuple[int, ...], data: int) -> P:
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for d, (size, ax) in enumerate(zip(shape, parts)):
        if ax is None and size % data == 0 and size >= data:
            parts[d] = "data"
            return P(*parts)
    return P(*parts)


def match_varying(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` marked varying over the manual axes ``like`` varies over (scan carries must agree)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    axes = tuple(sorted(getattr(mat, "varying", ()) or ()))
    return jax.lax.pcast(x, axes, to="varying") if axes else x
