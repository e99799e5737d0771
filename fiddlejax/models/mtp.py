"""DeepSeek-V3's multi-token prediction (MTP, the paper's section 2.2): ``D`` sequential
modules, each predicting one token further, trained beside the next-token loss.

Depth ``k`` (1..D) at position ``i``: ``h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})]``
(``enorm``, ``hnorm``, ``eh_proj`` ``[2d, d]``), then the module's own transformer block (a
DeepSeek MoE layer: latent attention over the same positions, causal, within the document),
giving ``h_i^k``; the shared head (``head_norm`` then the main model's vocabulary projection)
predicts ``t_{i+k+1}``. ``h^0`` is the main model's last hidden state after its final norm, and
the embedding and output projection are the main model's own, as vLLM, SGLang and Megatron-LM
run the Hub's weights (the concatenation is ``[embedding; hidden]``, the order of the Hub's
``eh_proj``, whatever order the paper writes).

The loss: ``main + mtp_loss_weight / D * sum_k L_k``, with ``L_k`` the summed cross-entropy of
depth ``k``'s targets divided by the main loss's target count (the paper's ``1/T``, eq. 24), so
the total stays one ``(sum, weight)`` pair that every layout reduces exactly. A target counts
where the main loss would count it (its ``loss_mask``, not padding) and only inside the
document of the position that predicts it (packed rows: no prediction across a boundary).

Not here: the MTP block's router bias is held as loaded (the loss-free balancing steers the
main MoE layers) and its routing adds no router losses.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fiddlejax.parallel.ops import Ops

from . import moe_loss
from .common import Message, cross_entropy, param, positions_of, vocab_rows
from .decoder import RMSNorm


class MTPLayer(nnx.Module):
    """One depth: the two norms, the projection ``eh_proj``, a block (``make_block``), the head's
    norm (the Hub's ``shared_head.norm``)."""

    def __init__(self, hidden_size: int, eps: float, make_block: Callable, *, rngs: nnx.Rngs):
        d = hidden_size
        self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.eh_proj = param(rngs, jax.nn.initializers.normal(0.02), (2 * d, d), (None, "embed"))
        self.block = make_block(rngs)
        self.head_norm = RMSNorm(d, eps)

    def __call__(self, h: jax.Array, emb: jax.Array, segment_ids, positions,
                 ops: Ops | None = None) -> jax.Array:
        """``h^k`` from ``h^{k-1}`` and the embeddings of the tokens ``k`` ahead (``ops``: the
        loss's; its ``context`` joins the block's attention over a split sequence)."""
        x = jnp.concatenate([self.enorm(emb), self.hnorm(h)], -1) @ self.eh_proj[...]
        tally = moe_loss.empty(x.shape[:-1], self.block.config.num_experts)  # not reported
        msg = Message(x.astype(h.dtype), segment_ids, positions, tally=tally)
        return self.block(msg, ops).x


def same(a, b, rows: int = 4096) -> bool:
    """Whether two stored tensors (:mod:`.hf_io` sources) hold the same values, read by
    blocks of ``rows`` rows (the Hub's embedding and head copies: ``[vocab, d]``)."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    n, rest = a.shape[0], tuple(slice(0, m) for m in a.shape[1:])
    return all(np.array_equal(a.read((slice(i, min(n, i + rows)), *rest)),
                              b.read((slice(i, min(n, i + rows)), *rest)))
               for i in range(0, n, rows))


def shifted(a: jax.Array, k: int, t: int, after: jax.Array | None = None) -> jax.Array:
    """``a[:, k:k + t]`` (``a [B, S]``), continued past its end by ``after`` (the columns that
    follow a chunk row of a ``context`` split: ``batch["ahead"]``), else by zeros."""
    pad = after if after is not None else jnp.zeros((a.shape[0], max(0, k + t - a.shape[1])),
                                                    a.dtype)
    return jnp.concatenate([a, pad], 1)[:, k:k + t]


def ahead_of(batch: dict, key: str, k: int, t: int) -> jax.Array:
    """``shifted(batch[key], k, t)``, continued by the batch's ``ahead`` columns when a
    ``context`` split cut the row from a longer sequence
    (:func:`fiddlejax.parallel.context.split_batch`)."""
    a = batch[key] if key != "inside" else jnp.ones_like(batch["tokens"])
    return shifted(a, k, t, batch.get("ahead", {}).get(key))


def targets(batch: dict, k: int, t: int) -> tuple[jax.Array, jax.Array]:
    """Depth ``k``'s targets ``t_{i+k+1}`` ``[B, t]`` and which of them count: inside the
    sequence, in the document of position ``i`` (not padding) and kept by ``loss_mask``."""
    tgt = ahead_of(batch, "tokens", k + 1, t)
    valid = ahead_of(batch, "inside", k + 1, t) > 0
    if (seg := batch.get("segment_ids")) is not None:
        ahead = ahead_of(batch, "segment_ids", k + 1, t)
        valid = valid & (ahead == seg[:, :t]) & (ahead > 0)
    if batch.get("loss_mask") is not None:
        valid = valid & (ahead_of(batch, "loss_mask", k + 1, t) > 0)
    return tgt, valid


def depth_sums(model, hidden: jax.Array, batch: dict, ops=None) -> jax.Array:
    """``[D]``: each depth's cross-entropy summed over its counted targets, from the main
    model's normed last hidden state ``hidden [B, T, d]`` (``model``: the DeepSeek-V3 holding
    ``mtp``, ``embed_tokens`` and the head's projection; ``ops``: its loss's, whose
    ``vocab`` keeps zero=3's vocabulary slices split)."""
    c, t = model.config, hidden.shape[1]
    seg, pos = batch.get("segment_ids"), batch.get("positions")
    seg = None if seg is None else seg[:, :t]
    if seg is not None and pos is None:
        pos = positions_of(seg)
    pos = None if pos is None else pos[:, :t]
    head = model.embed[...].T if c.tie_word_embeddings else model.lm_head[...]
    graphdef, state = nnx.split(model.mtp)
    sums = []
    h = hidden
    for k in range(1, c.num_nextn_predict_layers + 1):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], state))
        emb = model.embed_tokens(ahead_of(batch, "tokens", k, t), ops)
        h = layer(h, emb, seg, pos, ops)
        logits = vocab_rows(layer.head_norm(h), ops) @ head
        tgt, valid = targets(batch, k, t)
        ce = cross_entropy(logits, tgt, c.vocab_size, ops)
        sums.append(jnp.sum(jnp.where(valid, ce, 0.0)))
    return jnp.stack(sums)


def add_to_loss(value, sums: jax.Array, weight: float, tokens: int):
    """The main loss ``value`` (a mean over ``tokens`` targets, or ``(sum, count)``) plus
    ``weight`` times the depths' mean ``sums`` over the same count; and that mean alone, as the
    loss averages it (the metric ``mtp_loss``)."""
    mean = jnp.mean(sums)
    if isinstance(value, tuple | list):
        return (value[0] + weight * mean, value[1]), mean
    return value + weight * mean / tokens, mean / tokens


def check(depth: int, weight: float, where: str) -> None:
    """Refuse a depth below 0 or a negative weight, by name."""
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise ValueError(f"{where}.num_nextn_predict_layers={depth!r} must be an int >= 0 "
                         "(0: no multi-token prediction)")
    if not isinstance(weight, int | float) or isinstance(weight, bool) or weight < 0:
        raise ValueError(f"{where}.mtp_loss_weight={weight!r} must be a number >= 0")


__all__ = ["MTPLayer", "add_to_loss", "ahead_of", "check", "depth_sums", "same", "shifted",
           "targets"]
