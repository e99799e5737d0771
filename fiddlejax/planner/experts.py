"""Mixtures of experts in the planner: what the experts weigh, compute and send.

An MoE layer (``fiddlejax.models.moe``) replaces a decoder's MLP with ``E`` SwiGLU experts of
width ``f`` and a router; each token runs through ``k`` of them. So the parameters a GPU holds
count every expert (``3 h f E`` per layer, split over ``expert`` x ``tensor``, and over
``data`` with FSDP), while the FLOPs count only the active ones (``k`` experts and the router:
``2 s (3 h f k + h E)`` per layer and sample). Capacity dispatch computes its padded buffer:
``capacity_factor`` times that.

The ``expert`` mesh axis is more data parallelism outside the MoE layers (the batch splits over
``data x expert``; the dense weights' gradients reduce over both, the experts' over ``data``
only); inside them each token's hidden state travels by all-to-all to the devices owning its
experts and back: per MoE layer and microbatch, forward a dispatch and a combine of
``k x tokens x h`` elements each, of which a fraction ``(E_axis - 1) / E_axis`` leaves the
device, and the backward the same again (:func:`alltoall_bytes`), on the links the expert group
spans (``tensor`` devices apart: ``expert`` sits next to ``tensor`` in the mesh). The runtime
sends static buffers sized for the worst case (``parallel/expert.py``), so the bytes, the
experts' rows (FLOPs) and their activations are those times :func:`padding`.
"""

from __future__ import annotations

import dataclasses

from fiddlejax.planner import workload
from fiddlejax.planner.workload import ModelSpec, llama


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The experts of every layer: ``num_experts`` (E) SwiGLU MLPs of width ``expert_ffn``,
    ``top_k`` of them per token, dropless (``capacity_factor`` None) or with a capacity."""

    num_experts: int
    top_k: int
    expert_ffn: int
    capacity_factor: float | None = None
    biases: bool = False  # each expert's gate, up and down biases (GPT-OSS)
    outer_layers: int = 0  # MoE layers outside the stack (DeepSeek-V3's MTP modules)

    def one_expert(self, hidden: int) -> int:
        """Parameters of one expert: gate, up and down (and their biases)."""
        f = self.expert_ffn
        return 3 * hidden * f + ((2 * f + hidden) if self.biases else 0)

    def expert_params(self, hidden: int) -> int:
        """Parameters of one layer's experts (gate, up, down of each)."""
        return self.one_expert(hidden) * self.num_experts

    def outer_params(self, hidden: int) -> int:
        """Expert parameters of the MoE layers outside the stack (``outer_layers``): held
        like a stack layer's, split over ``expert`` x ``tensor``."""
        return self.outer_layers * self.expert_params(hidden)

    def active_params(self, hidden: int) -> int:
        """Parameters one token multiplies in one layer's MoE: ``k`` experts and the router."""
        return 3 * hidden * self.expert_ffn * self.top_k + hidden * self.num_experts


def active_params(model: ModelSpec) -> int:
    """Parameters one token uses: every parameter but the ``E - k`` experts it skips in each
    MoE layer (the stack's and ``MoESpec.outer_layers``); ``model.params`` for a dense one."""
    m = model.moe
    if m is None:
        return model.params
    skipped = (m.num_experts - m.top_k) * m.one_expert(model.hidden)
    return model.params - (model.num_layers + m.outer_layers) * skipped


def moe_llama(layers: int, hidden: int, heads: int, kv_heads: int, seq: int, vocab: int, *,
              experts: int, top_k: int, expert_ffn: int, capacity_factor: float | None = None,
              head_dim: int | None = None, tied: bool = False,
              name: str | None = None) -> ModelSpec:
    """A Llama-style decoder whose every MLP is an MoE layer (Mixtral, Qwen3-MoE).

    Attention as :func:`~fiddlejax.planner.workload.llama`; per layer the router ``h x E``
    (whole on every rank) and the experts (:meth:`MoESpec.expert_params`, split over
    ``expert`` x ``tensor``; ``ModelSpec.layer_share``). FLOPs per layer and sample: attention
    plus ``2 s (3 h f k + h E)`` (capacity: the expert part times the factor). Activations:
    Llama's with the MLP ``k x f`` wide (a token's ``k`` expert rows), plus per token the
    router's logits and probabilities (``2E``, float32) and the dispatched rows before and
    after the experts (``2 k h``, whole on every tensor rank).
    """
    for n, v in (("experts", experts), ("top_k", top_k), ("expert_ffn", expert_ffn)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{n}={v!r} must be a positive int")
    if top_k > experts:
        raise ValueError(f"top_k={top_k} exceeds experts={experts}; use top_k <= {experts}")
    cf = capacity_factor
    if cf is not None and (not isinstance(cf, int | float) or cf <= 0):
        raise ValueError(f"capacity_factor={cf!r} must be positive (or None: dropless)")
    moe = MoESpec(experts, top_k, expert_ffn, cf)
    base = llama(layers, hidden, heads, kv_heads, top_k * expert_ffn, seq, vocab,
                 head_dim=head_dim, tied=tied, name=name)
    h, s, e, k, f = hidden, seq, experts, top_k, expert_ffn
    split, rep = base.layer_params
    mlp = 3 * h * base.ffn  # the dense MLP llama() counted at width k x f
    extra = {"none": 2 * e + 2 * k * h, "dots": 2 * k * h, "dots_no_batch": 2 * k * h,
             "minimal": 2 * k * h, "full": 0}
    act = {p: (sp, rp + extra[p] * s) for p, (sp, rp) in base.act.items()}
    f32 = {p: v + (2 * e * s if p == "none" else 0) for p, v in base.act_f32.items()}
    dense_mlp_flops = 2.0 * s * mlp
    # fp8 (fiddlejax.compute.fp8): attention's projections; the experts only with capacity dispatch
    # (einsums; dropless ragged_dot stays bf16); never the router
    attn = base.dense.weights - mlp
    q = base.dense.act[0] / s - base.ffn
    dense = workload.DenseMatmuls(flops=2.0 * s * attn, weights=attn, act=(q * s, h * s),
                                  grad=((base.dense.grad[0] / s - 2 * base.ffn) * s, h * s))
    if cf is not None:  # k x cf rows per token through gate/up (input h) and down (input f)
        rows = k * cf * s
        dense = dataclasses.replace(
            dense, flops=dense.flops + dense_mlp_flops * cf, expert_weights=3 * h * f * e,
            act=(dense.act[0] + rows * f, dense.act[1] + rows * h),
            grad=(dense.grad[0] + 2 * rows * f, dense.grad[1] + rows * h))
    return dataclasses.replace(
        base, dense=dense, name=name or f"moe-l{layers}-h{hidden}-e{experts}k{top_k}",
        layer_params=(split - mlp, rep + h * e), moe=moe,
        layer_flops=(base.layer_flops - dense_mlp_flops + dense_mlp_flops * (cf or 1.0)
                     + 2.0 * s * h * e),
        act=act, act_f32=f32, act_none_full=float(sum(act["none"])), ffn=f)


# name: (layers, hidden, heads, kv_heads, seq, vocab, experts, top_k, expert_ffn, head_dim)
MOE_PRESETS: dict[str, tuple[int, ...]] = {
    "mixtral-8x7b": (32, 4096, 32, 8, 4096, 32000, 8, 2, 14336, 128),
    "mixtral-8x22b": (56, 6144, 48, 8, 4096, 32768, 8, 2, 16384, 128),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 4096, 151936, 128, 8, 768, 128),
}


def preset(name: str, seq: int | None = None) -> ModelSpec:
    """A preset by name, at its own sequence length or ``seq``: an MoE one (``MOE_PRESETS``)
    or a dense one (``workload.preset``)."""
    if name not in MOE_PRESETS:
        if name not in (*workload.PRESETS, *workload.LLAMA_PRESETS):
            raise ValueError(f"unknown model preset {name!r}; presets: "
                             f"{', '.join([*workload.PRESETS, *workload.LLAMA_PRESETS])}, "
                             f"{', '.join(MOE_PRESETS)} (or --model gpt or llama with "
                             "--layers/--hidden/--heads/--seq/--vocab)")
        return workload.preset(name, seq)
    layers, h, a, kv, s, v, e, k, f, dh = MOE_PRESETS[name]
    return moe_llama(layers, h, a, kv, seq or s, v, experts=e, top_k=k, expert_ffn=f,
                     head_dim=dh, name=name)


ROW_ACTS = {"none": 5, "dots": 2, "dots_no_batch": 2, "minimal": 2, "full": 0}  # x k f per token


def padding(model: ModelSpec, expert: int, dispatch: str = "static") -> float:
    """Rows the runtime dispatches over the real (token, choice) pairs. With static shapes
    (``parallel/expert.py``) each device sends every device of the group a buffer of
    ``tokens x min(k, E / S)`` rows (the most one destination can get), so its experts run
    ``S x min(k, E / S) / k`` times the rows of their real pairs: 4x for Mixtral on S = 8.
    1 without the axis, and for ``dispatch="dropless"`` (a runtime that sends each device
    only its real pairs: Megatron-Core's and DeepEP's token dispatchers, grouped GEMMs)."""
    if model.moe is None or expert == 1 or dispatch == "dropless":
        return 1.0
    k, e = model.moe.top_k, model.moe.num_experts
    return expert * min(k, e // expert) / k


def alltoall_bytes(model: ModelSpec, tokens: float, expert: int, nbytes: int,
                   padded: bool = True) -> float:
    """Bytes one device sends per MoE layer forward (the backward sends as many again):
    dispatch and combine, each ``k x tokens x hidden`` elements of ``nbytes``, the share
    ``(expert - 1) / expert`` bound for other devices of the group; ``padded``: times the
    runtime's static buffers (:func:`padding`)."""
    if model.moe is None or expert == 1:
        return 0.0
    ideal = 2 * model.moe.top_k * tokens * model.hidden * nbytes * (expert - 1) / expert
    return ideal * (padding(model, expert) if padded else 1.0)


def padded_flops(model: ModelSpec, expert: int, dispatch: str = "static") -> float:
    """Forward FLOPs per sample the padding rows add to one layer's experts."""
    if model.moe is None:
        return 0.0
    m = model.moe
    return (padding(model, expert, dispatch) - 1) * 2.0 * model.seq_len * 3 * model.hidden \
        * m.expert_ffn * m.top_k * (m.capacity_factor or 1.0)


def padded_activations(model: ModelSpec, policy: str, tensor: int, expert: int,
                       dispatch: str = "static") -> float:
    """Activation elements per sample the padding rows add to one MoE layer on one rank
    under ``policy``: the expert rows' (``ROW_ACTS`` x ``k f`` split over ``tensor``, and the
    dispatched rows before and after the experts, ``2 k h`` whole) times the extra rows."""
    extra = padding(model, expert, dispatch) - 1
    if not extra or policy not in ROW_ACTS:
        return 0.0
    m, h = model.moe, model.hidden
    per_token = ROW_ACTS[policy] * m.top_k * m.expert_ffn / tensor + (
        2 * m.top_k * h if ROW_ACTS[policy] else 0)
    return extra * per_token * model.seq_len


def alltoall_seconds(model: ModelSpec, cluster, layout, tokens: float, nbytes: int) -> float:
    """Seconds of one MoE layer's forward all-to-alls (dispatch and combine) for ``tokens``
    tokens on a device: each device sends its share at the expert group's bandwidth (the
    slowest link the group spans), one message to each of the ``E_axis - 1`` others."""
    e = layout.expert
    if model.moe is None or e == 1:
        return 0.0
    bw, lat = cluster.group_bandwidth(e, layout.tensor)
    return 2 * (e - 1) * lat + alltoall_bytes(model, tokens, e, nbytes,
                                              padded=layout.dispatch == "static") / bw


def expert_sizes(model: ModelSpec, gpus: int) -> list[int]:
    """``expert`` axis sizes to search: divisors of the experts that divide the GPUs (1 for
    a dense model)."""
    if model.moe is None:
        return [1]
    e = model.moe.num_experts
    return [x for x in range(1, e + 1) if e % x == 0 and gpus % x == 0]


__all__ = ["MOE_PRESETS", "MoESpec", "active_params", "alltoall_bytes", "alltoall_seconds",
           "expert_sizes", "moe_llama", "padded_activations", "padded_flops", "padding", "preset"]
