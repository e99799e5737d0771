"""The frontier families ``fiddlejax.models`` trains, priced: DeepSeek-V3 (Kimi K2) and GPT-OSS.

Both are built on :func:`~fiddlejax.planner.experts.moe_llama` (its activation tables, measured
for a Llama-style block) with their own parameters and FLOPs:

- :func:`deepseek_v3` (``models.deepseek``): multi-head latent attention (``models.mla``:
  low-rank queries or one projection, a compressed K/V latent with the decoupled rotary key,
  value heads narrower than query/key ones), routed experts plus ``shared`` always-on ones,
  the router and its selection bias. As the library stages it, the stack is the MoE layers;
  the first ``dense_layers`` (dense SwiGLU ``ffn`` wide) run in the prologue with the
  embedding, and the ``mtp`` multi-token-prediction modules (``models.mtp``: two norms,
  ``eh_proj [2d, d]``, an MoE block, the head's norm; the embedding and head shared) in the
  loss after the head. Their parameters and FLOPs are priced there (their experts, like the
  stack's, split over ``expert`` x ``tensor``: ``MoESpec.outer_layers``).
- :func:`gpt_oss` (``models.gpt_oss``): grouped-query attention with q/k/v/o biases, a sink
  logit per head, sliding-window (``window``) and full layers alternating (the first one
  windowed), experts with biases.

Attention FLOPs as the library runs it: MLA's call pads queries, keys and values to one head
width ``max(qk_head_dim, v_head_dim)`` (``models.mla``), so ``4 s^2 a w``; a window layer's
are bounded by the window (``4 s min(s, window) a dh``, what a windowed kernel computes;
XLA's CPU attention computes the whole masked square), and the stack's ``layer_flops`` is the
mean over the two kinds. Not priced (each well under 0.1% of a layer): the sinks' FLOPs and
their ``a`` logits' softmax, the biases' adds, norms, RoPE and the router's top-k.
Activations: ``moe_llama``'s at the padded head width, plus the shared experts' rows
(``experts.ROW_ACTS``) and MLA's latents (whole on every tensor rank); the prologue's dense
layers and the MTP block keep activations that are not counted (as for every model's
prologue and loss: 4 of DeepSeek-V3's 62 layers). fp8 matmuls are not described for these
families (``ModelSpec.dense`` None: refused by name).
"""

from __future__ import annotations

import dataclasses

from fiddlejax.planner import experts
from fiddlejax.planner.experts import MoESpec, moe_llama
from fiddlejax.planner.workload import ModelSpec


def mla_params(hidden: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int,
               rope_dim: int, nope_dim: int, v_dim: int) -> tuple[int, int]:
    """(split over tensor, whole) parameters of one latent attention and its two norms:
    ``wq_b`` (or ``wq``), ``wkv_b`` and ``wo`` split by heads; ``wq_a``, ``wkv_a``, the
    latent norms and the layer norms whole (``models.mla``)."""
    d, a, dq = hidden, heads, nope_dim + rope_dim
    split = (q_lora_rank if q_lora_rank else d) * a * dq + kv_lora_rank * a * (nope_dim + v_dim) \
        + a * v_dim * d
    whole = (d * q_lora_rank + q_lora_rank if q_lora_rank else 0) \
        + d * (kv_lora_rank + rope_dim) + kv_lora_rank + 2 * d
    return split, whole


def deepseek_v3(layers: int, hidden: int, heads: int, seq: int, vocab: int, *, ffn: int,
                num_experts: int, top_k: int, expert_ffn: int, shared: int = 1,
                dense_layers: int = 3, q_lora_rank: int | None = 1536, kv_lora_rank: int = 512,
                rope_dim: int = 64, nope_dim: int = 128, v_dim: int = 128, mtp: int = 0,
                tied: bool = False, name: str | None = None) -> ModelSpec:
    """``models.deepseek.DeepseekV3`` (module docstring): ``layers`` in all, the first
    ``dense_layers`` dense, ``mtp`` MTP modules.

    FLOPs per sample: an MoE layer ``2 s (M + 3 d f (k + shared) + d E) + 4 s^2 a w`` with
    ``M`` the attention's matmul weights and ``w = max(nope + rope, v)``; a dense layer the
    same with ``3 d ffn`` for the experts and router; an MTP module an MoE layer plus
    ``2 s (2 d^2 + d V)`` (its projection and its logits through the shared head).
    """
    for n, v in (("dense_layers", dense_layers), ("shared", shared), ("mtp", mtp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{n}={v!r} must be an int >= 0")
    if not 0 <= dense_layers < layers:
        raise ValueError(f"dense_layers={dense_layers} must be below layers={layers} (at least "
                         "one MoE layer)")
    d, a, s, v, e, k, f = hidden, heads, seq, vocab, num_experts, top_k, expert_ffn
    dq = nope_dim + rope_dim
    w = max(dq, v_dim)  # the attention call's one head width (models.mla pads to it)
    base = moe_llama(layers - dense_layers, d, a, a, s, v, experts=e, top_k=k, expert_ffn=f,
                     head_dim=w, tied=tied, name=name)
    split, whole = mla_params(d, a, q_lora_rank, kv_lora_rank, rope_dim, nope_dim, v_dim)
    matmuls = split + whole - kv_lora_rank - 2 * d - (q_lora_rank or 0)  # less the norms
    scores = 4.0 * s * s * a * w
    moe_split, moe_whole = split + 3 * d * f * shared, whole + d * e + e  # router, its bias
    moe_flops = 2.0 * s * (matmuls + 3 * d * f * (k + shared) + d * e) + scores
    dense_split = split + 3 * d * ffn
    dense_flops = 2.0 * s * (matmuls + 3 * d * ffn) + scores
    mtp_whole = moe_whole + 2 * d * d + 3 * d  # eh_proj; enorm, hnorm, the head's norm
    mtp_flops = moe_flops + 2.0 * s * (2 * d * d + d * v)
    latents = (2 * q_lora_rank if q_lora_rank else 0) + 2 * kv_lora_rank + rope_dim
    rows = experts.ROW_ACTS
    act = {p: (sp + rows[p] * shared * f * s, rp + (latents * s if rows[p] else 0))
           for p, (sp, rp) in base.act.items()}
    head = 0 if tied else d * v
    outer = ((v * d, True), (head, True), (d, False), (dense_layers * dense_split, True),
             (dense_layers * whole, False), (mtp * moe_split, True), (mtp * mtp_whole, False))
    return dataclasses.replace(
        base, name=name or f"deepseek-v3-l{layers}-h{hidden}-e{e}k{k}",
        layer_params=(moe_split, moe_whole), moe=MoESpec(e, k, f, outer_layers=mtp),
        prologue_params=(v * d + dense_layers * dense_split, dense_layers * whole),
        epilogue_params=(head + mtp * moe_split, d + mtp * mtp_whole),
        layer_flops=moe_flops, prologue_flops=dense_layers * dense_flops,
        epilogue_flops=2.0 * s * d * v + mtp * mtp_flops,
        act=act, act_none_full=float(sum(act["none"])), act_stashed=None, dense=None,
        attn_width=a * w, outer_leaves=tuple(x for x in outer if x[0]))


def gpt_oss(layers: int, hidden: int, heads: int, kv_heads: int, seq: int, vocab: int, *,
            num_experts: int, top_k: int, expert_ffn: int, head_dim: int = 64,
            window: int | None = 128, tied: bool = False, name: str | None = None) -> ModelSpec:
    """``models.gpt_oss.GptOss`` (module docstring): ``moe_llama`` plus q/k/v biases and
    sinks (split by heads), the output bias and the router's bias (whole), each expert's
    biases (``MoESpec.biases``); the ``ceil(layers / 2)`` window layers' attention FLOPs
    bounded by ``window`` (None: every layer full)."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r} must be a positive int (or None: no window)")
    base = moe_llama(layers, hidden, heads, kv_heads, seq, vocab, experts=num_experts,
                     top_k=top_k, expert_ffn=expert_ffn, head_dim=head_dim, tied=tied,
                     name=name)
    s, q, kv = seq, heads * head_dim, kv_heads * head_dim
    split, whole = base.layer_params
    windowed = (layers + 1) // 2 if window is not None else 0
    saved = 4.0 * s * (s - min(s, window or s)) * q * windowed / layers
    return dataclasses.replace(
        base, name=name or f"gpt-oss-l{layers}-h{hidden}-e{num_experts}k{top_k}",
        layer_params=(split + q + 2 * kv + heads, whole + hidden + num_experts),
        moe=dataclasses.replace(base.moe, biases=True), layer_flops=base.layer_flops - saved,
        dense=None)


# name: (builder, keyword arguments); shapes from the Hub's config.json files (the library's
# deepseek_config / gpt_oss_config read them: tests/test_hf_deepseek.py, test_hf_gpt_oss.py)
_V3 = dict(layers=61, hidden=7168, heads=128, seq=4096, vocab=129280, ffn=18432, num_experts=256,
           top_k=8, expert_ffn=2048, shared=1, dense_layers=3, q_lora_rank=1536,
           kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)
_OSS = dict(hidden=2880, heads=64, kv_heads=8, seq=4096, vocab=201088, top_k=4,
            expert_ffn=2880, head_dim=64, window=128)
PRESETS: dict[str, tuple] = {
    "deepseek-v3": (deepseek_v3, {**_V3, "mtp": 1}),
    "kimi-k2": (deepseek_v3, {**_V3, "heads": 64, "num_experts": 384, "dense_layers": 1,
                              "vocab": 163840}),
    "gpt-oss-20b": (gpt_oss, {**_OSS, "layers": 24, "num_experts": 32}),
    "gpt-oss-120b": (gpt_oss, {**_OSS, "layers": 36, "num_experts": 128}),
}


def names() -> list[str]:
    """Every model preset the planner knows, dense, MoE and these families."""
    from fiddlejax.planner import workload

    return [*workload.PRESETS, *workload.LLAMA_PRESETS, *experts.MOE_PRESETS, *PRESETS]


def preset(name: str, seq: int | None = None) -> ModelSpec:
    """A preset by name (:func:`names`), at its own sequence length or ``seq``."""
    if name in PRESETS:
        build, kw = PRESETS[name]
        return build(**{**kw, "seq": seq or kw["seq"]}, name=name)
    if name not in names():
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(names())} (or "
                         "--model gpt or llama with --layers/--hidden/--heads/--seq/--vocab)")
    return experts.preset(name, seq)


__all__ = ["PRESETS", "deepseek_v3", "gpt_oss", "mla_params", "names", "preset"]
