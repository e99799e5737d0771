"""Predicted step time of a layout: compute, communication and the pipeline's bubble.

One microbatch through one chunk (``layers / (pipe x virtual)`` layers) costs
  forward  = matmul FLOPs / (tensor x peak x gemm_efficiency)
           + elementwise bytes / achieved HBM bandwidth  (each residual written and read once)
           + tensor-parallel all-reduces                  (``collectives.cost``, on NVLink at the
                                                           bandwidth NCCL reaches, or NICs)
  backward = 2 x forward compute + the same all-reduces, plus the recomputation the remat policy
             implies (``full`` re-runs the forward; ``dots``/``minimal`` its elementwise part).
The schedule simulator (``pipeline.schedules.simulate``) runs the real action lists with those
F/B (or F/I/W) costs and the stage-to-stage transfer time as latency: its makespan minus the
stage's busy time is the bubble. ``2bw`` runs 1F1B over the K x m microbatches of
``steps_per_call`` = K optimizer steps without a flush: the simulator's makespan of that
schedule, divided by K, is the time per step, so the fill and drain are amortized over K
steps. The data-parallel gradient all-reduce follows (exposed, except the ``dp_overlap`` share,
which can hide at most under the last microbatch's backward), then the optimizer update (HBM
bound). Hidden communication (that share, and the context ring's transfers) still slows the
compute beneath it by ``GPUSpec.overlap_slowdown`` of its duration (``StepTime.contention``).
How a published run executed adds to this (``Layout`` docstring): blocking stage-to-stage
transfers (``p2p``), a gradient-accumulation pass per microbatch, fp16 reductions, a partition.

The embedding and head of a pipeline run vocabulary-parallel over every device of ``pipe`` x
``tensor`` once per microbatch, between the stage programs: each device pays 1/(pipe x tensor)
of their FLOPs, serially with the ticks, plus activation-sized all-reduces
(``vocab_allreduces``); ``head="last-stage"`` (Megatron's) charges them to every stage.

ZeRO-3 (FSDP) pays, per microbatch, an all-gather forward and backward and a reduce-scatter of
the stage's weights instead of one gradient all-reduce per step (``fsdp_gather="step"``: one
all-gather and one reduce-scatter per step). Attention as the target runs it
(``planner.attention``): cuDNN's fused kernel writes no s x s scores, XLA's pays their traffic.

fp8 (:func:`fp8_layer`): dense matmuls at the fp8 peak plus their quantization's HBM traffic.

zb-h1's I and W split one backward: I runs the input-gradient chain and keeps every layer's
output cotangent, W turns each into its layer's weight gradient (``Pipeline._layerwise_fns``),
so I + W cost one backward (I = W = B/2 in the simulator).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from fiddlejax.planner import attention, experts
from fiddlejax.planner.cluster import ClusterSpec
from fiddlejax.planner.footprint import (
    activation_bytes,
    chunk_cost_scale,
    schedule_steps,
    stage_expert_params,
    stage_params,
    state_bytes,
    vocab_parallel,
)
from fiddlejax.planner.fp8 import QUANT_BYTES
from fiddlejax.planner.space import Layout, schedule_for
from fiddlejax.planner.workload import ModelSpec

MAX_SIMULATED_ACTIONS = 20_000  # beyond this the bubble uses the schedule's closed form


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds per training step, split by cause; ``total`` is the predicted step time."""

    compute: float  # matmuls + elementwise + recomputation on the slowest stage
    tensor_comm: float  # tensor-parallel all-reduces and MoE all-to-alls (on the critical path)
    bubble: float  # pipeline fill/drain idle time, stage-to-stage transfers included
    data_comm: float  # the whole gradient reduction
    data_comm_exposed: float  # the part not hidden under the backward
    optimizer: float
    pipe_comm: float = 0.0  # blocking stage-to-stage transfers (``p2p`` "batched"/"blocking")
    contention: float = 0.0  # compute slowed by the communication hidden beneath it

    @property
    def total(self) -> float:
        return (self.compute + self.tensor_comm + self.bubble + self.data_comm_exposed
                + self.optimizer + self.pipe_comm + self.contention)

    @property
    def overlapped(self) -> float:
        return self.data_comm - self.data_comm_exposed

    def to_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        d["overlapped"] = self.overlapped
        return d


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


# ----------------------------------------------------------------------------- collectives


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
    return _allreduce(size, per_node, float(nbytes), cluster.nvlink_achieved,
                      cluster.nic_bandwidth, cluster.nvlink_latency)


def vocab_allreduces(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> float:
    """Seconds per microbatch of the vocabulary-parallel prologue's and head's all-reduces:
    the embedding's output over pipe x tensor and its gradient to every stage over pipe
    (backward), the last stage's output to every stage over pipe and the head's input
    gradient over pipe x tensor; activation-sized. The softmax statistics ([rows, seq],
    float32) add three small ones over pipe x tensor."""
    t, p, mb = layout.tensor, layout.pipe, layout.microbatch_size
    act = mb * model.boundary * activation_bytes(layout) / layout.context
    stats = mb * model.seq_len * 4 / layout.context
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
        inner = 2 * (k - 1) * (cluster.nvlink_latency + nbytes / k / cluster.nvlink_achieved)
        outer = 2 * (nodes - 1) * (cluster.nic_latency
                                   + nbytes / k / nodes / cluster.nic_bandwidth)
        best = min(best, inner + outer)
    return best


def ring_seconds(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> float:
    """Seconds one layer's forward spends passing K/V around the ``context`` ring, per
    microbatch: ``C - 1`` steps of one shard's keys and values (``2 x tokens / C x hidden``
    elements, split over ``tensor``; grouped-query attention sends less, so this is an upper
    bound) between neighbours ``tensor`` devices apart."""
    c = layout.context
    if c == 1:
        return 0.0
    bw, lat = cluster.group_bandwidth(c, layout.tensor)
    kv = 2 * layout.microbatch_size * model.seq_len / c * model.hidden / layout.tensor
    return (c - 1) * (lat + kv * activation_bytes(layout) / bw)


def _data_comm(cluster: ClusterSpec, model: ModelSpec, layout: Layout, n_params: float) -> float:
    """Seconds of the gradient reduction per step: the data-parallel all-reduce, ZeRO-1/2's
    all-gather of the updated shards, or FSDP's gathers and reduce-scatters; with Megatron's
    placement of a tied embedding, its all-reduce between the first and last stage. With an
    ``expert`` axis the dense weights reduce over ``data`` x ``expert`` (the expert group
    innermost, ``tensor`` devices apart), the experts' over ``data``."""
    t, p, e = layout.tensor, layout.pipe, layout.expert
    gb = layout.grad_bytes
    ex = stage_expert_params(model, layout) if e > 1 else 0.0
    dp = _reduction(cluster, layout, n_params - ex, layout.data * e,
                    t * layout.context if e > 1 else layout.data_stride)
    if ex:
        dp += _reduction(cluster, layout, ex, layout.data, layout.data_stride)
    if layout.context > 1:  # parameters are replicated over context: their gradients too
        sharded = layout.data if layout.zero >= 2 and layout.data > 1 else 1
        dp += allreduce_seconds(cluster, layout.context, t, n_params * gb / sharded)
    if layout.head == "last-stage" and p > 1 and model.tied:  # the first stage's embedding
        # and the last stage's copy (the head) sum their gradients once per step
        dp += allreduce_seconds(cluster, 2, (p - 1) * layout.pipe_stride,
                                model.prologue_params[0] / t * gb)
    return dp


def _reduction(cluster: ClusterSpec, layout: Layout, n_params: float, d: int,
               stride: int) -> float:
    """:func:`_data_comm`'s reduction of ``n_params`` over ``d`` replicas ``stride`` apart."""
    m = layout.microbatches
    pb, _, _ = state_bytes(layout)
    gb = layout.grad_bytes
    ab = activation_bytes(layout)
    dp = allreduce_seconds(cluster, d, stride, n_params * gb)
    if layout.zero in (1, 2) and d > 1:  # the updated shards all-gathered (half a ring
        # all-reduce of the parameters); ZeRO-2 reduce-scatters the gradients (the other half)
        dp = (dp / 2 if layout.zero == 2 else dp) + allreduce_seconds(cluster, d, stride,
                                                                        n_params * pb) / 2
    if layout.fsdp:  # per microbatch: all-gather forward and backward, reduce-scatter (each
        # half a ring all-reduce) of the stage's weights, instead of one gradient all-reduce;
        # gathered once per step: one all-gather and one reduce-scatter
        wide = layout.context if layout.pipe == 1 else 1  # context too (outside a pipeline);
        # over expert the dense weights' ``d`` is data x expert already
        g, gs = (d, stride) if wide == 1 else (d * wide, layout.tensor)
        gather = allreduce_seconds(cluster, g, gs, n_params * ab) / 2
        scatter = allreduce_seconds(cluster, g, gs, n_params * gb) / 2
        dp = gather + scatter if layout.gathers_once else m * (2 * gather + scatter)
    return dp


# ----------------------------------------------------------------------------- step time


def _stage_transfer(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
                    ab: float) -> tuple[float, float]:
    """(seconds a blocking exchange adds to each action, the transfer time the schedule's
    simulation waits between stages) for one microbatch's boundary activation."""
    bw, lat = cluster.group_bandwidth(layout.pipe, layout.pipe_stride)
    msg = layout.microbatch_size * model.boundary * ab
    if layout.p2p == "async":
        return 0.0, lat + msg / bw
    # Blocking transfers sit on the stage's critical path: each action waits for its exchange
    # (Megatron-LM 2021: batch_isend_irecv + cuda.synchronize, one send and one receive
    # batched; DeepSpeed's engine: a blocking receive, then a send). Both split the message
    # over the tensor ranks and all-gather it over NVLink.
    t = layout.tensor
    one = lat + msg / t / bw + allreduce_seconds(cluster, t, 1, msg) / 2
    return one * (1 if layout.p2p == "batched" else 2), lat


def fp8_layer(model: ModelSpec, cluster: ClusterSpec,
              layout: Layout) -> tuple[float, float, float]:
    """(matmul seconds, forward quantization seconds, backward quantization seconds) of one
    layer and one microbatch on one rank with ``matmul_dtype="fp8"``: the dense matmuls
    (``ModelSpec.dense``) at the fp8 peak, the rest (attention's scores and context, a MoE
    router, dropless experts) at the bf16 peak, both times ``gemm_efficiency``. Per-tensor
    current scaling is memory-bound elementwise work at the achieved HBM bandwidth,
    ``QUANT_BYTES`` per element: forward, each weight (once per microbatch) and each
    distinct input activation; backward, each dot's incoming gradient (to e5m2), the forward's
    fp8 weight and activation being reused. The amax's all-reduce over ``tensor`` (a scalar)
    is not counted."""
    gpu, dn = cluster.gpu, model.dense
    t, c, mb = layout.tensor, layout.context, layout.microbatch_size
    eff = gpu.gemm_efficiency
    total = model.layer_flops + experts.padded_flops(model, layout.expert, layout.dispatch)
    fp8 = dn.flops + (experts.padded_flops(model, layout.expert, layout.dispatch)
                      if model.moe is not None and model.moe.capacity_factor else 0.0)
    mm = mb * ((total - fp8) / (gpu.peak_flops * eff) + fp8 / (gpu.fp8_flops * eff)) / t / c
    weights = dn.weights / t + dn.expert_weights / (t * layout.expert)
    per = QUANT_BYTES / gpu.hbm_achieved
    q_fwd = (weights + mb * (dn.act[0] / t + dn.act[1]) / c) * per
    q_bwd = mb * (dn.grad[0] / t + dn.grad[1]) / c * per
    return mm, q_fwd, q_bwd


def _data_and_optimizer(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
                        n_params: float, f: float, b: float) -> tuple[float, float, float]:
    """(the data axis's gradient exchange, the part of it overlap hides, the optimizer's
    step) in seconds, for a stage whose chunk's forward and backward take ``f`` and ``b``."""
    m, v, d = layout.microbatches, layout.virtual_stages, layout.data
    pb, gb, ob = state_bytes(layout)
    dp = _data_comm(cluster, model, layout, n_params)
    # Overlap can hide the reduction only under the last microbatch's backward: gradients are
    # complete once it has run (Megatron-LM 2021's torch DDP: all-reduce in the last backward).
    # With the optimizer state sharded (zero 1/2), the updated shards' all-gather overlaps the
    # next step's first forward too (Megatron-Core's overlap_param_gather).
    window = v * (b + f) if layout.zero in (1, 2) else v * b
    if layout.fsdp and not layout.gathers_once:  # per-layer gathers and reduce-scatters
        window = m * v * (f + b)  # prefetched beside the neighbouring layers' compute
    hidden = min(dp * layout.dp_overlap, window)
    opt_bytes = n_params * (pb + gb + 2 * ob) / (d if layout.zero else 1)
    return dp, hidden, opt_bytes / cluster.gpu.hbm_achieved


def _layer_seconds(model: ModelSpec, cluster: ClusterSpec, layout: Layout) -> tuple[float, ...]:
    """One layer, one microbatch, one tensor rank (and 1/context of each sequence): (matmuls,
    forward, backward, recomputation, its exposed all-reduces and all-to-alls, their
    recomputation's, the context ring's transfers) in seconds."""
    gpu, t, mb, c = cluster.gpu, layout.tensor, layout.microbatch_size, layout.context
    ab = activation_bytes(layout)
    flop_rate = gpu.peak_flops * gpu.gemm_efficiency
    pad = experts.padded_flops(model, layout.expert, layout.dispatch)
    mm = mb * (model.layer_flops + pad) / t / c / flop_rate
    mm, q_fwd, q_bwd = (fp8_layer(model, cluster, layout) if layout.matmul_dtype == "fp8"
                        else (mm, 0.0, 0.0))
    split, rep = model.act["none"]
    rep = rep / t if layout.sequence_parallel else rep
    ew = mb * (split / t + rep) * ab * 2 / gpu.hbm_achieved / c
    # plus an MoE layer's dispatch and combine (the backward sends as much; full remat re-sends)
    ar = (allreduce_seconds(cluster, t, 1, mb * model.boundary * ab / c) * model.tp_allreduces
          + experts.alltoall_seconds(model, cluster, layout, mb * model.seq_len / c, ab))
    ring = ring_seconds(model, cluster, layout)
    fwd, bwd = mm + ew + q_fwd, 2 * (mm + ew) + q_bwd  # one layer, one microbatch
    recompute = {"none": 0.0, "full": fwd}.get(layout.remat, ew)
    recompute_ar = ar if layout.remat == "full" else 0.0
    return mm, fwd, bwd, recompute, ar, recompute_ar, ring


def step_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
              simulate: bool = True) -> tuple[StepTime, float]:
    """(predicted step time breakdown, bubble fraction of the pipeline). ``simulate=False`` uses
    the schedules' closed-form bubbles (fast, for searching)."""
    gpu = cluster.gpu
    model = attention.as_run(model, layout, cluster)  # fused: no s x s scores in HBM
    if layout.context > 1 and layout.attention == "fused":  # the ring's blocks in a fused
        model = attention.fused(model)  # kernel (Transformer Engine's context parallelism)
    t, p, v, mb, m = (layout.tensor, layout.pipe, layout.virtual_stages,
                      layout.microbatch_size, layout.microbatches)
    k = schedule_steps(layout)
    ab = activation_bytes(layout)
    layers, c = chunk_cost_scale(model, layout), layout.context
    mm, fwd, bwd, recompute, ar, recompute_ar, ring = _layer_seconds(model, cluster, layout)
    # Prologue and head: charged to every stage's chunk (the slowest stage sets the pace)
    # without a pipeline or with head="last-stage"; vocabulary-parallel, once per microbatch
    # outside the stages' switch on every device of pipe x tensor (serial with the ticks: all
    # devices take part), plus their activation-sized all-reduces (``vocab_allreduces``).
    # once per microbatch: with v chunks per stage, a share 1/v of it to each chunk
    head = (mb * (model.epilogue_flops + model.prologue_flops) / t / c / v
            / (gpu.peak_flops * gpu.gemm_efficiency))
    outside = 0.0
    if vocab_parallel(layout):
        head, outside = 0.0, 3 * head / p
    if layout.partition == "layers+head" and p > 1:
        # Megatron-DeepSpeed's type:transformer|embedding: the embedding and the head count as
        # a layer each when splitting, so the first and last stage hold one layer fewer.
        units = math.ceil((model.num_layers + 2) / p)
        per_layer = fwd + bwd + recompute + 2 * ar + recompute_ar
        layers, head = ((units, 0.0) if per_layer >= 3 * head
                        else (units - 1, head))
    f_comp = layers * fwd + head
    b_comp = layers * (bwd + recompute) + 2 * head
    n_params = stage_params(model, layout)
    if layout.grad_accumulation != "fused":  # each microbatch's gradient (compute dtype)
        # added into the accumulator by its own kernel: read both, write the accumulator;
        # cast-add first writes and reads a copy in the accumulator's dtype
        per = ab + (2 if layout.grad_accumulation == "separate" else 4) * layout.grad_bytes
        b_comp += n_params * per / gpu.hbm_achieved / v
    # The ring's transfers overlap the layer's compute: only what outlasts it is exposed
    # (forward: K/V; backward: K/V and their gradients, beside twice the compute).
    f_ar = layers * (ar + max(0.0, ring - mm))
    b_ar = layers * (ar + recompute_ar + max(0.0, 2 * ring - 2 * mm))
    # the compute beneath the hidden transfers runs slower (``GPUSpec.overlap_slowdown``)
    f_slow, b_slow = (layers * gpu.overlap_slowdown * min(r, c) for r, c in
                      ((ring, mm), (2 * ring, 2 * mm)))
    f, b = f_comp + f_ar + f_slow, b_comp + b_ar + b_slow  # zb-h1: I + W = b
    p2p = xfer = 0.0
    if p > 1:
        p2p, xfer = _stage_transfer(model, cluster, layout, ab)
        f, b = f + p2p, b + p2p
    busy = m * v * (f + b)
    if p > 1:
        makespan = _makespan(layout.kind, p, m, v, f, b, xfer, simulate, k) / k
    else:
        makespan = busy
    bubble = max(0.0, makespan - busy)
    dp, hidden, opt = _data_and_optimizer(model, cluster, layout, n_params, f, b)
    vocab_ar = vocab_allreduces(model, cluster, layout) if vocab_parallel(layout) else 0.0
    time = StepTime(
        compute=m * (v * (f_comp + b_comp) + outside),
        tensor_comm=m * (v * (f_ar + b_ar) + vocab_ar), bubble=bubble,
        data_comm=dp, data_comm_exposed=dp - hidden, optimizer=opt,
        pipe_comm=m * v * 2 * p2p,
        contention=m * v * (f_slow + b_slow) + hidden * gpu.overlap_slowdown)
    return time, (bubble / makespan if makespan else 0.0)
