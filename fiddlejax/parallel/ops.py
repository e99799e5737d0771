"""What a layout offers a layer: the collectives its blocks call, handed over as an argument.

A parallel concern that changes how a block computes, not only where its arrays live, offers
the block a service: ``context`` joins the sequence's shards in attention
(:class:`fiddlejax.parallel.context.Joining`), ``expert`` sends MoE tokens to their experts'
devices (:class:`fiddlejax.parallel.expert.Split`). Each concern's wrapper adds its service to
the :class:`Ops` it passes down with the layer call (``staged.layer(params, x, ops)``); a block
whose ``__call__`` takes an ``ops`` keyword receives it and hands it to
``fiddlejax.models.common.attention`` and ``MoE``; ``None`` (every field unset) means the
block runs whole, as on one device. ``vocab`` (zero=3's vocabulary slices,
:class:`fiddlejax.compute.vocab.VocabShards`) is offered the same way to the model's own
``prologue``, ``head`` and ``loss`` when they take an ``ops`` keyword; ``encodings`` (the plan's
Gist encodings) to every one of them. Nothing reaches a block
through a side channel: a newcomer adding a concern adds a field here and an argument where
blocks use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


class ContextService(Protocol):
    """``context``'s offer (:class:`fiddlejax.parallel.context.Joining`): attention over the
    whole sequences of a layer's split rows."""

    def attention(self, q, k, v, *, causal: bool, segment_ids=None, **options): ...


class ExpertService(Protocol):
    """``expert``'s offer (:class:`fiddlejax.parallel.expert.Split`): the experts split over
    ``size`` devices, handed to :func:`fiddlejax.parallel.expert.dropless`."""

    size: int

    def local(self, num_experts: int) -> int: ...


class VocabService(Protocol):
    """zero=3's offer (:class:`fiddlejax.compute.vocab.VocabShards`): the embedding and head
    kept split by vocabulary over ``data``, read by ``fiddlejax.models.common.embedding``,
    ``vocab_rows`` and ``cross_entropy``."""

    def lookup(self, table, tokens): ...

    def rows(self, x): ...

    def cross_entropy(self, logits, targets, vocab_size: int): ...


@dataclasses.dataclass(frozen=True)
class Ops:
    """The services a layer's blocks may call (None: that concern is not split)."""

    context: ContextService | None = None
    expert: ExpertService | None = None
    vocab: VocabService | None = None  # for the prologue, head and loss (zero=3)
    # the plan's Gist encodings (fiddlejax.memory.gist.Encodings), for the prologue, layers
    # and head: how the model-facing gist functions stash their inputs
    encodings: Any = None

    def adding(self, **services: Any) -> Ops:
        """These ops with ``services`` added (a wrapper's step on the way down)."""
        return dataclasses.replace(self, **services)


NONE = Ops()


def extend(ops: Ops | None, **services: Any) -> Ops:
    """``ops`` (None: none yet) with ``services`` added."""
    return (ops or NONE).adding(**services)
