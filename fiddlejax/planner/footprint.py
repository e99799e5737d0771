"""Predicted memory per GPU of a layout: what each rank holds, and what the schedule keeps.

Parameters, gradients and optimizer state from the parameter counts, with what each rank holds:
layer weights split over ``tensor`` (biases and norms whole; an MoE layer's experts over
``expert`` x ``tensor``), the stage's
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
compute dtype; cuDNN's fused attention keeps none, but its backward holds a float32 dQ
accumulator: ``planner.attention``) with the weights it uses (and, for a whole backward in a
pipeline, that layer's fresh float32 gradient before it is added in place), the logits, the
pipeline inboxes. A vocabulary-parallel head never runs beside a layer, so the larger of the
two counts; it holds its float32 logits and their gradient, its weight shard's fresh float32
gradient (before it is added into the accumulator) and, in bf16, the shard's bf16 copy. The
stash stores 16-bit residuals as their bits, so XLA's CPU compile (which computes bf16 in
float32) holds what a GPU does with the same attention: ``attention="xla"`` predicts the CPU's
compile. With fp8 matmuls the working set adds one layer's fp8 weights and quantized
activations (``fp8_copies``).

Precision and ZeRO as the runtime does them. ``bf16-mixed`` (``Plan(compute_dtype=
"bfloat16")``) keeps float32 parameters, gradients and Adam moments in the state and halves the
activations, stashes and messages; each layer's bf16 weight copy is a transient. ``zero=1``
divides the optimizer state by ``data``; ``zero=3`` (FSDP) divides parameters, gradients and
optimizer state (by ``data``, and by ``context`` too outside a pipeline), and adds to the
working set what one layer's use materialises: the gathered weights in the compute dtype,
the next layer's prefetched, and the full-size float32 weight gradient before its
reduce-scatter (or the embedding or head with its gradient, if larger).
Gathered once per step (``fsdp_gather="step"``) the stage's weights are held gathered in the
compute dtype and its gradient accumulated at full size in float32 (plus its reduce-scattered
shard).

2bw (``Pipeline.train_2bw``) adds, per GPU, the second weight version (W(t-1), in the state),
the program's stacked copy of both versions, a gradient accumulator per version (two steps
overlap) and the optimizer update applied inside the program: with the reduced gradient 1F1B
already holds, parameters 4x, gradients 3x, and one parameter-sized update in the working set.
Optimizer state is 1F1B's (``zero=1`` is refused); the activation stash is 1F1B's over K x m.
Each further step of a K-step call adds one optimizer state to the working set: XLA does not
reuse the buffers of the unrolled steps' updates (measured at (1, 4, 2) with AdamW, whose state
is 2 parameter copies: 1.1 to 1.9 copies per further step for K = 2..8; with SGD, 1.7 copies
once K >= 3, not modelled).
"""

from __future__ import annotations

import dataclasses
import math

from fiddlejax.pipeline.schedules import interleaves
from fiddlejax.planner import attention, experts
from fiddlejax.planner.attention import SCORE_COPIES
from fiddlejax.planner.cluster import ClusterSpec
from fiddlejax.planner.space import MAX_BUILT_ACTIONS, Layout, schedule_for
from fiddlejax.planner.workload import ModelSpec

VOCAB_PARALLEL_MIN = 65_536  # the pipeline shards outer leaves this large over pipe x tensor


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


# ----------------------------------------------------------------------------- shares


def state_bytes(layout: Layout) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter: float32 in ``fp32`` and
    ``bf16-mixed`` (which keeps float32 master weights in the state and casts each layer to
    bf16 just before use, a transient counted in the working set); ``bf16`` parameters hold 2
    bytes and so do each of Adam's moments, their gradients accumulate in float32."""
    if layout.master == "optimizer":  # Megatron-Core: bf16 weights, fp32 main_grad, fp32
        return 2, 4, 12 if layout.optimizer == "adam" else 4  # master + moments in the state
    if layout.precision == "bf16":  # 16-bit parameters: moments follow, gradients float32
        return 2, 4, (4 if layout.optimizer == "adam" else 0)
    return 4, 4, (8 if layout.optimizer == "adam" else 0)


def activation_bytes(layout: Layout) -> int:
    """Bytes per activation element in the layout's compute dtype."""
    return 4 if layout.precision == "fp32" else 2


def layer_activations(model: ModelSpec, layout: Layout, policy: str,
                      stashed: bool = False, live: bool = False) -> float:
    """Bytes one layer keeps per sample on one rank (``stashed``: as a pipeline stashes them):
    the model's figure over ``tensor``, its replicated part split over ``tensor`` too under
    sequence parallelism. Split over ``context``, each device holds 1/C of every token-wise
    activation, and the ring keeps no score block for the backward (each is recomputed);
    ``live`` (the working set of a backward) adds what its tiled kernel holds
    (:func:`_ring_live`)."""
    t, c, ab = layout.tensor, layout.context, activation_bytes(layout)
    raw = (model.stash_bytes if stashed else model.act_bytes)(policy, t, ab)
    raw += experts.padded_activations(model, policy, t, layout.expert,
                                      layout.dispatch) * ab
    if layout.sequence_parallel:
        rep = (model.act_stashed if stashed and policy == "none" and model.act_stashed
               else model.act[policy])[1]
        raw -= rep * (1 - 1 / t) * ab
    if c == 1 or model.heads is None:
        return raw / c
    square = model.heads / t * float(model.seq_len) ** 2
    scores = SCORE_COPIES.get(policy, 0) * square
    f32 = model.act_f32.get(policy, 0.0) / t
    raw -= (scores - f32) * ab + f32 * 4  # XLA's whole-sequence scores: not in the ring
    return raw / c + (_ring_live(model, layout) if live else 0.0)


ATTENTION_TILE = 1024  # fiddlejax.parallel.flash.TILE (tests/test_flash.py checks they agree)


def _ring_live(model: ModelSpec, layout: Layout) -> float:
    """Bytes per sample the context kernels add to a layer's backward: one tile of float32
    scores (scores, probabilities and their gradients: 4 copies; a block of n = seq / 2C is
    cut into tiles of at most ``ATTENTION_TILE``, ``fiddlejax.parallel.flash``), and the
    local queries' float32 output, its gradient and the queries' gradient (the ring's
    backward keeps the output and log-sum-exp, nothing per block)."""
    t, n = layout.tensor, model.seq_len // (2 * layout.context)
    tile = max(d for d in range(1, min(n, ATTENTION_TILE) + 1) if n % d == 0)
    per_query = 3 * 4 * model.hidden / t * model.seq_len / layout.context
    return 4 * 4 * model.heads / t * tile * tile + per_query


def schedule_steps(layout: Layout) -> int:
    """Optimizer steps one schedule spans (K for ``2bw``, else 1)."""
    return layout.steps_per_call if layout.kind == "2bw" else 1


def chunk_layers(model: ModelSpec, layout: Layout) -> int:
    """Layers in the largest chunk; with per-layer costs, PipeDream's balanced partition (over
    the schedule's placement, as the runtime's: ``grouping.for_plan``)."""
    chunks = layout.pipe * layout.virtual_stages
    if model.layer_costs is None:
        return math.ceil(model.num_layers / chunks)
    from fiddlejax.pipeline.partition import balanced

    return max(balanced(list(model.layer_costs), chunks, placement=stage_placement(layout)))


def chunk_cost_scale(model: ModelSpec, layout: Layout) -> float:
    """The slowest chunk's cost in average layers (uneven layers): of several a stage, their
    mean (their sum sets the stage's pace)."""
    if model.layer_costs is None:
        return float(chunk_layers(model, layout))
    from fiddlejax.pipeline.partition import balanced, stage_loads

    costs, place = list(model.layer_costs), stage_placement(layout)
    counts = balanced(costs, layout.pipe * layout.virtual_stages, placement=place)
    slowest = max(stage_loads(counts, costs, place)) / layout.virtual_stages
    return slowest / (sum(costs) / len(costs))


def stage_placement(layout: Layout) -> tuple[int, ...] | None:
    """Chunk -> stage of the layout's schedule, where a stage holds several chunks."""
    if layout.pipe == 1 or layout.virtual_stages == 1:
        return None
    return schedule_for(layout.kind, layout.pipe, layout.microbatches,
                        layout.virtual_stages).placement


def held_microbatches(layout: Layout) -> int:
    """Peak (microbatch, chunk) activations a stage holds, from the schedule itself."""
    if layout.pipe == 1:
        return 1
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    k = schedule_steps(layout)
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
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    k = schedule_steps(layout)
    if p == 1:
        return 0
    if p * m * v * k > MAX_BUILT_ACTIONS:
        return 3
    peaks = schedule_for(layout.kind, p, m, v, k).ticks.inbox_peak
    return max(a for a, _ in peaks) + max(g for _, g in peaks) + 1


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
    whichever is larger. Experts outside the stack (DeepSeek-V3's MTP modules,
    ``MoESpec.outer_layers``) split over ``expert`` x ``tensor`` on every GPU."""
    ex = _outer_experts(model, layout)
    if layout.pipe > 1 and layout.head == "last-stage":
        t = layout.tensor
        return ex + max(s / t + r for s, r in (model.prologue_params, model.epilogue_params))
    return ex + sum(_outer_leaf(n, split, layout) for n, split in model.outer_param_leaves())


def _outer_experts(model: ModelSpec, layout: Layout) -> float:
    """One GPU's share of the experts outside the stack (``MoESpec.outer_layers``)."""
    if model.moe is None:
        return 0.0
    return model.moe.outer_params(model.hidden) / (layout.tensor * layout.expert)


def stage_params(model: ModelSpec, layout: Layout) -> float:
    """Parameters one GPU holds (one weight version): its stage's layers split over tensor
    (biases and norms whole), and its share of the embedding and head (``outer_params``); with
    ``partition="layers+head"``, the larger of a middle stage and the embedding's."""
    t = layout.tensor
    stage_layers = (layout.virtual_stages * chunk_layers(model, layout) if layout.pipe > 1
                    else model.num_layers)
    layer, outer = model.layer_share(t, layout.expert), outer_params(model, layout)
    if layout.partition == "layers+head" and layout.pipe > 1:  # the embedding (head) stage
        units = math.ceil((model.num_layers + 2) / layout.pipe)  # holds one layer fewer
        return max(units * layer, (units - 1) * layer + outer)
    return stage_layers * layer + outer


def stage_expert_params(model: ModelSpec, layout: Layout) -> float:
    """Expert parameters one GPU holds (its stage's layers' share over ``expert`` x
    ``tensor``): they reduce their gradients over ``data`` only."""
    if model.moe is None:
        return 0.0
    layers = (layout.virtual_stages * chunk_layers(model, layout) if layout.pipe > 1
              else model.num_layers)
    return (layers * model.moe.expert_params(model.hidden) / (layout.tensor * layout.expert)
            + _outer_experts(model, layout))


def fsdp_held(model: ModelSpec, layout: Layout, n: float) -> float:
    """Of ``n`` parameters (a GPU's, :func:`stage_params`), those it stores: all of them
    without ZeRO-3; with it, the dense ones over ``layout.fsdp_shards`` and the experts'
    (split over ``expert`` already) over ``data`` (x ``context``) alone."""
    if not layout.fsdp:
        return n
    ex = stage_expert_params(model, layout) if layout.expert > 1 and layout.pipe == 1 else 0.0
    return (n - ex) / layout.fsdp_shards + ex * layout.expert / layout.fsdp_shards


# ----------------------------------------------------------------------------- memory


def memory(model: ModelSpec, layout: Layout, cluster: ClusterSpec | None = None) -> Memory:
    """Predicted bytes per GPU of a layout (see the module docstring for what is counted),
    its attention as ``layout.attention`` says on ``cluster`` (``planner.attention``)."""
    fused = attention.kind(model, layout, cluster) == "fused"
    model = attention.fused(model) if fused else model
    p, d = layout.pipe, layout.data
    pb, gb, ob = state_bytes(layout)
    ab = activation_bytes(layout)
    n = stage_params(model, layout)
    # A pipeline adds each layer's weight gradient into the accumulator the optimizer reads,
    # in place (fiddlejax.pipeline.stage): one copy. Without a pipeline, microbatches scan
    # with an accumulator beside each microbatch's gradients: two.
    grads_copies = 1 if p > 1 or layout.microbatches == 1 or layout.master == "optimizer" else 2
    two_bw = layout.kind == "2bw"
    # 2bw: W(t) and W(t-1) in the state plus the program's stacked copy of both; a gradient
    # accumulator per version (two steps overlap) plus the reduced gradient.
    param_copies = 4 if two_bw else 1
    if two_bw:
        grads_copies = 3
    held = fsdp_held(model, layout, n)  # ZeRO-3: parameters and gradients too
    # Megatron-Core's distributed optimizer shards over data x context (its dp-cp group)
    dc = d * layout.context if layout.master == "optimizer" else d
    opt = held * ob if layout.fsdp else n * ob / (dc if layout.zero else 1)
    # FSDP gathered once per step: the stage's weights held gathered in the compute dtype and
    # the gradients accumulated at full size, reduce-scattered into their shards at the end.
    gathered, grads_held = 0.0, held
    if layout.gathers_once:
        gathered, grads_copies, grads_held = n * ab, grads_copies + 1 / d, n
    return Memory(params=held * pb * param_copies + gathered,
                  grads=grads_held * gb * grads_copies,
                  optimizer=opt, activations=_stash(model, layout),
                  working=_working_set(model, layout, n, fused))


def _stash(model: ModelSpec, layout: Layout) -> float:
    """Bytes of the activations kept from forward to backward (the schedule's held chunks)."""
    p, ab, mb = layout.pipe, activation_bytes(layout), layout.microbatch_size
    per_layer = layer_activations(model, layout, layout.remat, stashed=p > 1) * mb
    if p == 1:
        return model.num_layers * per_layer
    # The stash buffer's ``held`` slots, a carry of the layer loops: each layer reads and
    # writes only its own slice in place, so no slot is copied out and back.
    held, lmax = held_microbatches(layout), chunk_layers(model, layout)
    stash = held * lmax * per_layer
    if layout.kind == "zb-h1":  # I keeps each layer's output cotangent until W
        stash += held * lmax * mb * model.boundary * ab / layout.context
    return stash


def _working_set(model: ModelSpec, layout: Layout, n: float, fused: bool = False) -> float:
    """Transient bytes: one layer's full residuals on this rank (a backward or a recomputation
    materialises them) with the weights it uses, the fp32 logits and their gradient, and
    (pipelines) the inboxes that receive activations and cotangents (sized by the schedule's
    tick table). A vocabulary-parallel head runs between the stage programs, never beside a
    layer: the larger of the two counts. It holds, besides its logits and their gradient, the
    fresh float32 gradient of its weight shard (added into the accumulator after the matmul)
    and, in bf16, the weight shard's compute-dtype copy. ``n``: the stage's parameters;
    ``fused``: attention's fused backward adds its float32 dQ accumulator."""
    t, p, mb = layout.tensor, layout.pipe, layout.microbatch_size
    pb, gb, ob = state_bytes(layout)
    ab = activation_bytes(layout)
    vocab_shards = t * p if vocab_parallel(layout) else t  # devices splitting the logits
    layer = (mb * layer_activations(model, layout, "none", live=True)
             + _weights_in_use(model, layout))
    layer += fp8_copies(model, layout)
    layer += mb * attention.live_bytes(model, layout) if fused else 0.0
    if p > 1 and layout.kind not in ("zb-h1", "zb-v", "interleaved-zb"):  # B: a fresh layer
        # gradient is live beside the recomputed residuals until it is added in place
        layer += model.layer_share(t, layout.expert) * gb
    head = 2 * mb * model.logits / vocab_shards * 4 / layout.context
    if vocab_parallel(layout) and (not layout.fsdp or layout.gathers_once):
        outer = max(_outer_leaf(k, split, layout) for k, split in model.outer_param_leaves())
        head += outer * (gb + (ab if ab < 4 else 0))
    # without a pipeline the head's forward and backward end before the first layer's
    # backward begins: its logits are never live beside a layer's residuals either
    working = max(layer, head) if vocab_parallel(layout) or p == 1 else layer + head
    if p > 1:
        working += inbox_slots(layout) * mb * model.boundary * ab / layout.context
    if layout.kind == "2bw":  # the update, computed inside the pipeline program; XLA keeps
        # each further step's optimizer state (measured)
        working += n * pb + (schedule_steps(layout) - 1) * n * ob
    return working


def fp8_copies(model: ModelSpec, layout: Layout) -> float:
    """Bytes of one layer's fp8 operands (``matmul_dtype="fp8"``): its dense weights and
    quantized input activations, one byte each, live while that layer runs (a transient
    beside its residuals). What the backward keeps of them across layers without remat
    (qwix's residuals) is not counted."""
    dn = model.dense
    if layout.matmul_dtype != "fp8" or dn is None:
        return 0.0
    t = layout.tensor
    acts = layout.microbatch_size * (dn.act[0] / t + dn.act[1]) / layout.context
    return dn.weights / t + dn.expert_weights / (t * layout.expert) + acts


def _weights_in_use(model: ModelSpec, layout: Layout) -> float:
    """Transient bytes of weights materialised for use: with FSDP, one layer gathered over
    ``data`` in the compute dtype, the next one prefetched, and its full-size float32 gradient
    before the reduce-scatter; or the embedding or head, gathered with its gradient (whichever
    is larger). Without FSDP, in bf16, the bf16 copy of the largest of those."""
    t, ab = layout.tensor, activation_bytes(layout)
    pb = state_bytes(layout)[0]
    layer = model.layer_share(t, layout.expert)
    outer = max(_outer_leaf(n, split, layout) for n, split in model.outer_param_leaves())
    if layout.gathers_once:  # gathered in the compute dtype once per step: in ``params``
        return 0.0
    if layout.fsdp:
        return max(layer * (2 * ab + 4), outer * (ab + 4))
    return max(layer, outer) * ab if ab < pb else 0.0
