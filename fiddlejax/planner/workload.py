"""Model descriptions for the planner: what one layer costs in parameters, FLOPs and activations.

A ``ModelSpec`` describes a staged model the way fiddlejax runs it (docs/architecture.md): a
prologue (embedding), ``num_layers`` identical layers, an epilogue (head and loss). Two sources:

- :func:`gpt`: analytic, for GPT-style transformers given layers, hidden size, heads, sequence
  length and vocabulary (no JAX). Parameter counts are exact for ``models.gpt.GPT``; activation
  counts per policy follow what JAX's autodiff keeps for ``models.common.Block`` (checked against
  ``saved_residuals`` in the tests).
- :func:`from_flax`: measured from a Flax model with ``staged`` structure: parameter shapes,
  per-layer and prologue/epilogue FLOPs from ``cost_analysis`` (``fiddlejax.pipeline.costs``) and
  the residual bytes each remat policy keeps (``jax.ad_checkpoint.saved_residuals``).

Activations are counted in elements per sample; arrays shaped like the layer input stay whole on
every tensor-parallel rank (Megatron's layer norms and residual stream), the rest is split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fiddlejax.planner.fp8 import DenseMatmuls

POLICIES = ("none", "full", "dots", "dots_no_batch", "minimal")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Per-layer costs of a staged model. Counts are per sample (one sequence) unless noted.

    - ``layer_params``: (split over tensor, replicated) parameter counts of one layer.
    - ``prologue_params`` / ``epilogue_params``: the same for the embedding and the head.
    - ``outer_leaves``: (elements, split over tensor) of each parameter outside the stack; the
      pipeline places a leaf by its size (``predict.outer_params``). Default: one leaf per
      nonzero part of ``prologue_params`` and ``epilogue_params``.
    - ``layer_flops``: forward FLOPs of one layer on one sample (training is ~3x, recompute +1x).
    - ``act``: policy -> (split, replicated) activation elements one layer keeps for its backward.
    - ``act_none_full``: elements of one layer's full residual set on one rank (the transient
      working set of a backward or a recomputation).
    - ``act_f32``: policy -> the part of ``act``'s split elements that stays float32 whatever
      the compute dtype (XLA's attention computes its scores and softmax in float32).
    - ``act_stashed``: (split, replicated) elements a pipeline stashes per layer without remat,
      when more than ``act["none"]``: it stores ``jax.vjp``'s residuals explicitly, which keeps
      values (both sides of casts and residual adds) that XLA fuses away inside one program.
    - ``boundary``: elements passed between layers (and between pipeline stages) per sample.
    - ``tp_allreduces``: forward all-reduces of a ``boundary``-sized tensor per layer under
      Megatron tensor parallelism (backward repeats them).
    - ``layer_costs``: relative cost of each layer when layers differ (PipeDream's partition).
    - ``moe``: a mixture of experts' experts (``planner.experts``), not in ``layer_params``.
    - ``dense``: the dense matmuls fp8 speeds up (``planner.fp8.DenseMatmuls``); ``None``
      (``from_flax``): fp8 refused.
    - ``attn_width``: attention's output per token (heads x head_dim; ``None``: ``hidden``).
    """

    name: str
    num_layers: int
    seq_len: int
    hidden: int
    layer_params: tuple[int, int]
    prologue_params: tuple[int, int]
    epilogue_params: tuple[int, int]
    layer_flops: float
    prologue_flops: float
    epilogue_flops: float
    act: Mapping[str, tuple[float, float]]
    act_none_full: float
    boundary: int
    logits: int = 0  # head output elements per sample (split over tensor)
    tp_allreduces: int = 2
    heads: int | None = None
    vocab: int | None = None
    ffn: int | None = None
    layer_costs: tuple[float, ...] | None = None
    outer_leaves: tuple[tuple[int, bool], ...] | None = None
    act_f32: Mapping[str, float] = dataclasses.field(default_factory=dict)
    act_stashed: tuple[float, float] | None = None
    moe: Any = None  # planner.experts.MoESpec
    dense: DenseMatmuls | None = None
    attn_width: int | None = None
    softcap: bool = False  # soft-capped attention scores (Gemma 2): planner.attention.capped

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1")
        if missing := [p for p in ("none", "full") if p not in self.act]:
            raise ValueError(f"ModelSpec.act needs entries for {missing}")
        if self.layer_costs is not None and len(self.layer_costs) != self.num_layers:
            raise ValueError(f"layer_costs has {len(self.layer_costs)} entries for "
                             f"num_layers={self.num_layers}; give one per layer")

    @property
    def params(self) -> int:
        """Total parameters (every expert's, those outside the stack too)."""
        experts = self.moe.expert_params(self.hidden) if self.moe else 0
        return (self.num_layers * (sum(self.layer_params) + experts) + sum(self.prologue_params)
                + sum(self.epilogue_params) + (self.moe.outer_params(self.hidden) if self.moe
                                               else 0))

    def layer_share(self, tensor: int, expert: int = 1) -> float:
        """Parameters of one layer on one rank: split ones over ``tensor``, experts over
        ``expert`` x ``tensor``, the rest whole."""
        split, rep = self.layer_params
        experts = self.moe.expert_params(self.hidden) if self.moe else 0
        return split / tensor + rep + experts / (tensor * expert)

    @property
    def tied(self) -> bool:
        """The head multiplies by the embedding (no output matrix of its own)."""
        return self.epilogue_params[0] == 0 and self.prologue_params[0] > 0

    def outer_param_leaves(self) -> tuple[tuple[int, bool], ...]:
        """(elements, split over tensor) of each parameter outside the layer stack."""
        if self.outer_leaves is not None:
            return self.outer_leaves
        (ps, pr), (es, er) = self.prologue_params, self.epilogue_params
        return tuple((n, split) for n, split in ((ps, True), (pr, False), (es, True),
                                                 (er, False)) if n)

    def act_elems(self, policy: str, tensor: int) -> float:
        """Elements one layer keeps per sample on one tensor rank under ``policy``."""
        if policy not in self.act:
            raise ValueError(f"remat={policy!r} is not described for {self.name}; "
                             f"use one of {sorted(self.act)}")
        split, rep = self.act[policy]
        return split / tensor + rep

    def act_bytes(self, policy: str, tensor: int, nbytes: int) -> float:
        """Bytes one layer keeps per sample on one tensor rank under ``policy``, its elements
        at ``nbytes`` each except the float32 ones (``act_f32``)."""
        f32 = self.act_f32.get(policy, 0.0) / tensor
        return (self.act_elems(policy, tensor) - f32) * nbytes + f32 * 4

    def stash_bytes(self, policy: str, tensor: int, nbytes: int) -> float:
        """Bytes a pipeline stashes per layer and sample on one tensor rank (``act_stashed``
        without remat, else as :meth:`act_bytes`)."""
        if policy != "none" or self.act_stashed is None:
            return self.act_bytes(policy, tensor, nbytes)
        f32 = self.act_f32.get(policy, 0.0) / tensor
        split, rep = self.act_stashed
        return (split / tensor + rep - f32) * nbytes + f32 * 4

    def train_flops(self, samples: int, remat: str = "none") -> float:
        """Executed FLOPs of forward + backward on ``samples`` samples (recomputation included:
        ``full`` re-runs each layer's forward)."""
        layer = 3.0 + (1.0 if remat == "full" else 0.0)
        return samples * (self.num_layers * layer * self.layer_flops
                          + 3.0 * (self.prologue_flops + self.epilogue_flops))

    def model_flops(self, samples: int) -> float:
        """FLOPs of forward + backward without recomputation (the MFU numerator)."""
        return self.train_flops(samples, "none")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["act"] = {k: list(v) for k, v in self.act.items()}
        d["params"] = self.params
        return d


def _scores_f32(heads: int, seq: int) -> dict[str, float]:
    """Float32 elements per sample of XLA's attention (``jax.nn.dot_product_attention``): its
    scores, masked scores and exponentials are float32 in any compute dtype (the
    probabilities are cast back); ``dots`` saves the scores (a dot's float32 output)."""
    one = float(heads * seq * seq)
    return {"none": 3 * one, "dots": one}


def gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, *, ffn: int | None = None,
        tied: bool = False, positions: bool = True, name: str | None = None) -> ModelSpec:
    """Analytic ``models.gpt.GPT`` (pre-LN, learned positions, GELU MLP of width ``ffn``=4h).
    ``positions=False`` drops the learned position table (ALiBi or rotary models, e.g. BLOOM).

    FLOPs per layer and sample: 2s(4h^2 + 2h*ffn) for the projections and MLP, 4s^2h for
    attention's QK^T and PV (Megatron's 24sh^2 + 4s^2h when ffn = 4h); the head adds 2shV.
    """
    for n, v in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq),
                 ("vocab", vocab)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{n}={v!r} must be a positive int")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}; e.g. "
                         f"hidden={heads * max(1, round(hidden / heads))}")
    h, a, s, v = hidden, heads, seq, vocab
    f = 4 * h if ffn is None else ffn
    layer_split = 4 * h * h + 2 * h * f + f  # q,k,v,o; w1,w2; b1
    layer_rep = 6 * h  # bo, b2, two layer norms
    pos = s * h if positions else 0
    pro = (v * h, pos)  # token embedding (vocab-parallel), positions
    epi = (0 if tied else h * v, 2 * h)  # head (vocab-parallel), final layer norm
    outer = ((v * h, True), (pos, False), (0 if tied else h * v, True), (h, False), (h, False))
    # What JAX's autodiff keeps per token for models.common.Block, by policy (split, whole):
    # none: q,k,v (3h), masked scores, exp and probabilities (4as), the MLP pre-activation and
    #       GELU intermediates (5f); layer-norm outputs and centred inputs (4h) stay whole.
    act = {
        "none": (3 * h + 4 * a * s + 5 * f + 2 * a, 4 * h + 4),
        "full": (0.0, h),  # the layer input only
        "dots": (3 * h + a * s + f, 3 * h),  # matmul outputs and the input
        "dots_no_batch": (3 * h + f, 2 * h),
        "minimal": (3 * h + f, 2 * h),  # named projections and the input
    }
    act = {k: (sp * s, rp * s) for k, (sp, rp) in act.items()}
    # A pipeline's explicit jax.vjp residuals per token (buffer shapes of the compiled step):
    # q,k,v and the attention output (4h), the MLP's six, eight model-width values whole.
    stashed = ((4 * h + 4 * a * s + 6 * f + 2 * a) * s, (8 * h + 4) * s)
    # fp8 (q, k, v, out, MLP in, out): inputs x twice (whole), attention and GELU outputs;
    # output gradients of q, k, v, MLP in (split), out, MLP out (whole)
    dense = DenseMatmuls(flops=2.0 * s * (4 * h * h + 2 * h * f), weights=4 * h * h + 2 * h * f,
                         act=((h + f) * s, 2 * h * s), grad=((3 * h + f) * s, 2 * h * s))
    return ModelSpec(dense=dense,
        name=name or f"gpt-l{layers}-h{hidden}", act_f32=_scores_f32(a, s), act_stashed=stashed,
        num_layers=layers, seq_len=s, hidden=h,
        layer_params=(layer_split, layer_rep), prologue_params=pro, epilogue_params=epi,
        layer_flops=2.0 * s * (4 * h * h + 2 * h * f) + 4.0 * s * s * h,
        prologue_flops=0.0, epilogue_flops=2.0 * s * h * v,
        act=act, act_none_full=float(sum(act["none"])), boundary=s * h, logits=s * v,
        heads=a, vocab=v, ffn=f, outer_leaves=tuple(x for x in outer if x[0]),
    )


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, vocab: int,
          *, head_dim: int | None = None, tied: bool = False,
          name: str | None = None) -> ModelSpec:
    """Analytic ``models.llama.Llama``: RMSNorm, grouped-query attention with rotary
    embeddings, SwiGLU MLP of width ``ffn``, no biases.

    FLOPs per layer and sample: 2s(2h*a*dh + 2h*kv*dh + 3h*ffn) for the projections and MLP,
    4s^2*a*dh for attention. Activations per policy as JAX's autodiff keeps them for
    ``models.llama.LlamaBlock`` with XLA's attention (the s x s scores; ``planner.attention``
    takes them out for cuDNN's fused one).
    """
    for n, v in (("layers", layers), ("hidden", hidden), ("heads", heads),
                 ("kv_heads", kv_heads), ("ffn", ffn), ("seq", seq), ("vocab", vocab)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{n}={v!r} must be a positive int")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    if head_dim is None and hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}, or give head_dim")
    h, a, kv, f, s, v = hidden, heads, kv_heads, ffn, seq, vocab
    dh = head_dim or h // a
    q, k = a * dh, kv * dh
    act = {  # per token: (split over tensor, whole); measured with saved_residuals
        # none: q (GQA-reshaped), k after rotary, v; the masked scores, exp and probabilities
        #       (4as) and two per-head statistics; gate, up and three SiLU intermediates (5f);
        #       input, two norm outputs and the residual sum (4h), norm statistics, rotary tables
        "none": (q + 2 * k + 4 * a * s + 2 * a + 5 * f, 4 * h + 4 + 4 * dh),
        "full": (0.0, h),
        "dots": (q + 2 * k + a * s + 2 * f, 2 * h),
        "dots_no_batch": (q + 2 * k + 2 * f, 2 * h),
        "minimal": (q + 2 * k + 2 * f, 2 * h),
    }
    act = {key: (sp * s, rp * s) for key, (sp, rp) in act.items()}
    w = 2 * h * q + 2 * h * k + 3 * h * f
    # fp8 (q, k, v, o, gate, up, down): inputs x twice (whole), attention output and SwiGLU
    # product; output gradients of q, k, v, gate, up (split), o and down (whole)
    dense = DenseMatmuls(flops=2.0 * s * w, weights=w, act=((q + f) * s, 2 * h * s),
                         grad=((q + 2 * k + 2 * f) * s, 2 * h * s))
    return ModelSpec(
        name=name or f"llama-l{layers}-h{hidden}", act_f32=_scores_f32(a, s), dense=dense,
        num_layers=layers, seq_len=s, hidden=h,
        layer_params=(2 * h * q + 2 * h * k + 3 * h * f, 2 * h),
        prologue_params=(v * h, 0), epilogue_params=(0 if tied else h * v, h),
        layer_flops=2.0 * s * (2 * h * q + 2 * h * k + 3 * h * f) + 4.0 * s * s * q,
        prologue_flops=0.0, epilogue_flops=2.0 * s * h * v,
        act=act, act_none_full=float(sum(act["none"])), boundary=s * h, logits=s * v,
        heads=a, vocab=v, ffn=f, attn_width=q,
        outer_leaves=((v * h, True),) + (() if tied else ((h * v, True),)) + ((h, False),),
    )


# name: (layers, hidden, heads, kv_heads, ffn, seq, vocab)
LLAMA_PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "llama2-7b": (32, 4096, 32, 32, 11008, 4096, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 4096, 32000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 4096, 32000),
    "llama3-8b": (32, 4096, 32, 8, 14336, 8192, 128256),
    "llama3-70b": (80, 8192, 64, 8, 28672, 8192, 128256),
    "llama3.1-405b": (126, 16384, 128, 8, 53248, 8192, 128256),
}

# name: (layers, hidden, heads, seq, vocab)
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "gpt2-small": (12, 768, 12, 1024, 50257), "gpt2-xl": (48, 1600, 25, 1024, 50257),
    "gpt3-1.3b": (24, 2048, 16, 2048, 51200), "gpt3-5b": (24, 4096, 32, 2048, 51200),
    "gpt3-6.7b": (32, 4096, 32, 2048, 51200), "gpt3-13b": (40, 5120, 40, 2048, 51200),
    "gpt3-20b": (44, 6144, 48, 2048, 51200), "gpt3-175b": (96, 12288, 96, 2048, 51200),
    "megatron-1t": (128, 25600, 160, 2048, 51200),
    "tiny": (4, 64, 4, 64, 256),  # the calibration model of tests/test_planner.py
    # BLOOM-176B (Le Scao et al. 2022): ALiBi (no position table), tied embedding; not counted:
    # the embedding's layer norm and the q/k/v biases (3.0M of 176.2B).
    "bloom-176b": (70, 14336, 112, 2048, 250880),
}
GPT_OPTIONS: dict[str, dict[str, bool]] = {"bloom-176b": {"tied": True, "positions": False}}


def preset(name: str, seq: int | None = None) -> ModelSpec:
    """An analytic GPT or Llama by preset name (see ``PRESETS`` and ``LLAMA_PRESETS``), at its
    own sequence length or ``seq``."""
    if name in LLAMA_PRESETS:
        layers, hidden, heads, kv, ffn, s, vocab = LLAMA_PRESETS[name]
        return llama(layers, hidden, heads, kv, ffn, seq or s, vocab, name=name)
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: "
                         f"{', '.join([*PRESETS, *LLAMA_PRESETS])} "
                         "(or --model gpt with --layers/--hidden/--heads/--seq/--vocab)")
    layers, hidden, heads, s, vocab = PRESETS[name]
    return gpt(layers, hidden, heads, seq or s, vocab, name=name, **GPT_OPTIONS.get(name, {}))


def activation_residuals(f: Any, x: Any) -> list[tuple[int, ...]]:
    """Shapes of the residuals ``f``'s backward keeps that are computed from ``x``: parameters
    and trace-time constants (masks, rotary tables) are not activations.

    Private JAX API, pinned (``jax>=0.10.2,<0.11`` in pyproject.toml) and tested
    (``test_activation_residuals_private_api``): ``jax.ad_checkpoint.print_saved_residuals`` is
    the public face of ``saved_residuals`` but only prints. The public alternative, the leaves
    of ``jax.vjp``'s function, cannot tell constants from activations (measured: +28% for a
    Llama block without remat).
    """
    from jax._src.ad_checkpoint import saved_residuals

    return [tuple(r.shape) for r, why in saved_residuals(f, x)
            if not why.startswith(("from a constant", "from a literal"))]


def from_flax(model: Any, example: dict, *, name: str | None = None,
              policies: Sequence[str] = POLICIES) -> ModelSpec:
    """Measure a staged Flax NNX model (``stack``/``prologue``/``head``/``loss``).

    ``example`` is a batch of ONE sample (e.g. ``{"tokens": int32[1, seq + 1]}``). FLOPs come
    from ``cost_analysis`` of the prologue, one layer and the epilogue; activation elements from
    ``saved_residuals`` of one layer under each remat policy. Needs JAX (the only planner path
    that does).
    """
    import jax
    import numpy as np

    from fiddlejax.adaptation.split import split_model
    from fiddlejax.memory import remat_layer
    from fiddlejax.pipeline import costs
    from fiddlejax.sharding import param_specs

    sm, params = split_model(model)
    specs = param_specs(params)
    flat_p = jax.tree_util.tree_leaves_with_path(params)
    flat_s = jax.tree.leaves(specs, is_leaf=lambda x: x.__class__.__name__ == "PartitionSpec")

    def split_count(path_filter):
        sp = rp = 0
        for (path, leaf), spec in zip(flat_p, flat_s, strict=True):
            if not path_filter(path):
                continue
            n = int(np.prod(leaf.shape))
            if "tensor" in tuple(spec):
                sp += n
            else:
                rp += n
        return sp, rp

    in_stack = lambda path: getattr(path[0], "key", None) == sm.stack  # noqa: E731
    outer_leaves = tuple((int(np.prod(leaf.shape)), "tensor" in tuple(spec))
                         for (path, leaf), spec in zip(flat_p, flat_s, strict=True)
                         if not in_stack(path))
    n_layers = int(jax.tree.leaves(params[sm.stack])[0].shape[0])
    ls, lr = split_count(in_stack)
    outer_s, outer_r = split_count(lambda p: not in_stack(p))
    layer_cost, pro_cost, epi_cost = costs.measure(sm, params, example, "cost")
    _, pro_n, epi_n = costs.measure(sm, params, example, "params")
    # Shared parameters: attribute them by use (prologue first); replicated/split as measured.
    frac_pro = pro_n / max(pro_n + epi_n, 1)
    pro = (int(outer_s * frac_pro), int(outer_r * frac_pro))
    epi = (outer_s - pro[0], outer_r - pro[1])
    layer = jax.tree.map(lambda a: a[0], params[sm.stack])
    msg = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype),
                       jax.eval_shape(lambda p, e: sm.prologue(p, e), params, example))
    x = max(jax.tree.leaves(msg), key=lambda a: a.size)  # the activation: the largest leaf
    act = {}
    for pol in policies:
        f = remat_layer(sm.layer, pol)
        sp = rp = 0.0
        for shape in activation_residuals(lambda h, f=f: f(layer, h), msg):
            n = float(np.prod(shape))
            if tuple(shape) == tuple(x.shape) or n < np.prod(x.shape) / max(x.shape[-1], 1) + 1:
                rp += n
            else:
                sp += n
        act[pol] = (sp, rp)
    seq = int(x.shape[1]) if x.ndim > 1 else 1
    # cost_analysis FLOPs are forward + backward (~3x forward) of one sample.
    return ModelSpec(
        name=name or type(model).__name__.lower(),
        num_layers=n_layers, seq_len=seq, hidden=int(x.shape[-1]),
        layer_params=(ls // n_layers, lr // n_layers), prologue_params=pro, epilogue_params=epi,
        layer_flops=layer_cost / 3.0, prologue_flops=pro_cost / 3.0, epilogue_flops=epi_cost / 3.0,
        act=act, act_none_full=float(sum(act["none"])), boundary=int(math.prod(x.shape[1:])),
        heads=getattr(getattr(model, "config", None), "n_heads", None), outer_leaves=outer_leaves,
        vocab=getattr(getattr(model, "config", None), "vocab_size", None))
