"""Sequence parallelism on the ``tensor`` axis (Megatron-SP, Korthikanti et al. 2022).

Tensor parallelism splits the matmuls, but between them every device of a tensor group holds
the whole residual stream, the norms' inputs and outputs and (with packed batches) the side
channels: replicated activations, the same on all ``tensor`` devices. With
``Plan(sequence_parallel=True)`` each layer's input and output are constrained to be split
over ``tensor`` along the sequence; the GSPMD partitioner then runs the norms and residual
adds on ``1/tensor`` of the tokens and turns Megatron's all-reduce after the row-parallel
matmuls into a reduce-scatter, with an all-gather before the column-parallel ones (the same
bytes on the wire as the all-reduce). What a layer keeps for its backward at its boundary
(the whole of it under ``remat="full"``) shrinks by ``(tensor - 1) / tensor``.
With ``context`` the rows stay on ``context`` and the tokens of each row split over
``tensor``.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax.mesh import axis_size
from fiddlejax.parallel.concern import Draft


class SequenceParallel:
    """A staged model whose layers' inputs and outputs are split over ``tensor`` along the
    sequence (their second axis). Everything else is the wrapped model's."""

    def __init__(self, inner, mesh, rows: str | None):
        self._inner, self._mesh, self._rows = inner, mesh, rows

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _split(self, msg):
        """The message's ``[rows, tokens, features]`` leaves split over ``tensor`` along the
        tokens (the activation, a router tally); smaller leaves (segment ids) left as they are."""
        mesh = jax.sharding.get_abstract_mesh()
        mesh = self._mesh if mesh.empty else mesh
        rows = self._rows if self._rows is not None else P.UNCONSTRAINED

        def split(x):
            if getattr(x, "ndim", 0) < 3:
                return x
            spec = P(rows, "tensor", *([None] * (x.ndim - 2)))
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

        return jax.tree.map(split, msg)

    def layer(self, layer_params, x, ops=None):
        return self._split(self._inner.layer(layer_params, self._split(x), ops))


def lay_out(staged, plan, example: dict | None):
    """The sequence-parallel step of :func:`fiddlejax.parallel.compose.lay_out`: ``staged``
    itself unless ``plan.sequence_parallel``; checks the sequence divides ``tensor``."""
    if not plan.sequence_parallel:
        return staged
    t, c = plan.tensor, axis_size(plan.mesh, "context")
    if example is not None and "tokens" in example and len(example["tokens"].shape) == 2:
        seq = example["tokens"].shape[1] - 1
        local = seq // (2 * c) if c > 1 else seq
        if local % t:
            where = (f"each of its context={c} shards' rows holds {local} tokens"
                     if c > 1 else f"its sequence holds {seq} tokens")
            raise ValueError(
                f"sequence_parallel=True splits each row's tokens over tensor={t}, but {where}, "
                f"not a multiple of {t}; change seq_len, or drop sequence_parallel")
    return SequenceParallel(staged, plan.mesh, "context" if c > 1 else None)


class SequenceSplit:
    """Sequence parallelism (``plan.sequence_parallel``): the residual stream between the
    tensor-split matmuls split over ``tensor`` along the sequence."""

    axis, sets, offers = "tensor", frozenset({"staged"}), None

    def apply(self, draft: Draft) -> Draft:
        return dataclasses.replace(draft, staged=lay_out(draft.staged, draft.plan,
                                                         draft.example))


__all__ = ["SequenceParallel", "SequenceSplit", "lay_out"]
