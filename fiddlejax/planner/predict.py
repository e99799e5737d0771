"""Daydream-style what-if prediction: step time and memory per GPU of a layout, before running.

Time. One microbatch through one chunk (``layers / (pipe x virtual)`` layers) costs
  forward  = matmul FLOPs / (tensor x peak x gemm_efficiency)
           + elementwise bytes / HBM bandwidth           (a roofline: every residual written and
                                                           read once)
           + tensor-parallel all-reduces                  (``collectives.cost``, on NVLink or NICs)
  backward = 2 x forward compute + the same all-reduces, plus the recomputation the remat policy
             implies (``full`` re-runs the forward; ``dots``/``minimal`` its elementwise part).
The schedule simulator (``pipeline.schedules.simulate``) runs the real action lists with those
F/B (or F/I/W) costs and the stage-to-stage transfer time as latency: its makespan minus the
stage's busy time is the bubble. ``2bw`` runs 1F1B over the K x m microbatches of
``steps_per_call`` = K optimizer steps without a flush: the simulator's makespan of that
schedule, divided by K, is the time per step, so the fill and drain are amortized over K
steps. The data-parallel gradient all-reduce follows (exposed, except ``dp_overlap``), then the
optimizer update (HBM bound). The embedding and head of a pipeline run vocabulary-parallel over
every device of ``pipe`` x ``tensor`` once per microbatch, between the stage programs: each
device pays 1/(pipe x tensor) of their FLOPs per microbatch, serially with the ticks, plus
their activation-sized all-reduces (``vocab_allreduces``). ``head="last-stage"`` (Megatron's
placement, for published runs) charges them to every stage instead (the slowest sets the pace).

Memory per GPU. Parameters, gradients and optimizer state from the parameter counts, with what
each rank holds: layer weights split over ``tensor`` (biases and norms whole), the stage's
``virtual x ceil(layers / chunks)`` layers (the runtime pads chunks to equal length), and the
parameters outside the stack: in a pipeline every leaf of at least 65,536 elements split over
``pipe`` x ``tensor`` on every stage (``outer_params``), smaller ones as without a pipeline.
Gradients are held once in a pipeline: each layer's weight gradient is added, layer by layer
and in place, into the accumulator the optimizer reads (``pipeline.stage``'s layer loops carry
it); without a pipeline, microbatches accumulate beside each microbatch's fresh gradients
(twice). Activations: the stash buffer of ``held`` (schedule's peak held chunk activations) x
layers per chunk x the remat policy's residuals per layer (without remat, the explicit
``jax.vjp`` residuals: ``ModelSpec.act_stashed``), a carry of the layer loops that each
layer reads and writes in place (no slot is copied out and back); for ``zb-h1`` the per-layer
output cotangents its split backward keeps from I until W, buffered the same way; and a working
set: one layer's full residuals on this rank (XLA's attention keeps its scores float32 in any
compute dtype) with the weights it uses (and, for a whole backward in a pipeline, that layer's
fresh float32 gradient before it is added in place), the logits, the pipeline inboxes. A
vocabulary-parallel head never runs beside a layer, so the larger of the two counts; it holds
its float32 logits and their gradient, its weight shard's fresh float32 gradient (before it is
added into the accumulator) and, in bf16, the shard's bf16 copy. The stash stores 16-bit
residuals as their bits, so XLA's CPU compile (which computes bf16 in float32) holds what a GPU
does: one prediction serves both.

Precision and ZeRO as the runtime does them. ``bf16-mixed`` (``Plan(compute_dtype=
"bfloat16")``) keeps float32 parameters, gradients and Adam moments in the state and halves the
activations, stashes and messages; each layer's bf16 weight copy is a transient. ``zero=1``
divides the optimizer state by ``data``; ``zero=3`` (FSDP) divides parameters, gradients and
optimizer state, and adds to the working set what one layer's use materialises: the gathered
weights in the compute dtype, the next layer's prefetched, and the full-size float32 weight
gradient before its reduce-scatter (or the embedding or head with its gradient, if larger). Its
time pays, per microbatch, an all-gather forward and backward and a reduce-scatter of the
stage's weights instead of one gradient all-reduce per step. Gathered once per step
(``fsdp_gather="step"``) the stage's weights are held gathered in the compute dtype and its
gradient accumulated at full size in float32 (plus its reduce-scattered shard), for one
all-gather and one reduce-scatter per step.

2bw (``Pipeline.train_2bw``) adds, per GPU, the second weight version (W(t-1), in the state),
the program's stacked copy of both versions, a gradient accumulator per version (two steps
overlap) and the optimizer update applied inside the program: with the reduced gradient 1F1B
already holds, parameters 4x, gradients 3x, and one parameter-sized update in the working set.
Optimizer state is 1F1B's (``zero=1`` is refused); the activation stash is 1F1B's over K x m.
Each further step of a K-step call adds one optimizer state to the working set: XLA does not
reuse the buffers of the unrolled steps' updates (measured at (1, 4, 2) with AdamW, whose state
is 2 parameter copies: 1.1 to 1.9 copies per further step for K = 2..8; with SGD, 1.7 copies
once K >= 3, not modelled).

zb-h1's I and W split one backward: I runs the input-gradient chain and keeps every layer's
output cotangent, W turns each into its layer's weight gradient without re-running the chain
(``Pipeline._layerwise_fns``), so I + W cost one backward (I = W = B/2 in the simulator).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from fiddlejax.pipeline.schedules import interleaves
from fiddlejax.planner.cluster import ClusterSpec
from fiddlejax.planner.space import MAX_BUILT_ACTIONS, Layout, schedule_for, validate
from fiddlejax.planner.workload import ModelSpec

VOCAB_PARALLEL_MIN = 65_536  # the pipeline shards outer leaves this large over pipe x tensor
MAX_SIMULATED_ACTIONS = 20_000  # beyond this the bubble uses the schedule's closed form


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per GPU, by what they hold."""

    params: float
    grads: float
    optimizer: float
    activations: float  # stash of held microbatches
    working: float  # transient: one layer's residuals, logits

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.working

    def to_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        return d


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds per training step, split by cause; ``total`` is the predicted step time."""

    compute: float  # matmuls + elementwise + recomputation on the slowest stage
    tensor_comm: float  # tensor-parallel all-reduces (exposed: they sit on the critical path)
    bubble: float  # pipeline fill/drain idle time, stage-to-stage transfers included
    data_comm: float  # the whole gradient reduction
    data_comm_exposed: float  # the part not hidden under the backward
    optimizer: float

    @property
    def total(self) -> float:
        return (self.compute + self.tensor_comm + self.bubble + self.data_comm_exposed
                + self.optimizer)

    @property
    def overlapped(self) -> float:
        return self.data_comm - self.data_comm_exposed

    def to_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        d["overlapped"] = self.overlapped
        return d


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A layout's predicted step time, throughput and memory on a cluster."""

    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    time: StepTime
    memory: Memory
    bubble_fraction: float
    held: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.cluster.memory_budget

    @property
    def tokens_per_second(self) -> float:
        return self.layout.global_batch * self.model.seq_len / self.time.total

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model FLOPs (no recomputation) per second per GPU, in TFLOP/s."""
        flops = self.model.model_flops(self.layout.global_batch)
        return flops / self.time.total / self.layout.gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """Executed FLOPs (recomputation included) per second per GPU, in TFLOP/s."""
        flops = self.model.train_flops(self.layout.global_batch, self.layout.remat)
        return flops / self.time.total / self.layout.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu * 1e12 / self.cluster.gpu.peak_flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name, "cluster": self.cluster.name,
            "gpus": self.layout.gpus, "layout": self.layout.to_dict(),
            "step_time_s": self.time.total, "time": self.time.to_dict(),
            "bubble_fraction": self.bubble_fraction, "held_microbatches": self.held,
            "memory": self.memory.to_dict(),
            "memory_budget": self.cluster.memory_budget, "fits": self.fits,
            "tokens_per_s": self.tokens_per_second,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
        }


# ----------------------------------------------------------------------------- helpers


def _bytes(layout: Layout) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter: float32 in both precisions
    (``bf16-mixed`` keeps float32 master weights in the state and casts each layer to bf16 just
    before use, a transient counted in the working set)."""
    return 4, 4, (8 if layout.optimizer == "adam" else 0)


def _act_bytes(layout: Layout) -> int:
    return 4 if layout.precision == "fp32" else 2


def chunk_layers(model: ModelSpec, layout: Layout) -> int:
    """Layers in the largest chunk; with per-layer costs, PipeDream's balanced partition."""
    chunks = layout.pipe * layout.virtual_stages
    if model.layer_costs is None:
        return math.ceil(model.num_layers / chunks)
    from fiddlejax.pipeline.partition import balanced

    counts = balanced(list(model.layer_costs), chunks)
    return max(counts)


def _chunk_cost_scale(model: ModelSpec, layout: Layout) -> float:
    """The slowest chunk's cost in units of an average layer (uneven layers)."""
    if model.layer_costs is None:
        return float(chunk_layers(model, layout))
    from fiddlejax.pipeline.partition import balanced, chunk_costs

    costs = list(model.layer_costs)
    counts = balanced(costs, layout.pipe * layout.virtual_stages)
    mean = sum(costs) / len(costs)
    return max(chunk_costs(counts, costs)) / mean


def held_microbatches(layout: Layout) -> int:
    """Peak (microbatch, chunk) activations a stage holds, from the schedule itself."""
    if layout.pipe == 1:
        return 1
    p, m, v, k = layout.pipe, layout.microbatches, layout.virtual_stages, _steps(layout)
    if p * m * v * k <= MAX_BUILT_ACTIONS:
        return schedule_for(layout.kind, p, m, v, k).max_held
    if layout.kind == "2bw":
        return min(k * m, p)
    if layout.kind == "gpipe":
        return m * v
    if interleaves(layout.kind):
        return min(m * v, (v - 1) * p + 2 * (p - 1) + 1)
    return min(m, p)


def inbox_slots(layout: Layout) -> int:
    """Boundary-sized buffers a stage keeps for received activations and cotangents (the tick
    table's inbox peaks) plus the split backward's saved cotangent."""
    p, m, v, k = layout.pipe, layout.microbatches, layout.virtual_stages, _steps(layout)
    if p == 1:
        return 0
    if p * m * v * k > MAX_BUILT_ACTIONS:
        return 3
    peaks = schedule_for(layout.kind, p, m, v, k).ticks.inbox_peak
    return max(a for a, _ in peaks) + max(g for _, g in peaks) + 1


def _steps(layout: Layout) -> int:
    """Optimizer steps one schedule spans (K for ``2bw``, else 1)."""
    return layout.steps_per_call if layout.kind == "2bw" else 1


@functools.lru_cache(maxsize=4096)
def _makespan(kind: str, p: int, m: int, v: int, f: float, b: float, lat: float,
              simulate: bool = True, k: int = 1) -> float:
    """Pipeline makespan for per-chunk costs F=f, B=b (I=W=b/2 when split) and transfer lat:
    the schedule simulator's, or the closed form (fill + drain) when too large or not asked.
    ``k`` steps without a flush (``2bw``): the makespan of all k steps."""
    i = w = b / 2  # a split backward: b is the whole of I + W
    if simulate and p * m * v * k <= MAX_SIMULATED_ACTIONS:
        from fiddlejax.pipeline.schedules import simulate

        s = schedule_for(kind, p, m, v, k)
        return simulate(s, {"F": f, "B": b, "I": i, "W": w}, latency=lat).makespan
    if kind == "zb-h1":
        return m * v * (f + i + w) + (p - 1) * (f + i + 2 * lat)
    return k * m * v * (f + b) + (p - 1) * (f + b + 2 * lat)  # 2bw: 1F1B over k x m


@functools.lru_cache(maxsize=4096)
def _allreduce(size: int, per_node: int, nbytes: float, nvlink: float, nic: float,
               nvlat: float) -> float:
    """All-reduce seconds for a group of ``size`` GPUs, ``per_node`` of them per node."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    from fiddlejax.collectives import cost, topology

    if size <= per_node:
        topo = topology.switch(size, nvlink, nvlat / 2)
        return cost.predict("ring", topo, nbytes)
    nodes = size // per_node
    topo = topology.multi_node(nodes, per_node, nic_bandwidth=nic, nvlink_bandwidth=nvlink)
    best = cost.predict("ring", topo, nbytes)
    if per_node > 1:
        best = min(best, cost.predict("hierarchical", topo, nbytes))
    return best


def allreduce_seconds(cluster: ClusterSpec, size: int, stride: int, nbytes: float) -> float:
    """Predicted all-reduce time of ``nbytes`` over ``size`` GPUs ``stride`` apart (mesh order
    is data-major, tensor innermost, so tensor groups are contiguous and data groups strided)."""
    if size <= 1:
        return 0.0
    per_node = max(1, cluster.gpus_per_node // stride) if stride < cluster.gpus_per_node else 1
    per_node = min(per_node, size)
    if size % per_node:
        per_node = 1
    return _allreduce(size, per_node, float(nbytes), cluster.nvlink_bandwidth,
                      cluster.nic_bandwidth, cluster.nvlink_latency)


# ----------------------------------------------------------------------------- memory


def vocab_parallel(layout: Layout) -> bool:
    """Whether the embedding and head run vocabulary-parallel over ``pipe`` x ``tensor``."""
    return layout.pipe > 1 and layout.head == "vocab-parallel"


def _outer_leaf(n: int, split: bool, layout: Layout) -> float:
    """One GPU's share of an outer parameter leaf of ``n`` elements."""
    if vocab_parallel(layout) and n >= VOCAB_PARALLEL_MIN:
        return n / (layout.pipe * layout.tensor)
    return n / layout.tensor if split else n


def outer_params(model: ModelSpec, layout: Layout) -> float:
    """Parameters outside the layer stack one GPU holds. A fiddlejax pipeline shards every such
    leaf of at least ``VOCAB_PARALLEL_MIN`` elements (embedding, head, a large position table)
    over ``pipe`` x ``tensor``, on every stage, because its prologue and head run
    vocabulary-parallel over all of them; smaller leaves (final norm) keep their tensor split
    or stay whole. ``head="last-stage"``: the first stage's embedding or the last stage's head,
    whichever is larger."""
    if layout.pipe > 1 and layout.head == "last-stage":
        t = layout.tensor
        return max(s / t + r for s, r in (model.prologue_params, model.epilogue_params))
    return sum(_outer_leaf(n, split, layout) for n, split in model.outer_param_leaves())


def stage_params(model: ModelSpec, layout: Layout) -> float:
    """Parameters one GPU holds (one weight version): its stage's layers split over tensor
    (biases and norms whole), and its share of the embedding and head (``outer_params``)."""
    t = layout.tensor
    stage_layers = (layout.virtual_stages * chunk_layers(model, layout) if layout.pipe > 1
                    else model.num_layers)
    ls, lr = model.layer_params
    return stage_layers * (ls / t + lr) + outer_params(model, layout)


def _weights_in_use(model: ModelSpec, layout: Layout) -> float:
    """Transient bytes of weights materialised for use: with FSDP, one layer gathered over
    ``data`` in the compute dtype, the next one prefetched, and its full-size float32 gradient
    before the reduce-scatter; or the embedding or head, gathered with its gradient (whichever
    is larger). Without FSDP, in bf16, the bf16 copy of the largest of those."""
    t, ab = layout.tensor, _act_bytes(layout)
    ls, lr = model.layer_params
    layer = ls / t + lr
    outer = max(_outer_leaf(n, split, layout) for n, split in model.outer_param_leaves())
    if layout.gathers_once:  # gathered in the compute dtype once per step: in ``params``
        return 0.0
    if layout.fsdp:
        return max(layer * (2 * ab + 4), outer * (ab + 4))
    return max(layer, outer) * ab if ab < 4 else 0.0


def memory(model: ModelSpec, layout: Layout) -> Memory:
    """Predicted bytes per GPU of a layout (see the module docstring for what is counted)."""
    t, p, d = layout.tensor, layout.pipe, layout.data
    pb, gb, ob = _bytes(layout)
    ab = _act_bytes(layout)
    lmax = chunk_layers(model, layout)
    n = stage_params(model, layout)
    # A pipeline adds each layer's weight gradient into the accumulator the optimizer reads,
    # in place (fiddlejax.pipeline.stage): one copy. Without a pipeline, microbatches scan
    # with an accumulator beside each microbatch's gradients: two.
    grads_copies = 1 if p > 1 or layout.microbatches == 1 else 2
    two_bw = layout.kind == "2bw"
    # 2bw: W(t) and W(t-1) in the state plus the program's stacked copy of both; a gradient
    # accumulator per version (two steps overlap) plus the reduced gradient.
    param_copies = 4 if two_bw else 1
    if two_bw:
        grads_copies = 3
    opt = n * ob / (d if layout.zero else 1)
    shard = d if layout.fsdp else 1  # ZeRO-3: parameters and gradients too
    # FSDP gathered once per step: the stage's weights held gathered in the compute dtype and
    # the gradients accumulated at full size, reduce-scattered into their shards at the end.
    gathered, grad_shard = 0.0, shard
    if layout.gathers_once:
        gathered, grads_copies, grad_shard = n * ab, grads_copies + 1 / d, 1
    mb = layout.microbatch_size
    per_layer = (model.stash_bytes if p > 1 else model.act_bytes)(layout.remat, t, ab) * mb
    held = held_microbatches(layout)
    if p > 1:
        # The stash buffer's ``held`` slots, a carry of the layer loops: each layer reads and
        # writes only its own slice in place, so no slot is copied out and back.
        stash = held * lmax * per_layer
        if layout.kind == "zb-h1":  # I keeps each layer's output cotangent until W
            stash += held * lmax * mb * model.boundary * ab
    else:
        stash = model.num_layers * per_layer
    # Transients: one layer's full residuals on this rank (a backward or a recomputation
    # materialises them) with the weights it uses, the fp32 logits and their gradient, and
    # (pipelines) the inboxes that receive activations and cotangents (sized by the schedule's
    # tick table). A vocabulary-parallel head runs between the stage programs, never beside a
    # layer: the larger of the two counts. It holds, besides its logits and their gradient, the
    # fresh float32 gradient of its weight shard (added into the accumulator after the matmul)
    # and, in bf16, the weight shard's compute-dtype copy.
    vocab_shards = t * p if vocab_parallel(layout) else t  # devices splitting the logits
    layer = mb * model.act_bytes("none", t, ab) + _weights_in_use(model, layout)
    if p > 1 and layout.kind not in ("zb-h1", "zb-v", "interleaved-zb"):  # B: a fresh layer
        # gradient is live beside the recomputed residuals until it is added in place
        ls, lr = model.layer_params
        layer += (ls / t + lr) * gb
    head = 2 * mb * model.logits / vocab_shards * 4
    if vocab_parallel(layout) and (not layout.fsdp or layout.gathers_once):
        outer = max(_outer_leaf(k, split, layout) for k, split in model.outer_param_leaves())
        head += outer * (gb + (ab if ab < 4 else 0))
    working = max(layer, head) if vocab_parallel(layout) else layer + head
    if p > 1:
        working += inbox_slots(layout) * mb * model.boundary * ab
    if two_bw:  # the update, computed inside the pipeline program; XLA keeps each further
        working += n * pb + (_steps(layout) - 1) * n * ob  # step's optimizer state (measured)
    return Memory(params=n * pb * param_copies / shard + gathered,
                  grads=n * gb * grads_copies / grad_shard,
                  optimizer=opt, activations=stash, working=working)


# ----------------------------------------------------------------------------- time


def vocab_allreduces(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> float:
    """Seconds per microbatch of the vocabulary-parallel prologue's and head's all-reduces:
    the embedding's output over pipe x tensor and its gradient to every stage over pipe
    (backward), the last stage's output to every stage over pipe and the head's input
    gradient over pipe x tensor; activation-sized. The softmax statistics ([rows, seq],
    float32) add three small ones over pipe x tensor."""
    t, p, mb = layout.tensor, layout.pipe, layout.microbatch_size
    act = mb * model.boundary * _act_bytes(layout)
    stats = mb * model.seq_len * 4
    return (2 * _closed_allreduce(cluster, p * t, 1, act)
            + 2 * _closed_allreduce(cluster, p, t, act)
            + 3 * _closed_allreduce(cluster, p * t, 1, stats))


def _closed_allreduce(cluster: ClusterSpec, size: int, stride: int, nbytes: float) -> float:
    """The faster of a ring at the group's slowest link and a hierarchical all-reduce (ring
    inside each node, ring over nodes on 1/k of the bytes): the closed forms of
    ``collectives.cost`` for groups of hundreds of GPUs, where its topology model is slow."""
    if size <= 1:
        return 0.0
    bw, lat = cluster.group_bandwidth(size, stride)
    best = 2 * (size - 1) * (lat + nbytes / size / bw)
    k = min(size, max(1, cluster.gpus_per_node // stride))
    nodes = size // k
    if 1 < k and nodes > 1 and size % k == 0:
        inner = 2 * (k - 1) * (cluster.nvlink_latency + nbytes / k / cluster.nvlink_bandwidth)
        outer = 2 * (nodes - 1) * (cluster.nic_latency
                                   + nbytes / k / nodes / cluster.nic_bandwidth)
        best = min(best, inner + outer)
    return best


def step_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
              simulate: bool = True) -> tuple[StepTime, float]:
    """(predicted step time breakdown, bubble fraction of the pipeline). ``simulate=False`` uses
    the schedules' closed-form bubbles (fast, for searching)."""
    gpu = cluster.gpu
    t, p, d, v, mb, m = (layout.tensor, layout.pipe, layout.data, layout.virtual_stages,
                         layout.microbatch_size, layout.microbatches)
    k = _steps(layout)
    ab = _act_bytes(layout)
    flop_rate = gpu.peak_flops * gpu.gemm_efficiency
    layers = _chunk_cost_scale(model, layout)
    # One layer, one microbatch, one tensor rank.
    mm = mb * model.layer_flops / t / flop_rate
    split, rep = model.act["none"]
    ew = mb * (split / t + rep) * ab * 2 / gpu.hbm_bandwidth
    ar = allreduce_seconds(cluster, t, 1, mb * model.boundary * ab) * model.tp_allreduces
    recompute = {"none": 0.0, "full": mm + ew}.get(layout.remat, ew)
    recompute_ar = ar if layout.remat == "full" else 0.0
    # Prologue and head: charged to every stage's chunk (the slowest stage sets the pace)
    # without a pipeline or with head="last-stage"; vocabulary-parallel, once per microbatch
    # outside the stages' switch on every device of pipe x tensor (serial with the ticks: all
    # devices take part), plus their activation-sized all-reduces (``vocab_allreduces``).
    head = mb * (model.epilogue_flops + model.prologue_flops) / t / flop_rate
    outside = 0.0
    if vocab_parallel(layout):
        head, outside = 0.0, 3 * head / p
    f_comp = layers * (mm + ew) + head
    b_comp = layers * (2 * (mm + ew) + recompute) + 2 * head
    f_ar = layers * ar
    b_ar = layers * (ar + recompute_ar)
    f, b = f_comp + f_ar, b_comp + b_ar  # zb-h1: I + W = b (W reuses I's cotangents)
    busy = m * v * (f + b)
    if p > 1:
        bw, lat = cluster.group_bandwidth(p, t)
        xfer = lat + mb * model.boundary * ab / bw
        makespan = _makespan(layout.kind, p, m, v, f, b, xfer, simulate, k) / k
    else:
        makespan = busy
    bubble = max(0.0, makespan - busy)
    pb, gb, ob = _bytes(layout)
    n_params = stage_params(model, layout)
    dp = allreduce_seconds(cluster, d, t * p, n_params * gb)
    if layout.zero in (1, 2) and d > 1:  # the updated shards all-gathered (half a ring
        # all-reduce of the parameters); ZeRO-2 reduce-scatters the gradients (the other half)
        dp = (dp / 2 if layout.zero == 2 else dp) + allreduce_seconds(cluster, d, t * p,
                                                                        n_params * pb) / 2
    if layout.fsdp:  # per microbatch: all-gather forward and backward, reduce-scatter (each
        # half a ring all-reduce) of the stage's weights, instead of one gradient all-reduce;
        # gathered once per step: one all-gather and one reduce-scatter
        gather = allreduce_seconds(cluster, d, t * p, n_params * ab) / 2
        scatter = allreduce_seconds(cluster, d, t * p, n_params * gb) / 2
        dp = gather + scatter if layout.gathers_once else m * (2 * gather + scatter)
    opt_bytes = n_params * (pb + gb + 2 * ob) / (d if layout.zero else 1)
    opt = opt_bytes / gpu.hbm_bandwidth
    vocab_ar = vocab_allreduces(model, cluster, layout) if vocab_parallel(layout) else 0.0
    time = StepTime(
        compute=m * (v * (f_comp + b_comp) + outside),
        tensor_comm=m * (v * (f_ar + b_ar) + vocab_ar), bubble=bubble,
        data_comm=dp, data_comm_exposed=dp * (1.0 - layout.dp_overlap), optimizer=opt)
    return time, (bubble / makespan if makespan else 0.0)


def predict(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
            simulate: bool = True) -> Prediction:
    """Predict ``layout`` for ``model`` on ``cluster`` (validates first)."""
    validate(layout, model, cluster)
    time, bubble = step_time(model, cluster, layout, simulate)
    return Prediction(model=model, cluster=cluster, layout=layout, time=time,
                      memory=memory(model, layout), bubble_fraction=bubble,
                      held=held_microbatches(layout))
