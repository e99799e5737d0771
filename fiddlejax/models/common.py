"""Transformer pieces shared by the models: a pre-LayerNorm block, fused attention, stacked layers.

Parameters carry logical axis names (``out_sharding``) so fiddlejax can shard them by rules; the
attention projections and MLP outputs carry the canonical ``checkpoint_name`` tags of
``fiddlejax.memory.names`` so remat policies can address them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fiddlejax import intercept
from fiddlejax.memory import names
from fiddlejax.parallel.ops import Ops

Init = Callable[..., jax.Array]


def annotated(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter tagged with logical axis names; fiddlejax maps them to mesh axes later."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def param(rngs: nnx.Rngs, init: Init, shape: tuple[int, ...], axes: tuple[str | None, ...]):
    """An ``nnx.Param`` initialised by ``init`` and annotated with logical axis names."""
    return annotated(init(rngs.params(), shape, jnp.float32), axes)


def project(module: nnx.Module, name: str, x: jax.Array, spec: str, drop=None) -> jax.Array:
    """``einsum(spec, x, module.<name>)``, plus its LoRA update ``scale * (x @ A) @ B`` when the
    kernel carries adapters (``<name>_lora_a``, ``<name>_lora_b``:
    :mod:`fiddlejax.finetune.lora`); with ``module.lora_dropout`` and a training step's keys
    (``drop``: the layer's :class:`fiddlejax.adaptation.dropout.LayerKeys`, from its message)
    the adapters' input is ``dropout(x)``, as peft's ``lora_dropout``."""
    y = jnp.einsum(spec, x, getattr(module, name)[...])
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return y
    rate = getattr(module, "lora_dropout", 0.0)
    if rate and drop is not None:  # none in eval: no keys
        x = drop.drop(x, name, rate)
    a, b = a[...], getattr(module, f"{name}_lora_b")[...]
    xa = jnp.tensordot(x, a.astype(x.dtype), a.ndim - 1)  # [..., rank]: O(T d r)
    return y + (module.lora_scale * jnp.tensordot(xa, b.astype(x.dtype), 1)).astype(y.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm with float32 statistics whatever the compute dtype (bf16 sums lose digits),
    applied in the input's dtype (so a bf16 layer keeps bf16 residuals, not float32 copies)."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    inv = jax.lax.rsqrt(var + eps)
    return (x - mean.astype(x.dtype)) * inv.astype(x.dtype) * scale + bias


class LayerNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = annotated(jnp.ones((dim,)), ("embed",))
        self.bias = annotated(jnp.zeros((dim,)), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...])


class RMSNorm(nnx.Module):
    """RMSNorm with float32 statistics; ``plus_one``: Gemma's ``x * (1 + w)`` in float32, its
    weights starting at zero (Llama: ``w * x`` in the input's dtype)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False,
                 axis: str | None = "embed"):
        self.weight = annotated(jnp.zeros((dim,)) if plus_one else jnp.ones((dim,)), (axis,))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


class Block(nnx.Module):
    """Pre-LN transformer layer: x + Attn(LN(x)), then x + MLP(LN(x)).

    Q/K/V are column-parallel over heads, the output projection row-parallel; the MLP's first
    matmul is column-parallel over its hidden units, the second row-parallel (Megatron).
    """

    lora_targets = {"wq": (1, 2), "wk": (1, 2), "wv": (1, 2), "wo": (2, 1), "w1": (1, 1),
                    "w2": (1, 1)}  # kernel: (input dims, output dims) (fiddlejax.finetune.lora)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        causal: bool,
        dropout: float,
        n_layers: int,
        rngs: nnx.Rngs,
    ):
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        dh = d_model // n_heads
        std = 0.02
        out_std = std / (2 * n_layers) ** 0.5  # GPT-2's scaled init of residual projections
        normal = jax.nn.initializers.normal
        self.causal = causal
        self.ln1 = LayerNorm(d_model)
        self.wq = param(rngs, normal(std), (d_model, n_heads, dh), ("embed", "heads", "head_dim"))
        self.wk = param(rngs, normal(std), (d_model, n_heads, dh), ("embed", "heads", "head_dim"))
        self.wv = param(rngs, normal(std), (d_model, n_heads, dh), ("embed", "heads", "head_dim"))
        self.wo = param(
            rngs, normal(out_std), (n_heads, dh, d_model), ("heads", "head_dim", "embed")
        )
        self.bo = annotated(jnp.zeros((d_model,)), ("embed",))
        self.ln2 = LayerNorm(d_model)
        self.w1 = param(rngs, normal(std), (d_model, d_ff), ("embed", "mlp"))
        self.b1 = annotated(jnp.zeros((d_ff,)), ("mlp",))
        self.w2 = param(rngs, normal(out_std), (d_ff, d_model), ("mlp", "embed"))
        self.b2 = annotated(jnp.zeros((d_model,)), ("embed",))
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None

    def _drop(self, x: jax.Array) -> jax.Array:
        return self.dropout(x) if self.dropout is not None else x

    def attention(self, x: jax.Array, segment_ids: jax.Array | None = None,
                  ops: Ops | None = None) -> jax.Array:
        q = checkpoint_name(project(self, "wq", x, "btd,dhk->bthk"), names.QUERY)
        k = checkpoint_name(project(self, "wk", x, "btd,dhk->bthk"), names.KEY)
        v = checkpoint_name(project(self, "wv", x, "btd,dhk->bthk"), names.VALUE)
        ctx = attention(q, k, v, causal=self.causal, segment_ids=segment_ids, ops=ops)
        out = project(self, "wo", ctx, "bthk,hkd->btd") + self.bo[...]
        return checkpoint_name(out, names.ATTN_OUT)

    def mlp(self, x: jax.Array) -> jax.Array:
        h = checkpoint_name(project(self, "w1", x, "...d,df->...f") + self.b1[...],
                            names.MLP_HIDDEN)
        h = jax.nn.gelu(h)
        return checkpoint_name(project(self, "w2", h, "...f,fd->...d") + self.b2[...],
                               names.MLP_OUT)

    def __call__(self, msg: Message, ops: Ops | None = None) -> Message:
        x = msg.x
        x = x + self._drop(self.attention(self.ln1(x), msg.segment_ids, ops))
        return msg._replace(x=x + self._drop(self.mlp(self.ln2(x))))


# -- the message: what the layers pass on --------------------------------------------------------
class Message(NamedTuple):
    """What a bundled model's layers take and return, and what every layout moves between
    them: the pipeline stashes, sends and receives it leaf by leaf (:mod:`fiddlejax.message`),
    each in its own dtype. A field the model or the batch does not use is None (no leaf), so a
    plain batch's message is its activation alone."""

    x: jax.Array                            # the residual stream [B, T, d]
    segment_ids: jax.Array | None = None    # int32 [B, T]: packed documents (0: padding)
    positions: jax.Array | None = None      # int32 [B, T]: each token's place in its document
    layer: jax.Array | None = None          # int32 []: the next layer's index (layer types)
    tally: jax.Array | None = None          # float32 [B, T, 2E + 2]: MoE router tally
    loads: jax.Array | None = None          # int32 [L, E]: each MoE layer's expert loads
    keys: jax.Array | None = None           # uint32 [B, 2]: per-example dropout keys (training)


def activation(msg) -> jax.Array:
    """The residual stream of a :class:`Message` (or of a bare activation)."""
    return msg.x if isinstance(msg, Message) else msg




def positions_of(segment_ids: jax.Array) -> jax.Array:
    """Positions counting from 0 at each segment's start and each row's start."""
    t = segment_ids.shape[-1]
    cols = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return cols - jax.lax.cummax(jnp.where(starts, cols, 0), axis=1)


def side_inputs(tokens: jax.Array, segment_ids, positions) -> tuple:
    """``(segment_ids, positions)`` of a model call, either missing one filled in."""
    if segment_ids is None and positions is None:
        return None, None
    if segment_ids is None:
        segment_ids = jnp.ones(tokens.shape, jnp.int32)
    if positions is None:
        positions = positions_of(segment_ids)
    return segment_ids, positions


def batch_sides(batch: dict) -> tuple:
    """``(segment_ids, positions)`` of a batch's inputs (``[:, :-1]``), or Nones."""
    seg, pos = batch.get("segment_ids"), batch.get("positions")
    return (None if seg is None else seg[:, :-1]), (None if pos is None else pos[:, :-1])


def next_token_loss(logits: jax.Array, batch: dict, vocab_size: int, ops: Ops | None = None):
    """Next-token cross-entropy against ``tokens[:, 1:]``: the mean for plain windows; for a
    packed or padded batch (``segment_ids``) the pair ``(sum, count)`` over the targets that
    continue their input's document (not the token after an EOS, not padding), and with a
    ``loss_mask`` (chat data: 1 on the assistant's tokens) over those it marks; fiddlejax
    reduces the pair exactly over microbatches and replicas (the global batch's masked mean)."""
    ce = cross_entropy(logits, batch["tokens"][:, 1:], vocab_size, ops)
    mask = target_mask(batch)
    if mask is None:
        return ce.mean()
    return jnp.sum(jnp.where(mask, ce, 0.0)), jnp.sum(mask).astype(jnp.float32)


def target_mask(batch: dict) -> jax.Array | None:
    """Which targets ``[:, 1:]`` count (``[B, T]`` bool), or None: all of them."""
    seg, keep = batch.get("segment_ids"), batch.get("loss_mask")
    mask = None if seg is None else (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    if keep is not None:
        mask = keep[:, 1:] > 0 if mask is None else mask & (keep[:, 1:] > 0)
    return mask


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """``[B, 1, T, T]``: query and key in the same segment (causality is added separately)."""
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
              segment_ids: jax.Array | None = None, as_bias: bool | None = None,
              window: int | None = None, softcap: float | None = None,
              scale: float | None = None, ops: Ops | None = None,
              sinks: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T * scale) v for ``q[B, T, H, Dh]``, ``k, v[B, S, KV, Dh]``; tagged CONTEXT.

    One ``jax.nn.dot_product_attention`` call, so the backend picks the kernel: cuDNN's fused
    flash attention on a GPU for bf16/fp16 inputs, XLA's implementation otherwise (CPU, float32).
    ``KV < H`` is grouped-query attention: query head ``h`` reads KV head ``h // (H // KV)``, as
    Hugging Face's ``repeat_kv`` does; the call broadcasts K/V heads instead of copying them.
    With ``segment_ids[B, T]`` a query attends only to keys of its own segment: a boolean mask
    on XLA's path, an additive bias on cuDNN's fused one (``as_bias`` forces either).
    ``window``: a query sees itself and the ``window - 1`` keys before it (Hugging Face's
    ``sliding_window``; a local window of the fused call). ``scale`` defaults to ``Dh ** -0.5``.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2), which no fused
    kernel offers: :func:`capped_attention` computes it with XLA, as it does ``sinks[H]``
    (GPT-OSS: a learned logit per head joins each query's softmax and takes its share).
    ``ops``: what the layout offers (a block passes on its own ``ops``; a user's block that
    takes none is reached through :mod:`fiddlejax.intercept`); with ``ops.context`` set the
    sequence is split over ``context`` and the shards' attention is joined.
    """
    ops = ops if ops is not None else intercept.current().ops
    if ops is not None and ops.context is not None:  # a sequence split over `context`
        if sinks is not None:
            raise NotImplementedError("attention sinks (GPT-OSS) under context parallelism "
                                      "are not implemented; train with context=1")
        return checkpoint_name(ops.context.attention(q, k, v, causal=causal,
                                                     segment_ids=segment_ids, window=window,
                                                     softcap=softcap, scale=scale),
                               names.CONTEXT)
    if softcap is not None or sinks is not None:
        ctx = capped_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window,
                               softcap=softcap, scale=scale, sinks=sinks)
        return checkpoint_name(ctx, names.CONTEXT)
    impl = None
    if q.dtype in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "gpu":
        impl = "cudnn"
    kw = {"scale": scale}
    if window is not None:
        kw["local_window_size"] = (window - 1, 0)
    if segment_ids is not None:  # documents never see each other (fused path: as a bias)
        mask = segment_mask(segment_ids)
        if as_bias if as_bias is not None else impl == "cudnn":
            kw["bias"] = jnp.where(mask, 0.0, -1e9 if q.dtype == jnp.float32 else -3e4
                                   ).astype(q.dtype)
        else:
            kw["mask"] = mask
    try:
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl, **kw)
    except (ValueError, NotImplementedError, RuntimeError):
        if impl is None:
            raise
        # cuDNN refuses some shapes and GPUs (head_dim, compute capability) while tracing:
        # XLA's implementation computes the same function.
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=causal, **kw)
    return checkpoint_name(ctx, names.CONTEXT)


def capped_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                     segment_ids: jax.Array | None, window: int | None,
                     softcap: float | None, scale: float | None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Attention with soft-capped scores, as transformers' eager Gemma 2 computes it: scores in
    float32, capped, masked, softmax, then the weighted values in the inputs' dtype. With
    ``sinks[H]`` each head's sink logit joins the softmax as one more column, then is dropped
    (transformers' eager GPT-OSS)."""
    b, t, h, dh = q.shape
    s, kv = k.shape[1], k.shape[2]
    scale = dh ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    qi, ki = jnp.arange(t)[:, None] + (s - t), jnp.arange(s)[None, :]
    ok = jnp.ones((t, s), bool)
    if causal:
        ok &= ki <= qi
    if window is not None:
        ok &= ki > qi - window
    ok = ok[None, None, None]
    if segment_ids is not None:
        ok = ok & segment_mask(segment_ids)[:, :, None]
    scores = jnp.where(ok, scores, -jnp.inf)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, kv, h // kv, 1, 1)
        scores = jnp.concatenate([scores, jnp.broadcast_to(sink, (*scores.shape[:-1], 1))], -1)
    probs = jax.nn.softmax(scores, axis=-1)[..., :s].astype(v.dtype)
    ctx = jnp.einsum("bgrts,bsgd->btgrd", probs, v)
    return ctx.reshape(b, t, h, dh)


def stacked(n: int, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """``n`` layers built by ``make`` with parameters stacked on a leading ``layers`` axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(r: nnx.Rngs) -> nnx.Module:
        return make(r)

    return build(rngs)


def scan_layers(layers: nnx.Module, x: jax.Array) -> jax.Array:
    """Apply stacked layers in order with a ``lax.scan`` (one compiled layer body)."""
    graphdef, state = nnx.split(layers)

    def body(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h), None

    return jax.lax.scan(body, x, state)[0]


def embedding(table: jax.Array, tokens: jax.Array, ops: Ops | None = None) -> jax.Array:
    """``take(table, tokens, axis=0)``; with the table split by vocabulary over ``data``
    (zero=3 offers ``ops.vocab``, :mod:`fiddlejax.compute.vocab`), from this device's slice."""
    shards = None if ops is None else ops.vocab
    return jnp.take(table, tokens, axis=0) if shards is None else shards.lookup(table, tokens)


def vocab_rows(x: jax.Array, ops: Ops | None = None) -> jax.Array:
    """The rows the head projects: ``x``; with the head split by vocabulary over ``data``
    (``ops.vocab``), every replica's rows (onto this device's slice)."""
    shards = None if ops is None else ops.vocab
    return x if shards is None else shards.rows(x)


def cross_entropy(logits: jax.Array, targets: jax.Array, vocab_size: int,
                  ops: Ops | None = None) -> jax.Array:
    """Per-position cross-entropy; logits past ``vocab_size`` (sharding padding) are ignored.
    Logits of every replica's rows over a vocabulary slice (:func:`vocab_rows`, the same
    ``ops``) give this replica's rows' cross-entropy."""
    if ops is not None and ops.vocab is not None:
        return ops.vocab.cross_entropy(logits, targets, vocab_size)
    logits = logits.astype(jnp.float32)
    if logits.shape[-1] > vocab_size:
        valid = jnp.arange(logits.shape[-1]) < vocab_size
        logits = jnp.where(valid, logits, -1e30)
    logz = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot contraction instead of a gather keeps vocabulary-sharded logits sharded.
    picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1)
    return logz - picked
