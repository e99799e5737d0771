"""The ``context`` axis: every sequence split over devices, attention joining the pieces.

A sequence of ``T`` tokens is cut into ``2C`` chunks of ``n = T / 2C``; context shard ``i``
holds chunks ``i`` and ``2C-1-i`` (Megatron's causal load balance: an early chunk, which sees
little, paired with a late one, which sees much, so every shard does the same attention work).
The split happens on the batch, before the model sees it (:func:`split_batch`): each chunk is
cut from ``tokens[B, T+1]`` with its one-token overlap, so its next-token targets are shifted
before the split and the model's own prologue and loss work on it unchanged. Positions (and
segment ids, when the batch packs documents) are cut the same way and ride in the activation,
so rotary angles and document masks see global positions. The model then sees
``[C * B * 2, n]`` rows: shard ``i``'s rows first (``B`` sequences, 2 chunks each), the row
axis sharded over ``context`` by the GSPMD partitioner (the axis is ``Auto`` like ``tensor``):
everything token-wise (embeddings, norms, MLPs, the residual stream, the head and loss) runs
on ``1/C`` of the tokens per device with no communication, and the loss is the model's own
mean over all rows, which is the mean over the whole sequence.

Attention is the one operation that mixes tokens; :func:`attention` replaces it in a layer
whose ``ops.context`` (a :class:`Joining`) is set (``fiddlejax.models.common.attention`` dispatches
here). Both
kernels (:mod:`.ring`) are written for the partitioner, each array's leading axis (the shards)
pinned to ``context``:

- ``"ring"``: K/V blocks travel around the ring (one collective-permute a step) while the
  local blocks compute, softmax merged online in float32; only the visible n x n blocks are
  computed, the same count on every shard, each rematerialized in the backward.
- ``"allgather"``: K/V (and key segment ids) all-gathered over ``context``, one masked
  attention of the local queries against the whole sequence.

:func:`pick` chooses by shape (benchmarks/results/context.md has the measurements). Under a
pipeline the all-gather is used: a stage's layer loop runs on some stages only, and XLA's CPU
runtime joins every device of the program in each collective-permute (see
``fiddlejax.pipeline.lockstep``), while an all-gather joins only its own context group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax.mesh import axis_size
from fiddlejax.parallel import ring
from fiddlejax.parallel.concern import Draft
from fiddlejax.parallel.ops import Ops, extend
from fiddlejax.plan import CONTEXT_KERNELS
from fiddlejax.staged import takes_ops

KERNELS = CONTEXT_KERNELS
# From this many tokens per shard the ring wins (benchmarks/results/context.md, "The two
# kernels at context=4": a faster step from 256 tokens per shard; at 128 the two are even
# within CPU noise and the all-gather's one collective is the simpler program). Both kernels
# are tiled, but the all-gather holds the whole sequence's K/V on every device.
RING_FROM_TOKENS = 256
SEQ_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
OPTIONS = ("window", "softcap", "scale", "sinks")  # the model attention options kernels take


@dataclasses.dataclass(frozen=True)
class Split:
    """How sequences are split: ``size`` shards, ``seq`` model tokens per sequence."""

    size: int
    seq: int
    kernel: str = "auto"
    mesh: object = None
    pipelined: bool = False
    ahead: int = 0  # tokens past each chunk the loss reads (DeepSeek-V3's MTP depth)

    @property
    def chunk(self) -> int:
        return self.seq // (2 * self.size)

    def chunks(self, shard: int) -> tuple[int, int]:
        """The two chunks shard ``shard`` holds."""
        return shard, 2 * self.size - 1 - shard

    def kernel_for(self, tokens_per_shard: int) -> str:
        return pick(self, tokens_per_shard) if self.kernel == "auto" else self.kernel


def pick(split: Split, tokens_per_shard: int) -> str:
    """The attention kernel for this shape (``kernel="auto"``)."""
    if split.pipelined:
        return "allgather"
    return "ring" if tokens_per_shard >= RING_FROM_TOKENS else "allgather"


def check(size: int, seq: int) -> None:
    """Refuse a sequence the ``context`` split cannot cut, before anything compiles."""
    if seq % (2 * size):
        good = (seq // (2 * size) + 1) * 2 * size
        raise ValueError(
            f"context={size} cuts each sequence into 2 x {size} = {2 * size} equal chunks (two "
            f"per shard, for the causal load balance), but the model's sequence length {seq} "
            f"is not a multiple of {2 * size}; use seq_len={good} or {good - 2 * size}, or "
            "another context size")


def split_batch(batch: dict, split: Split) -> dict:
    """``batch`` (``tokens[B, T+1]`` and friends) as ``[C * B * 2, n + 1]`` rows: shard ``i``'s
    ``B`` sequences' chunks ``i`` and ``2C-1-i``, each with its next token (targets shifted
    before the split). Positions are added when missing: a chunk's tokens keep their place in
    the whole sequence. With ``split.ahead`` = D, ``batch["ahead"]`` holds each row's next D
    columns of every key, and ``inside`` (1 where the sequence goes on): what multi-token
    prediction reads past a chunk (:func:`fiddlejax.models.mtp.ahead_of`)."""
    tokens = batch["tokens"]
    b, t1 = tokens.shape[0], tokens.shape[1]
    if t1 != split.seq + 1:
        raise ValueError(f"batch['tokens'] has {t1} tokens per row; with context={split.size} "
                         f"the model takes seq_len + 1 = {split.seq + 1}")
    extra = sorted(set(batch) - set(SEQ_KEYS))
    if extra:
        raise ValueError(
            f"with context={split.size} a batch may carry only {list(SEQ_KEYS)} (each "
            f"[batch, seq_len + 1], split along the sequence); it has {extra}. Fold them "
            "into the loss, or train with mesh context=1")
    full = dict(batch)
    if "positions" not in full:
        full["positions"] = jnp.broadcast_to(jnp.arange(t1, dtype=jnp.int32), tokens.shape)
    n, c, d = split.chunk, split.size, split.ahead
    if d:  # past the end: padding (positions go on), outside the sequence
        full["inside"] = jnp.ones_like(tokens)
        full = {k: jnp.concatenate([x, jnp.arange(t1, t1 + d, dtype=x.dtype)[None].repeat(
            b, 0) if k == "positions" else jnp.zeros((b, d), x.dtype)], 1)
                for k, x in full.items()}
    starts = np.array([[k * n for k in split.chunks(i)] for i in range(c)])  # [C, 2]
    index = starts[..., None] + np.arange(n + 1 + d)  # [C, 2, n + 1 + D]
    out, ahead = {}, {}
    for key, x in full.items():
        rows = jnp.take(x, jnp.asarray(index.reshape(-1)), axis=1).reshape(b, c, 2, n + 1 + d)
        rows = constrain_rows(jnp.swapaxes(rows, 0, 1).reshape(c * b * 2, n + 1 + d), split)
        if key != "inside":
            out[key] = rows[:, :n + 1]
        if d:
            ahead[key] = rows[:, n + 1:]
    return {**out, "ahead": ahead} if d else out


def sequence_sums(x: jax.Array, split: Split) -> jax.Array:
    """Per-row values ``x[C * B * 2, ...]`` summed over each sequence's rows: ``[B, ...]``."""
    c = split.size
    return jnp.sum(x.reshape(c, x.shape[0] // (2 * c), 2, *x.shape[1:]), axis=(0, 2))


def constrain_rows(x: jax.Array, split: Split) -> jax.Array:
    """``x`` with its leading (row) axis sharded over ``context``."""
    return _constrain(x, split, P("context"))


def _constrain(x: jax.Array, split: Split, spec: P) -> jax.Array:
    """``x`` split as ``spec`` says over ``context`` (the other axes left to the partitioner:
    a head dimension stays on ``tensor``)."""
    mesh = jax.sharding.get_abstract_mesh()
    mesh = split.mesh if mesh.empty else mesh
    spec = P(*spec, *([P.UNCONSTRAINED] * (x.ndim - len(spec))))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# -- the attention service --------------------------------------------------------------
class Joining:
    """What ``context`` offers a layer (``ops.context``): attention over the whole sequences of
    its split rows. Counts its calls, so that a layer whose attention never came here (and so
    would attend within a shard only) is refused rather than silently wrong."""

    def __init__(self, split: Split):
        self.split, self.calls = split, 0

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                  segment_ids: jax.Array | None = None, **options) -> jax.Array:
        """:func:`attention` on this layer's split, counted."""
        self.calls += 1
        return attention(self.split, q, k, v, causal=causal, segment_ids=segment_ids,
                         **options)

    def sequences(self, x: jax.Array) -> jax.Array:
        """:func:`sequence_sums`: a loss's per-row sums joined into its sequences' (the
        per-sequence router losses pool a whole sequence: :mod:`fiddlejax.models.moe_loss`)."""
        return sequence_sums(x, self.split)


def attention(split: Split, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
              segment_ids: jax.Array | None = None, **options) -> jax.Array:
    """Attention of ``q[R, n, H, Dh]`` over the whole sequences of the split rows (``k, v``
    ``[R, n, KV, Dh]``; ``R = C * B * 2``, rows sharded over ``context``). ``options`` of the
    model's attention: ``window``, ``softcap``, ``scale`` and ``sinks`` (as
    :func:`fiddlejax.models.common.attention` takes them; the window counts places in the whole
    sequence; each head's sink joins the softmax once, after the kernel:
    :func:`.ring.with_sinks`); any other is refused by name."""
    used = sorted(name for name, value in options.items()
                  if value is not None and name not in OPTIONS)
    if used:
        raise ValueError(
            f"context={split.size} joins the shards' attention supporting only the options "
            f"{list(OPTIONS)}; this model's attention sets {used}, which the split does not "
            "support yet; train it with mesh context=1")
    opts = {name: options.get(name) for name in OPTIONS}
    c, n = split.size, split.chunk
    kernel = split.kernel_for(2 * n)
    seg = segment_ids if segment_ids is not None else jnp.ones(q.shape[:2], jnp.int32)
    b = q.shape[0] // (2 * c)

    def keep(x):  # the leading axis (shards) on `context`
        return _constrain(x, split, P("context"))

    def whole(x):  # every shard's copy (an all-gather over `context`)
        return _constrain(x, split, P(None))

    q, k, v, seg = (keep(x.reshape(c, b, 2, *x.shape[1:])) for x in (q, k, v, seg))
    if kernel == "ring":
        out = ring.ring_attention(q, k, v, seg, causal, keep, **opts)
    else:
        out = ring.gathered_attention(q, k, v, seg, causal, keep, whole, **opts)
    return constrain_rows(out.reshape(c * b * 2, *out.shape[3:]), split)


class ContextModel:
    """A staged model whose batches are split over ``context`` and whose layers' attention
    joins the shards. Everything else is the wrapped model's."""

    def __init__(self, inner, split: Split):
        self._inner, self.split = inner, split

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def prologue(self, params, batch, ops: Ops | None = None):
        """The inner prologue on the split rows; attention it computes (DeepSeek-V3's dense
        layers, which its prologue runs) joins the shards too, offered as to a layer."""
        return self._inner.prologue(params, split_batch(batch, self.split),
                                    extend(ops, context=Joining(self.split)))

    def layer(self, layer_params, x, ops: Ops | None = None):
        joining = Joining(self.split)
        out = self._inner.layer(layer_params, x, extend(ops, context=joining))
        if joining.calls == 0:
            raise ValueError(
                f"context={self.split.size} splits each sequence, but this model's layer "
                "computed no attention through fiddlejax.models.common.attention, so nothing "
                "joins the shards and the result would be wrong; call that function for "
                "attention (a block taking an `ops` keyword passes it on), or use mesh "
                "context=1")
        return out

    def weighted_loss(self, params, x, batch, ops: Ops | None = None):
        """The inner loss on the split rows; a model's own head and loss (taking ``ops``) are
        offered the join too: MTP's blocks attend over whole sequences, router losses pool
        them."""
        batch = split_batch(batch, self.split)
        if not takes_ops(type(self._inner), "weighted_loss"):
            return self._inner.weighted_loss(params, x, batch)
        return self._inner.weighted_loss(params, x, batch,
                                         extend(ops, context=Joining(self.split)))

    def epilogue(self, params, x, batch, ops: Ops | None = None):
        total, sums = self.weighted_loss(params, x, batch, ops)
        return total / sums.weight


def lay_out(staged, plan, example: dict | None, kernel: str | None = None,
            canonical=None) -> object:
    """The ``context`` step of :func:`fiddlejax.parallel.compose.lay_out`: ``staged`` itself
    when ``context`` is 1, else a :class:`ContextModel` (checked against ``example``, the
    model's ``batch_spec(1)``; DeepSeek-V3's MTP modules, ``mtp`` in its ``canonical``
    parameters, read ``D`` tokens past each chunk: :attr:`Split.ahead`; refused: an MoE model
    with per-sequence router losses on whose loss cannot join a sequence's rows
    (:func:`per_sequence_losses`))."""
    size = axis_size(plan.mesh, "context")
    if size == 1:
        return staged
    ahead = 0
    if canonical is not None and "mtp" in canonical:
        ahead = jax.tree.leaves(canonical["mtp"])[0].shape[0]
    if getattr(staged, "dropout", False):  # masks per example: a row must stay whole
        raise ValueError(
            f"context={size} cuts each row along the sequence, but this model draws dropout "
            "masks per example (a dropout rate above 0, plan.lora.dropout too); use mesh "
            "context=1, or dropout 0 (plan.lora.dropout=0)")
    if (getattr(staged, "loss_fn", None) is None and not joins_sequences(staged)
            and (losses := per_sequence_losses(staged))):
        raise ValueError(
            f"context={size} splits each sequence into chunk rows, but this mixture of experts "
            f"adds router losses per sequence ({', '.join(losses)}) in a loss that takes no "
            "`ops` keyword, so it cannot join a sequence's rows (declare `loss(..., ops=None)` "
            "and pass `ops.context.sequences` to moe_loss.add_router_losses as `sequences=`); load "
            "it with overrides={" + ", ".join(
                f"'{k.split('=')[0]}': 0.0" for k in losses) + "}, or use mesh context=1")
    if example is None or "tokens" not in example or len(example["tokens"].shape) != 2:
        raise ValueError(
            f"context={size} splits token sequences: the model needs a batch_spec() with "
            "'tokens' [batch, seq_len + 1] (a next-token language model)")
    seq = example["tokens"].shape[1] - 1
    check(size, seq)
    kernel = plan.context_kernel if kernel is None else kernel
    if kernel not in KERNELS:
        raise ValueError(f"context kernel {kernel!r} is unknown; use one of {KERNELS}")
    return ContextModel(staged, Split(size, seq, kernel, plan.mesh, plan.schedule is not None,
                                      ahead))


def joins_sequences(staged) -> bool:
    """Whether the model's own loss takes ``ops`` (and so :meth:`Joining.sequences`)."""
    graphdef = getattr(staged, "graphdef", None)
    owner = getattr(graphdef, "type", None) or getattr(
        getattr(graphdef, "nodes", [None])[0], "type", None)
    return owner is not None and takes_ops(owner, "loss")


def per_sequence_losses(staged) -> list[str]:
    """The router losses (``key=value``) an MoE model's config turns on: each is computed per
    sequence (:mod:`fiddlejax.models.moe_loss`), over rows that a split cuts into chunks. The
    config is the first in the model's graph (its own, the blocks' follow)."""
    for _, attr in getattr(getattr(staged, "graphdef", None), "attributes", ()):
        cfg = getattr(attr, "value", None)
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            if not getattr(cfg, "num_experts", 0):
                return []
            return [f"{k}={getattr(cfg, k)}" for k in ("router_aux_loss_coef",
                                                        "router_z_loss_coef")
                    if getattr(cfg, k, 0)]
    return []


class ContextAxis:
    """The ``context`` concern: sequences split over the axis; attention joins the shards
    (offered to blocks as ``ops.context``)."""

    axis, sets, offers = "context", frozenset({"staged"}), "context"

    def apply(self, draft: Draft) -> Draft:
        return dataclasses.replace(draft, staged=lay_out(draft.staged, draft.plan,
                                                         draft.example,
                                                         canonical=draft.canonical))


__all__ = ["KERNELS", "ContextAxis", "ContextModel", "Joining", "Split", "attention", "check",
           "joins_sequences", "lay_out", "per_sequence_losses", "pick", "sequence_sums",
           "split_batch"]
