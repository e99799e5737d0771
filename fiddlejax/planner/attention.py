"""Which attention kernel the planner prices: XLA's, which writes the s x s scores, or cuDNN's
fused flash attention, which never does (``Layout.attention``).

``models.common.attention`` is one ``jax.nn.dot_product_attention`` call: on a GPU with bf16 or
fp16 inputs it runs cuDNN's fused kernel, elsewhere (CPU, float32) XLA's implementation.

- ``xla``: the scores, masked scores, exponentials and probabilities (float32 where XLA keeps
  them so) and two per-head statistics are residuals of the backward, a layer's working set
  and elementwise HBM traffic: the model's own tables (``workload.gpt``/``llama``, measured
  with ``saved_residuals`` on the CPU).
- ``fused``: none of the s x s arrays reach HBM; the backward keeps the output (heads x
  head_dim per token) and a float32 log-sum-exp per query and head. Under ``dots`` the fused
  call is not a dot, so nothing of attention beyond q, k and v is saved (it is recomputed).
  Its backward holds a float32 dQ accumulator (``live_bytes``). FLOPs are unchanged.
- ``auto`` (the default): ``fused`` for 16-bit precisions on a GPU (``GPUSpec.fused_attention``),
  ``xla`` for ``fp32`` or on the simulated CPU. Without a cluster (``footprint.memory`` called
  alone) ``auto`` assumes a GPU.

Sequences split over ``context`` run the ring's tiled kernel (``footprint.layer_activations``);
``fused`` there prices its blocks in a fused kernel (no score traffic: Transformer Engine's
context parallelism, ``timing.step_time``), ``auto`` and ``xla`` as fiddlejax's tiles.
Soft-capped scores (Gemma 2, ``models.common.capped_attention``) have no fused kernel: a
model marked by :func:`capped` runs XLA's attention whatever the layout asks, and keeps two
more float32 s x s arrays per head for its backward without remat (the capped scores before
and after the tanh; ``CAPPED_COPIES``, measured with ``saved_residuals``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fiddlejax.planner.cluster import ClusterSpec
    from fiddlejax.planner.workload import ModelSpec

ATTENTIONS = ("auto", "fused", "xla")
SCORE_COPIES = {"none": 4, "dots": 1}  # s x s arrays per head XLA's attention keeps (residuals)
SCORE_F32 = {"none": 3, "dots": 1}  # of which float32 (workload._scores_f32)
STATS = {"none": 2}  # XLA's per-head, per-query softmax statistics kept
CAPPED_COPIES = {"none": 2}  # float32 s x s arrays per head a soft cap adds (residuals)


def check(attention: str, precision: str, model: ModelSpec | None,
          cluster: ClusterSpec | None) -> None:
    """Refuse by name what cannot run: an unknown kind, and ``fused`` in float32, on a device
    without the fused kernel, or for a model that does not say its heads."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} must be one of {ATTENTIONS}")
    if attention != "fused":
        return
    if precision == "fp32":
        raise ValueError(f"attention='fused' is cuDNN's flash attention, which runs in 16-bit "
                         f"only; precision={precision!r} runs XLA's: use attention='xla' or "
                         "precision='bf16-mixed'")
    if cluster is not None and not cluster.gpu.fused_attention:
        raise ValueError(f"attention='fused' on {cluster.name} ({cluster.gpu.name}): no fused "
                         "attention kernel there (XLA's runs); use attention='xla' or 'auto'")
    if model is not None and model.softcap:
        raise ValueError(f"attention='fused': {model.name}'s soft-capped scores have no fused "
                         "kernel (XLA's runs them); use attention='xla' or 'auto'")
    if model is not None and model.heads is None:
        raise ValueError(f"attention='fused' needs {model.name}'s number of heads (ModelSpec."
                         "heads) to take out its scores; use attention='xla'")


def kind(model: ModelSpec, layout: Any, cluster: ClusterSpec | None = None) -> str:
    """The attention ``layout`` (a ``planner.Layout``, not imported: ``space`` imports this
    module) runs: ``ring`` (``context`` > 1), ``fused`` or ``xla``."""
    if layout.context > 1 and model.heads is not None:
        return "ring"
    if layout.attention != "auto" or model.softcap:
        return "xla" if model.softcap else layout.attention
    gpu = cluster is None or cluster.gpu.fused_attention
    fused = gpu and layout.precision != "fp32" and model.heads is not None
    return "fused" if fused else "xla"


def as_run(model: ModelSpec, layout: Any, cluster: ClusterSpec | None = None) -> ModelSpec:
    """``model`` as ``layout`` runs its attention: :func:`fused` or unchanged."""
    return fused(model) if kind(model, layout, cluster) == "fused" else model


def fused(model: ModelSpec) -> ModelSpec:
    """``model``'s activations with cuDNN's fused attention instead of XLA's: per policy, the
    s x s copies (``SCORE_COPIES``) and XLA's statistics out; without remat the output and
    the float32 log-sum-exp in (a pipeline's stash already has the output)."""
    a, s = model.heads, model.seq_len
    square, row = float(a * s * s), float(a * s)
    out = float((model.attn_width or model.hidden) * s)

    def drop(policy: str, split: float) -> float:
        return split - SCORE_COPIES.get(policy, 0) * square - STATS.get(policy, 0) * row

    act = {p: (drop(p, sp) + (out + row if p == "none" else 0.0), rp)
           for p, (sp, rp) in model.act.items()}
    f32 = {p: v - SCORE_F32.get(p, 0) * square for p, v in model.act_f32.items()}
    f32["none"] = f32.get("none", 0.0) + row
    stashed = model.act_stashed
    if stashed is not None:
        stashed = (drop("none", stashed[0]) + row, stashed[1])
    return dataclasses.replace(model, act=act, act_f32=f32, act_stashed=stashed,
                               act_none_full=float(sum(act["none"])))


def capped(model: ModelSpec) -> ModelSpec:
    """``model`` with soft-capped attention scores: marked (XLA's attention, ``kind``) and
    keeping ``CAPPED_COPIES`` more float32 s x s arrays per head (split over tensor)."""
    if model.heads is None:
        raise ValueError(f"capped({model.name}): needs the number of heads (ModelSpec.heads)")
    square = float(model.heads * model.seq_len * model.seq_len)
    act = {p: (sp + CAPPED_COPIES.get(p, 0) * square, rp) for p, (sp, rp) in model.act.items()}
    f32 = {**model.act_f32, **{p: model.act_f32.get(p, 0.0) + n * square
                               for p, n in CAPPED_COPIES.items()}}
    stashed = model.act_stashed
    if stashed is not None:
        stashed = (stashed[0] + CAPPED_COPIES["none"] * square, stashed[1])
    return dataclasses.replace(model, act=act, act_f32=f32, act_stashed=stashed,
                               act_none_full=float(sum(act["none"])), softcap=True)


def live_bytes(model: ModelSpec, layout: Any) -> float:
    """Bytes per sample the fused backward adds to a layer's working set on one rank: its
    float32 dQ accumulator (FlashAttention-2's and cuDNN's backward sum dQ over key blocks in
    float32)."""
    return 4.0 * (model.attn_width or model.hidden) * model.seq_len / layout.tensor
