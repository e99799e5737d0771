"""A parallel layout to predict: mesh sizes, pipeline schedule, batch split, remat, ZeRO.

Validated against the model and the cluster before any prediction, with errors that name the bad
value and a fix (docs/architecture.md, "Conventions").
"""

from __future__ import annotations

import dataclasses
import functools

from fiddlejax.pipeline.schedules import interleaves
from fiddlejax.planner import attention
from fiddlejax.planner.cluster import ClusterSpec
from fiddlejax.planner.workload import ModelSpec

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
SIXTEEN_BIT = ("bf16-mixed", "bf16")  # activations, stashes and messages in bf16
MATMUL_DTYPES = (None, "fp8")  # fj.Plan(matmul_dtype=)
HEADS = ("vocab-parallel", "last-stage")
P2PS = ("async", "batched", "blocking")  # how stage-to-stage transfers wait (Layout.p2p)
PARTITIONS = ("layers", "layers+head")
GRAD_ACCUMULATIONS = ("fused", "separate", "cast-add")
RANK_ORDERS = ("data-pipe-tensor", "pipe-data-tensor")  # device order, outermost axis first
ZEROS = (0, 1, 2, 3)
MASTERS = ("state", "optimizer")
DISPATCHES = ("static", "dropless")  # how an MoE runtime sends tokens (Layout.dispatch)
FSDP_GATHERS = ("layer", "step")  # fj.Plan(fsdp_gather=)
MAX_BUILT_ACTIONS = 2_000  # larger schedules use closed forms (building them is slow in Python)


def schedule_kinds() -> tuple[str, ...]:
    """The pipeline schedule kinds: the schedule registry's, the same list ``fj.Plan`` accepts."""
    from fiddlejax.pipeline.schedules import kinds

    return tuple(kinds())


@functools.lru_cache(maxsize=512)
def schedule_for(kind: str, p: int, m: int, v: int, k: int = 1):
    """The validated schedule (cached: searches ask for the same one many times); ``k``
    optimizer steps without a flush (``2bw`` only)."""
    from fiddlejax.pipeline.schedules import build

    return build(kind, stages=p, microbatches=m, virtual_stages=v, steps=k)


@dataclasses.dataclass(frozen=True)
class Layout:
    """``tensor x pipe x data`` GPUs; ``global_batch`` samples per step split into
    ``data`` replicas x ``microbatches`` x ``microbatch_size``.

    ``precision``: ``fp32`` is ``fj.Plan()`` (4-byte parameters, gradients, Adam moments and
    activations); ``bf16-mixed`` is ``fj.Plan(compute_dtype="bfloat16")``: the same float32
    parameters (master weights), gradients and moments in the state, each layer's weights cast to
    bf16 just before use, bf16 activations, stashes and stage-to-stage messages; ``bf16`` is a
    model whose parameters are bf16 themselves (``docs/precision.md``, "16-bit parameters"):
    2-byte parameters and Adam moments (optax's follow the parameters), gradients still
    accumulated and reduced in float32, bf16 activations. ``zero``: 1
    shards the optimizer state over ``data`` (the gradients all-reduced, the updated parameters
    all-gathered); 2 also the reduced gradients (a reduce-scatter instead); 3 (FSDP) shards
    parameters, gradients and optimizer state, and all-gathers each layer's weights just
    before use (``fsdp_gather="layer"``, every microbatch) or a stage's weights once per step
    (``"step"``: held gathered in the compute dtype with a full-size float32 gradient;
    ``Plan(fsdp_gather=)``).
    ``matmul_dtype="fp8"`` is ``fj.Plan(compute_dtype="bfloat16", matmul_dtype="fp8")``
    (needs ``bf16-mixed`` and a GPU with fp8 tensor cores): each layer's dense matmuls at the
    fp8 peak plus their per-tensor quantization (``timing``); everything else as bf16.
    ``dp_overlap`` is the share of the data-parallel gradient reduction hidden under the
    backward (0 for fiddlejax, which reduces after the last microbatch).
    ``attention``: ``fused`` (cuDNN's flash attention: no s x s scores in HBM), ``xla`` (XLA's,
    which keeps them) or ``auto``: fused for ``bf16-mixed`` on a GPU (``planner.attention``).

    ``head``: where a pipeline runs the embedding and the output head. ``vocab-parallel`` is
    fiddlejax's runtime: sharded over ``pipe`` x ``tensor`` on every stage, run once per
    microbatch by all of them. ``last-stage`` is Megatron-LM's placement (embedding on the first
    stage, head on the last, each split over ``tensor``), to compare with runs published with it.

    How a published run executed, to predict it as it ran (fiddlejax's runtime is the
    default of each; ``fiddlejax.planner.published`` sets them per run):

    - ``p2p``: ``async`` transfers delay only the receiving stage (the simulator's latency);
      ``batched`` (Megatron-LM 2021: one blocking send-and-receive per action) and
      ``blocking`` (DeepSpeed's pipeline engine: a blocking receive and a blocking send per
      action) charge every action its transfer, the message split over the tensor ranks and
      all-gathered over NVLink (Megatron's scatter/gather, DeepSpeed's partitioned
      activations).
    - ``grad_bytes``: bytes per element of the gradient accumulator, which the data-parallel
      reduction sends (float32 here; 2 for Megatron-LM 2021's fp16 runs). Time only: the
      memory model is fiddlejax's float32 state.
    - ``grad_accumulation``: ``separate`` adds each microbatch's gradient into the
      accumulator with its own kernel (PyTorch's autograd, Megatron's ``main_grad.add_``), an
      HBM pass per microbatch; ``cast-add`` first casts it to the accumulator's dtype in a
      kernel of its own (DeepSpeed's BF16_Optimizer: ``hp.add_(lp.grad.to(float32))``);
      ``fused`` counts none.
    - ``rank_order``: how devices are numbered, outermost axis first. fiddlejax's mesh is
      ``data-pipe-tensor`` (a data group strided by tensor x pipe); Megatron-LM and DeepSpeed
      number ``pipe-data-tensor`` (a data group strided by tensor: with tensor 4, two replicas
      share a node).
    - ``master``: ``state`` is fiddlejax's float32 parameters (4 bytes, a bf16 copy per
      use); ``optimizer`` is Megatron-Core's distributed optimizer with Transformer Engine:
      bf16 parameters (2 bytes, gathered in bf16), one float32 ``main_grad`` accumulated in
      place, and the float32 master copy with the two moments in the optimizer state (12
      bytes, sharded over ``data`` x ``context`` with ``zero`` >= 1).
    - ``dispatch``: ``static`` is fiddlejax's expert all-to-all (worst-case buffers,
      ``experts.padding``); ``dropless`` sends only the real (token, expert) pairs
      (Megatron-Core's and DeepEP's dispatchers with grouped GEMMs).
    - ``partition``: ``layers+head`` counts the embedding and the head as a layer each when
      splitting layers over stages (Megatron-DeepSpeed's ``type:transformer|embedding``,
      BLOOM's run); ``layers`` splits the layers evenly and adds the head to the last stage.

    ``steps_per_call`` (K, ``2bw`` only): optimizer steps one ``trainer.steps`` call runs
    without a pipeline flush; the fill and drain are paid once per K steps. Predictions stay
    per optimizer step.

    ``context``: devices each sequence is split over (``fj.make_mesh(context=)``, between
    ``pipe`` and ``tensor`` in device order): activations and per-device FLOPs divided by it,
    the ring's K/V transfers overlapped with the layer's compute, the gradients reduced over
    ``data`` x ``context``. ``sequence_parallel`` (``Plan(sequence_parallel=True)``): the
    replicated activations split over ``tensor`` too.

    ``expert`` (``fj.make_mesh(expert=)``, between ``context`` and ``tensor`` in device
    order): an MoE model's experts split over it; outside the MoE layers it is more data
    parallelism (the batch splits over ``data x expert``), inside them tokens travel by
    all-to-all (``planner.experts``).
    """

    tensor: int = 1
    pipe: int = 1
    data: int = 1
    virtual_stages: int = 1
    microbatch_size: int = 1
    global_batch: int = 1
    schedule: str | None = None
    steps_per_call: int = 1
    remat: str = "none"
    zero: int = 0
    precision: str = "fp32"
    head: str = "vocab-parallel"
    optimizer: str = "adam"
    dp_overlap: float = 0.0
    fsdp_gather: str = "layer"
    p2p: str = "async"
    grad_bytes: int = 4
    grad_accumulation: str = "fused"
    partition: str = "layers"
    rank_order: str = "data-pipe-tensor"
    context: int = 1
    sequence_parallel: bool = False
    expert: int = 1
    matmul_dtype: str | None = None
    attention: str = "auto"
    master: str = "state"
    dispatch: str = "static"

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipe * self.data * self.context * self.expert

    @property
    def replicas(self) -> int:
        """Ways the batch splits: ``data`` x ``expert``."""
        return self.data * self.expert

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.replicas * self.microbatch_size)

    @property
    def kind(self) -> str | None:
        """The schedule actually run (``1f1b`` by default when pipe > 1)."""
        if self.pipe == 1:
            return None
        return self.schedule or ("interleaved-1f1b" if self.virtual_stages > 1 else "1f1b")

    @property
    def data_stride(self) -> int:
        """Device-number distance between data-parallel replicas (``rank_order``)."""
        return self.tensor * self.context * self.expert * (
            self.pipe if self.rank_order == "data-pipe-tensor" else 1)

    @property
    def pipe_stride(self) -> int:
        """Device-number distance between neighbouring pipeline stages."""
        return self.tensor * self.context * self.expert * (
            1 if self.rank_order == "data-pipe-tensor" else self.data)

    @property
    def fsdp_shards(self) -> int:
        """Devices ZeRO-3 shards the dense weights over: ``data``, and ``context`` or
        ``expert`` outside a pipeline (their replicas hold the same dense weights;
        ``fiddlejax.parallel.zero.store_also``; the experts' own split over ``data`` x
        ``context`` only: ``planner.footprint.fsdp_held``)."""
        return self.data * (self.context * self.expert if self.pipe == 1 else 1)

    @property
    def fsdp(self) -> bool:
        """ZeRO-3: parameters, gradients and optimizer state sharded over ``data`` (and
        ``context`` or ``expert``)."""
        return self.zero == 3 and self.fsdp_shards > 1

    @property
    def gathers_once(self) -> bool:
        """FSDP gathering a stage's weights once per step (``fsdp_gather="step"``)."""
        return self.fsdp and self.fsdp_gather == "step"

    def short(self) -> str:
        s = f"t{self.tensor} p{self.pipe} d{self.data} mb{self.microbatch_size}"
        s += f" c{self.context}" if self.context > 1 else ""
        s += f" e{self.expert}" if self.expert > 1 else ""
        s += " sp" if self.sequence_parallel else ""
        if self.pipe > 1:
            s += f" {self.kind}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
            s += f" K{self.steps_per_call}" if self.kind == "2bw" else ""
            s += " head=last-stage" if self.head == "last-stage" else ""
            s += " partition=layers+head" if self.partition == "layers+head" else ""
            s += f" p2p={self.p2p}" if self.p2p != "async" else ""
        s += f" remat={self.remat}" + (f" zero{self.zero}" if self.zero else "")
        s += " fp8" if self.matmul_dtype == "fp8" else ""
        s += " gather=step" if self.fsdp_gather == "step" else ""
        s += " master=optimizer" if self.master == "optimizer" else ""
        s += " dropless" if self.dispatch == "dropless" else ""
        s += f" overlap={self.dp_overlap:g}" if self.dp_overlap else ""
        s += " grads=fp16" if self.grad_bytes == 2 else ""
        s += " order=" + self.rank_order if self.rank_order != "data-pipe-tensor" else ""
        return s + (f" accumulate={self.grad_accumulation}"
                    if self.grad_accumulation != "fused" else "")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["schedule"] = self.kind
        d["microbatches"] = self.microbatches
        d["gpus"] = self.gpus
        return d


def _positive(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")


def validate(layout: Layout, model: ModelSpec, cluster: ClusterSpec | None = None) -> Layout:
    """Raise ``ValueError`` naming the first thing that cannot run, and how to fix it."""
    check_matmul_dtype(layout.matmul_dtype, layout.precision, model, cluster)
    attention.check(layout.attention, layout.precision, model, cluster)
    _check_sizes(layout, model, cluster)
    _check_schedule(layout)
    _check_options(layout, model)
    return layout


def check_matmul_dtype(matmul_dtype: str | None, precision: str, model: ModelSpec | None,
                       cluster: ClusterSpec | None) -> None:
    """fp8 matmuls need bf16 around them, a model that says which FLOPs are dense matmuls,
    and a GPU with fp8 tensor cores: refused here, before anything is priced."""
    if matmul_dtype not in MATMUL_DTYPES:
        raise ValueError(f"matmul_dtype={matmul_dtype!r} must be None (matmuls in the compute "
                         "dtype) or 'fp8'")
    if matmul_dtype is None:
        return
    if precision not in SIXTEEN_BIT:
        raise ValueError(f"matmul_dtype='fp8' keeps everything but the dense matmuls in bf16; "
                         f"precision={precision!r} does not: use precision='bf16-mixed' "
                         "(--precision bf16-mixed)")
    if cluster is not None and not cluster.gpu.fp8_flops:
        from fiddlejax.planner.cluster import fp8_clusters

        raise ValueError(f"matmul_dtype='fp8' on {cluster.name} ({cluster.gpu.name}): that "
                         "GPU has no fp8 tensor cores; drop --matmul-dtype fp8 or use one of "
                         f"{fp8_clusters()}")
    if model is not None and model.dense is None:
        raise ValueError(f"matmul_dtype='fp8' needs to know which of {model.name}'s FLOPs are "
                         "dense matmuls (ModelSpec.dense), and this model does not say (a "
                         "from_flax measurement); use the analytic gpt/llama/moe_llama "
                         "description or drop fp8")


def _check_sizes(lo: Layout, model: ModelSpec, cluster: ClusterSpec | None) -> None:
    """The mesh, the model and the batch divide as the layout says."""
    for f in ("tensor", "pipe", "data", "virtual_stages", "microbatch_size", "global_batch",
              "steps_per_call", "context", "expert"):
        _positive(f, getattr(lo, f))
    if lo.expert > 1 and model.moe is None:
        raise ValueError(f"expert={lo.expert} splits a mixture of experts; {model.name} has "
                         "none: set expert=1")
    n = model.moe.num_experts if model.moe is not None else 1
    if n % lo.expert:
        raise ValueError(f"expert={lo.expert} does not divide the {n} experts of {model.name}"
                         f"; use one of {[x for x in range(1, n + 1) if n % x == 0]}")
    if lo.context > 1 and model.seq_len % (2 * lo.context):
        raise ValueError(f"context={lo.context} cuts each sequence into {2 * lo.context} equal "
                         f"chunks, but seq_len={model.seq_len} is not a multiple of "
                         f"{2 * lo.context}; use a context size that divides seq_len / 2")
    if lo.sequence_parallel and lo.tensor == 1:
        raise ValueError("sequence_parallel=True splits activations over tensor, but "
                         "tensor=1; set tensor > 1 or drop it")
    if cluster is not None and lo.gpus != cluster.num_gpus:
        more = [(n, getattr(lo, n)) for n in ("context", "expert") if getattr(lo, n) > 1]
        names, sizes = "".join(f" x {n}" for n, _ in more), "".join(f" x {v}" for _, v in more)
        raise ValueError(
            f"tensor x pipe x data{names} = {lo.tensor} x {lo.pipe} x {lo.data}{sizes} = "
            f"{lo.gpus} but the "
            f"cluster has {cluster.num_gpus} GPUs ({cluster.nodes} nodes x "
            f"{cluster.gpus_per_node}); make the product {cluster.num_gpus} or use "
            f"--nodes {max(1, lo.gpus // cluster.gpus_per_node)}")
    if model.heads is not None and model.heads % lo.tensor:
        raise ValueError(f"heads={model.heads} is not divisible by tensor={lo.tensor}; use a "
                         f"tensor size that divides {model.heads}")
    if model.num_layers < lo.pipe * lo.virtual_stages:
        raise ValueError(
            f"layers={model.num_layers} < pipe x virtual_stages = {lo.pipe} x "
            f"{lo.virtual_stages}; every chunk needs a layer: use pipe x virtual <= "
            f"{model.num_layers}")
    per = lo.replicas * lo.microbatch_size
    if lo.global_batch % per:
        ex = f" x expert {lo.expert}" if lo.expert > 1 else ""
        raise ValueError(
            f"global_batch={lo.global_batch} is not a multiple of data{ex} x microbatch_size "
            f"= {per}; use e.g. "
            f"{max(per, lo.global_batch // per * per)}")


def _check_schedule(lo: Layout) -> None:
    """The schedule exists and builds with these sizes (the registry is the one rulebook)."""
    kinds = schedule_kinds()
    if lo.schedule is not None and lo.schedule not in kinds:
        raise ValueError(f"schedule={lo.schedule!r} is unknown; use one of {kinds}")
    if lo.virtual_stages > 1 and not interleaves(lo.kind or ""):
        users = [k for k in kinds if interleaves(k)]
        raise ValueError(f"virtual_stages={lo.virtual_stages} needs an interleaved schedule "
                         f"({', '.join(users)}), got {lo.kind!r}; set virtual_stages=1")
    k = lo.steps_per_call
    if k > 1 and lo.kind != "2bw":
        raise ValueError(f"steps_per_call={k} needs schedule '2bw' (got {lo.kind!r}, which "
                         f"flushes the pipeline every step); set steps_per_call=1")
    if lo.schedule == "2bw" and lo.zero:
        raise ValueError(f"zero={lo.zero} with schedule '2bw': 2BW keeps two weight versions "
                         "per stage and updates them inside the pipeline, so the runtime does "
                         "not shard them; set zero=0 or use another schedule")
    if lo.pipe > 1:
        # The runtime runs whatever the schedule registry builds (any m for interleaving, m < p,
        # 2bw's limits): build is the one rulebook. Larger schedules, which would be slow to
        # build, have enough microbatches for every generator's minimum.
        if lo.pipe * lo.microbatches * lo.virtual_stages * k <= MAX_BUILT_ACTIONS:
            schedule_for(lo.kind, lo.pipe, lo.microbatches, lo.virtual_stages, k)


def _check_options(lo: Layout, model: ModelSpec) -> None:
    """Every named option is one the planner models."""
    if lo.remat not in model.act:
        raise ValueError(f"remat={lo.remat!r} is not described for {model.name}; use one of "
                         f"{sorted(model.act)}")
    if lo.zero not in ZEROS or isinstance(lo.zero, bool):
        raise ValueError(f"zero={lo.zero!r} must be 0 (off), 1 (optimizer state sharded over "
                         "data), 2 (and the reduced gradients) or 3 (FSDP: parameters, "
                         "gradients and optimizer state)")
    if lo.fsdp_gather not in FSDP_GATHERS:
        raise ValueError(f"fsdp_gather={lo.fsdp_gather!r} must be one of {FSDP_GATHERS}")
    if lo.fsdp_gather == "step" and lo.zero != 3:
        raise ValueError(f"fsdp_gather='step' gathers FSDP shards; zero={lo.zero} does not "
                         "shard the parameters: set zero=3")
    if lo.fsdp_gather == "step" and lo.fsdp_shards > lo.data:
        raise ValueError(f"fsdp_gather='step' gathers over data once per step, but zero=3 "
                         f"also shards over context={lo.context} x expert={lo.expert}; use "
                         "fsdp_gather='layer'")
    if lo.precision not in PRECISIONS:
        raise ValueError(f"precision={lo.precision!r} must be one of {PRECISIONS}")
    if lo.head not in HEADS:
        raise ValueError(f"head={lo.head!r} must be one of {HEADS}")
    if lo.optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer={lo.optimizer!r} must be 'adam' or 'sgd'")
    if not 0.0 <= lo.dp_overlap <= 1.0:
        raise ValueError(f"dp_overlap={lo.dp_overlap} must be in [0, 1]")
    for name, value, allowed in (("p2p", lo.p2p, P2PS), ("grad_bytes", lo.grad_bytes, (2, 4)),
                                 ("grad_accumulation", lo.grad_accumulation,
                                  GRAD_ACCUMULATIONS), ("partition", lo.partition, PARTITIONS),
                                 ("rank_order", lo.rank_order, RANK_ORDERS),
                                 ("master", lo.master, MASTERS),
                                 ("dispatch", lo.dispatch, DISPATCHES)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {allowed}")
    if lo.partition == "layers+head" and (lo.head != "last-stage" or lo.virtual_stages > 1):
        raise ValueError(f"partition='layers+head' splits Megatron's placement of the head "
                         f"(head='last-stage', got {lo.head!r}) without interleaving (got "
                         f"virtual_stages={lo.virtual_stages}); set partition='layers'")
