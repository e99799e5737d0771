"""Plan: the parallel layout of a training job, validated before anything compiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import Mesh

from fiddlejax.mesh import AXES, axis_size
from fiddlejax.pipeline import schedules as _schedules

PARTITIONS = ("uniform", "params", "cost")
FSDP_GATHERS = ("layer", "step")


def schedule_kinds() -> tuple[str, ...]:
    """The pipeline schedule kinds a Plan accepts: the schedule registry's, so new kinds flow."""
    return tuple(_schedules.kinds())


def interleaves(kind: str | None) -> bool:
    """Whether schedule ``kind`` takes ``virtual_stages`` > 1 (the registry says)."""
    return bool(kind) and _schedules.interleaves(kind)


CONTEXT_KERNELS = ("auto", "ring", "allgather")  # how attention joins a context split


def __getattr__(name: str):  # SCHEDULES stays a name; it follows the registry
    if name == "SCHEDULES":
        return schedule_kinds()
    raise AttributeError(name)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to lay a model out on ``mesh`` (axes ``data``, ``pipe``, ``context``, ``expert``,
    ``tensor``).

    - ``schedule``: pipeline schedule kind; ``None`` means no pipeline (then ``pipe`` must be 1).
      Defaults to ``"1f1b"`` when the mesh has ``pipe > 1``.
    - ``microbatches``: per step, per data-parallel replica; gradients are accumulated over them.
    - ``virtual_stages``: model chunks per pipeline stage (interleaved schedules).
    - ``remat``: rematerialization policy name (``fiddlejax.memory``) or a policy object.
    - ``encodings``: Gist-style activation encodings (``fiddlejax.memory.gist``).
    - ``grad_allreduce``: algorithm for the data-parallel gradient reduction
      (``fiddlejax.collectives``); ``bucket_bytes`` groups small gradients into one reduction.
      ``"topk"`` exchanges only the ``topk_density`` fraction of largest entries of each gradient
      leaf (``all_gather`` of values and indices) and keeps the rest in a per-replica residual
      added to the next step's gradient (error feedback, ``TrainState.residual``).
    - ``topk_density``: fraction of each gradient leaf sent with ``grad_allreduce="topk"``.
    - ``topk_on``: what top-k sparsifies. ``"gradients"``: the replicas' gradients; one optimizer
      (state replicated) steps on their sparse mean. ``"updates"``: each replica runs the
      optimizer on its own gradient (optimizer state per replica, ``data`` times its memory) and
      the optimizer's *updates* are sparsified with error feedback: DGC's momentum correction
      (Lin et al. 2018) carried over to adaptive optimizers, whose per-coordinate scaling
      otherwise shrinks the delayed bursts error feedback releases (Adam's second moment grows
      with their square).
    - ``zero``: 1 shards the optimizer state over ``data`` (ZeRO stage 1); 2 also the reduced
      gradients (ZeRO-2: a reduce-scatter instead of an all-reduce, each replica updating its
      shard, then the parameters all-gathered: the traffic of plain data parallelism); 3 shards
      the parameters, gradients and optimizer state (ZeRO-3 / FSDP): each layer's weights are
      all-gathered over ``data`` just before use, forward and backward, and its gradients are
      reduce-scattered.
    - ``fsdp_gather`` (with ``zero=3``): when layers gather their weights. ``"layer"`` (default):
      just before each use, forward and backward, every microbatch; nothing is held gathered
      beyond one layer. ``"step"``: once per step, before the first microbatch, in the compute
      dtype, with the gradient accumulated over the microbatches at full size (float32) and
      reduce-scattered once after the last (MaxText's ``pipeline_fsdp_ag_once``): 1/m of the
      gather traffic, for a device's whole stage of weights and gradients held through the
      step. The planner prices both (``benchmarks/fsdp_gather_once.py``).
    - ``fsdp_prefetch`` (with ``zero=3``, ``fsdp_gather="layer"``, no pipeline): the scan over
      the layers gathers layer i+1's weights while layer i computes, and in the backward
      reduce-scatters layer i+1's gradient while layer i's backward computes
      (:mod:`fiddlejax.compute.prefetch`): the collectives overlap the matmuls, for one more layer
      of gathered weights and one of gradient held. ``False``: each layer gathers when it runs.
    - ``compute_dtype``: the dtype of matmuls, activations, stashes and the messages between
      stages (``"bfloat16"`` for mixed precision; also ``jnp.bfloat16``). Parameters, their
      gradients, the gradient reduction, the optimizer state and the loss stay float32.
    - ``matmul_dtype``: ``"fp8"`` runs each layer's dense matmuls (a dot against the layer's
      weights) on per-tensor-scaled float8 operands, e4m3 forward and e5m2 gradients
      (:mod:`fiddlejax.compute.fp8`); the rest stays in ``compute_dtype``, which must be
      ``"bfloat16"``. ``None`` (default): matmuls in ``compute_dtype``.
    - ``rules``: logical axis name -> mesh axis (or None), merged over
      ``fiddlejax.sharding.DEFAULT_RULES``, so a model annotated with its own names (``fsdp``,
      ``kv``, ...) is sharded as it is: ``Plan(rules={"kv": "tensor", "fsdp": None})``.
    - ``partition``: how layers map to pipeline stages (``uniform``, ``params``, ``cost``).
    - ``memory_budget``: bytes per device, for ``remat="auto"``, and the bound on each group's
      training state when ``partition`` splits unequal blocks (docs/byom.md).
    - ``split_backward``: run each whole backward B as I then W on consecutive ticks, so every
      lockstep tick costs one unit and 1F1B-style schedules reach their timeline bubble.
      ``None`` (default): split when that lowers the lockstep bubble and the backend is not the
      CPU (simulated CPU devices share cores, so a bubble costs no wall time there while each
      extra tick costs its fixed overhead); there, for the same reason, a zero-bubble kind runs
      each I with its W as one B. ``False``: every schedule as written.
    - ``sequence_parallel`` (with ``tensor`` > 1): Megatron's sequence parallelism; between
      the tensor-parallel matmuls each layer's residual stream, norms and router tally are
      split over ``tensor`` along the sequence (gathered before, reduce-scattered after)
      instead of replicated (:mod:`fiddlejax.parallel.sequence`).
    - ``unroll_layers`` (without a pipeline): the layers as straight-line code instead of a
      ``scan`` over their stack. ``None`` (default): unrolled off the CPU unless ``zero=3``
      (whose per-layer gathers XLA's collective pipeliner overlaps in the scan); the CPU keeps
      the scan, whose compile time does not grow with depth. On one H200 the unrolled 1.24B
      Llama stepped in 0.85x the scan's time (50.0% MFU against 42.6%,
      ``benchmarks/results/mfu.md``). A pipeline's stages always loop (their trip counts vary
      by tick).
    - ``context_kernel`` (with ``context`` > 1): how attention joins the sequence's shards,
      ``"ring"`` (K/V blocks around the ring), ``"allgather"`` or ``"auto"`` (by shape:
      :func:`fiddlejax.parallel.context.pick`).
    - ``check_inputs``: every ``Trainer.step`` checks the batch's ids against the model's
      vocabulary (or classes) and the loss for NaN/inf, raising an error that names the step.
      Costs a host sync per step: for debugging and for runs that must not train on garbage.

    Everything is checked here, at construction: names (schedule, remat policy, all-reduce
    algorithm, encodings, partition), sizes and combinations, so a bad plan fails before any
    model is traced.
    """

    mesh: Mesh
    schedule: str | None = "default"
    microbatches: int = 1
    virtual_stages: int = 1
    remat: object = "none"
    encodings: Sequence[str] = ()
    grad_allreduce: str = "xla"
    topk_density: float = 0.01
    topk_on: str = "gradients"
    bucket_bytes: int = 4 << 20
    zero: int = 0
    partition: str = "uniform"
    memory_budget: int | None = None
    check_inputs: bool = False
    split_backward: bool | None = None
    compute_dtype: object = "float32"
    matmul_dtype: str | None = None
    fsdp_gather: str = "layer"
    fsdp_prefetch: bool = True
    rules: object = None
    sequence_parallel: bool = False
    unroll_layers: bool | None = None
    context_kernel: str = "auto"

    def __post_init__(self):
        self._check_mesh_and_schedule()
        self._check_sizes_and_options()
        self._check_precision_and_rules()
        self._check_names()

    def _check_mesh_and_schedule(self) -> None:
        if not isinstance(self.mesh, Mesh) or tuple(self.mesh.axis_names) != AXES:
            names = getattr(self.mesh, "axis_names", None)
            raise ValueError(
                f"Plan.mesh must be a mesh with axes {AXES} (got {names!r}); "
                "build it with fiddlejax.make_mesh(data=, pipe=, tensor=)"
            )
        pipe = axis_size(self.mesh, "pipe")
        if self.schedule == "default":
            object.__setattr__(self, "schedule", "1f1b" if pipe > 1 else None)
        kinds = schedule_kinds()
        if self.schedule is not None and self.schedule not in kinds:
            raise ValueError(
                f"schedule={self.schedule!r} is unknown; use one of {kinds} or None"
                + _close(self.schedule, kinds)
            )
        if self.schedule is None and pipe > 1:
            raise ValueError(
                f"the mesh has pipe={pipe} but schedule=None; pick a pipeline schedule, e.g. "
                "schedule='1f1b'"
            )
        if self.schedule is not None and pipe == 1:
            raise ValueError(
                f"schedule={self.schedule!r} pipelines over the mesh's pipe axis, but it has "
                "pipe=1; use schedule=None, or a mesh with pipe > 1 "
                "(fiddlejax.make_mesh(data=..., pipe=2))"
            )
        expert, context = axis_size(self.mesh, "expert"), axis_size(self.mesh, "context")
        if expert > 1 and context > 1:
            raise ValueError(
                f"expert={expert} with context={context}: both split a batch's rows (context "
                "as sequence chunks), and the two splits do not compose yet; use one of them "
                "(mesh context=1 or expert=1)")
        for name in ("microbatches", "virtual_stages", "bucket_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if self.virtual_stages > 1 and not interleaves(self.schedule):
            users = [k for k in kinds if interleaves(k)]
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs an interleaved schedule "
                f"({', '.join(repr(k) for k in users)}), got {self.schedule!r}; set "
                "virtual_stages=1 or change the schedule"
            )

    def _check_sizes_and_options(self) -> None:
        if self.schedule == "2bw" and self.zero:
            raise ValueError(
                "schedule='2bw' keeps two weight versions per stage and updates them inside the "
                "pipeline; it does not shard the optimizer state: set zero=0")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"zero={self.zero!r} must be 0 (off), 1 (shard the optimizer "
                             "state over data), 2 (and the reduced gradients) or 3 (FSDP: "
                             "shard parameters, gradients and optimizer state over data)")
        if self.zero in (2, 3) and self.grad_allreduce not in ("xla",):
            raise ValueError(
                f"zero={self.zero} reduce-scatters each gradient; grad_allreduce="
                f"{self.grad_allreduce!r} would all-reduce whole gradients. Use "
                f"grad_allreduce='xla' with zero={self.zero}, or zero=1")
        if self.fsdp_gather not in FSDP_GATHERS:
            raise ValueError(f"fsdp_gather={self.fsdp_gather!r} must be 'layer' (each layer "
                             "gathers its weights before each use) or 'step' (once per step)"
                             + _close(str(self.fsdp_gather), FSDP_GATHERS))
        if not isinstance(self.fsdp_prefetch, bool):
            raise TypeError(f"fsdp_prefetch={self.fsdp_prefetch!r} must be True (gather each "
                            "layer's weights one layer ahead under zero=3) or False")
        if self.fsdp_gather == "step" and self.zero != 3:
            raise ValueError(f"fsdp_gather='step' gathers the weights FSDP shards, but zero="
                             f"{self.zero} does not shard them; set zero=3 (or drop fsdp_gather)")
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"partition={self.partition!r} must be 'uniform', 'params' or 'cost'"
                + _close(self.partition, PARTITIONS)
            )
        if self.memory_budget is not None and (
                isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int)
                or self.memory_budget < 1):
            raise ValueError(f"memory_budget={self.memory_budget!r} must be a positive number "
                             "of bytes per device, e.g. memory_budget=2 << 30 for 2 GiB")
        if self.remat == "auto" and self.memory_budget is None:
            raise ValueError("remat='auto' needs Plan(memory_budget=<bytes per device>), e.g. "
                             "memory_budget=2 << 30: it picks the cheapest policy that fits")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel={self.sequence_parallel!r} must be True or False")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence_parallel=True splits the sequence over `tensor`, but the "
                             "mesh has tensor=1; use a mesh with tensor > 1 or drop it")
        if self.sequence_parallel and axis_size(self.mesh, "expert") > 1:
            raise ValueError(  # jax 0.10's XLA: a failed check in PartitionGather, not an error
                f"sequence_parallel=True with expert={axis_size(self.mesh, 'expert')}: XLA's "
                "SPMD partitioner aborts on the MoE dispatch's gathers when a layer's tokens "
                "are split over both tensor and expert; drop sequence_parallel, or use expert=1")
        if not isinstance(self.check_inputs, bool):
            raise TypeError(f"check_inputs={self.check_inputs!r} must be True or False")
        if self.context_kernel not in CONTEXT_KERNELS:
            raise ValueError(f"context_kernel={self.context_kernel!r} is unknown; use one of "
                             f"{CONTEXT_KERNELS}")
        if self.unroll_layers is not None and not isinstance(self.unroll_layers, bool):
            raise TypeError(f"unroll_layers={self.unroll_layers!r} must be True, False or None "
                            "(None: unrolled off the CPU unless zero=3)")
        if self.split_backward is not None and not isinstance(self.split_backward, bool):
            raise TypeError(f"split_backward={self.split_backward!r} must be True, False or None "
                            "(None: split where lockstep bubbles cost time, i.e. off the CPU)")
        d = self.topk_density
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 < d <= 1:
            raise ValueError(
                f"topk_density={d!r} must be a number in (0, 1], the fraction of each gradient "
                "leaf sent per step; e.g. topk_density=0.01 for 1%"
            )
        if self.topk_on not in ("gradients", "updates"):
            raise ValueError(f"topk_on={self.topk_on!r} must be 'gradients' or 'updates'")
        if self.grad_allreduce == "topk" and self.topk_on == "updates" and self.zero:
            raise ValueError(
                "zero=1 shards one replicated optimizer state, but topk_on='updates' keeps one "
                "per data replica; use zero=0 or topk_on='gradients'"
            )
        if self.grad_allreduce == "topk" and self.schedule is not None:
            raise ValueError(
                f"grad_allreduce='topk' is not supported with a pipeline (schedule="
                f"{self.schedule!r}): its per-replica residual cannot pass through the pipeline "
                "runtime yet; use schedule=None (pipe=1) with data and tensor parallelism, or "
                "another grad_allreduce"
            )
        if isinstance(self.encodings, str):
            object.__setattr__(self, "encodings", (self.encodings,))
        object.__setattr__(self, "encodings", tuple(self.encodings))

    def _check_precision_and_rules(self) -> None:
        import numpy as np

        try:
            dtype = np.dtype(self.compute_dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.name not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r} must be a floating dtype: 'float32' "
                "(default), 'bfloat16' (mixed precision, float32 master weights) or 'float16'")
        object.__setattr__(self, "compute_dtype", dtype.name)
        if self.matmul_dtype not in (None, "fp8"):
            raise ValueError(f"matmul_dtype={self.matmul_dtype!r} must be None (matmuls in "
                             "compute_dtype) or 'fp8' (float8 dense matmuls)")
        if self.matmul_dtype == "fp8" and dtype.name != "bfloat16":
            raise ValueError(
                f"matmul_dtype='fp8' keeps everything but the dense matmuls in bfloat16; "
                f"compute_dtype={dtype.name!r} would run the rest in {dtype.name}: set "
                "compute_dtype='bfloat16' with it")
        rules = self.rules
        if rules is None:
            rules = ()
        elif hasattr(rules, "items"):
            rules = tuple(rules.items())
        if not all(isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str)
                   for r in rules):
            raise TypeError(f"rules={self.rules!r} must map logical axis names to mesh axes, "
                            "e.g. rules={'fsdp': None, 'kv': 'tensor'}")
        for name, axis in rules:
            axes = axis if isinstance(axis, tuple) else (axis,)
            bad = [a for a in axes if a is not None and a not in AXES]
            if bad:
                raise ValueError(f"rules[{name!r}]={axis!r} names no mesh axis; use one of "
                                 f"{AXES} or None (replicated)")
        object.__setattr__(self, "rules", tuple(rules))

    @property
    def axis_rules(self) -> dict:
        """The logical-axis rules this plan shards by: the defaults, updated by ``rules``."""
        from fiddlejax.sharding import DEFAULT_RULES

        return {**DEFAULT_RULES, **dict(self.rules)}

    def _check_names(self) -> None:
        """remat policy, all-reduce algorithm and encodings: names their modules know."""
        from fiddlejax.collectives import ALGORITHMS
        from fiddlejax.memory import gist, policies

        if isinstance(self.remat, str) and self.remat != "auto":
            policies.resolve(self.remat)  # raises naming the known policies
        elif not isinstance(self.remat, str) and self.remat is not None:
            policies.resolve(self.remat)  # a Policy object, or a TypeError naming the value
        algorithms = (*ALGORITHMS, "topk")
        unusable = {"hierarchical": "reduces over a pair of axes", "packed-trees":
                    "needs a topology"}
        if self.grad_allreduce not in algorithms or self.grad_allreduce in unusable:
            why = (f" ({unusable[self.grad_allreduce]}, which the data axis does not give)"
                   if self.grad_allreduce in unusable else "")
            usable = [a for a in algorithms if a not in unusable]
            raise ValueError(
                f"grad_allreduce={self.grad_allreduce!r} cannot reduce gradients{why}; use "
                f"one of {usable}" + _close(str(self.grad_allreduce), usable))
        gist.parse(list(self.encodings))  # raises naming the known encodings

    @property
    def data(self) -> int:
        return axis_size(self.mesh, "data")

    @property
    def pipe(self) -> int:
        return axis_size(self.mesh, "pipe")

    @property
    def tensor(self) -> int:
        return axis_size(self.mesh, "tensor")

    @property
    def expert(self) -> int:
        return axis_size(self.mesh, "expert")

    def describe(self) -> dict:
        """A JSON-friendly summary (for logs and checkpoint metadata)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mesh"}
        d["remat"] = getattr(self.remat, "name", self.remat)
        d["encodings"] = list(self.encodings)
        d["rules"] = {k: v for k, v in self.rules}
        d["mesh"] = {a: axis_size(self.mesh, a) for a in AXES}
        return d


def _close(word: str, known) -> str:
    import difflib

    match = difflib.get_close_matches(str(word), list(known), n=1)
    return f"; did you mean {match[0]!r}?" if match else ""
