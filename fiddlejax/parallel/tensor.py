"""The ``tensor`` axis: Megatron-style splits of the parameters, from their logical axis names.

Each parameter's logical names (``vocab``, ``heads``, ``mlp``, ...) map to mesh axes through the
plan's rules; matmuls on split weights get their all-reduces from the GSPMD partitioner. A
vocabulary is padded to a multiple of the devices that split it, and the padding is sliced off
every output before a loss sees it (``staged.unpad_outputs``), so it never changes a number.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from fiddlejax import layout, sharding
from fiddlejax.parallel.concern import Draft
from fiddlejax.plan import Plan
from fiddlejax.staged import StagedModel


def vocab_multiple(plan: Plan) -> int:
    """Vocabularies split over ``tensor``, and over ``pipe`` too in a pipeline (its embedding
    and head are not replicated per stage), pad to a multiple of those devices."""
    return plan.tensor * (plan.pipe if plan.schedule is not None else 1)


def with_vocab_pads(staged: StagedModel, canonical: nnx.State, plan: Plan) -> StagedModel:
    """``staged`` told which vocabulary sizes are padded, so it slices its outputs back."""
    return dataclasses.replace(
        staged, vocab_pads=layout.vocab_pads(canonical, vocab_multiple(plan)))


def param_specs(internal: nnx.State, plan: Plan, pipeline, model_name: str) -> nnx.State:
    """A PartitionSpec per internal parameter over ``tensor`` (and ``pipe`` for a pipeline's
    stages), checked to divide the mesh before anything compiles."""
    specs = (pipeline.param_specs(internal) if pipeline is not None
             else layout.specs(internal, plan.axis_rules))
    layout.check_divisible(internal, specs, plan.mesh)
    sharding.tensor_unused(specs, plan.tensor, model_name)  # warns at the user's call
    if plan.tensor > 1:
        logging.getLogger("fiddlejax").info("%s on tensor=%d: %s", model_name, plan.tensor,
                                            split_summary(specs))
    return specs


class VocabPads:
    """The ``tensor`` concern's first step: vocabularies padded for their split, the model told
    which so it slices its outputs back."""

    axis, sets, offers = "tensor", frozenset({"staged"}), None

    def apply(self, draft: Draft) -> Draft:
        return dataclasses.replace(draft, staged=with_vocab_pads(draft.staged, draft.canonical,
                                                                 draft.plan))


class Specs:
    """The ``tensor`` concern's second step, once ``pipe`` has fixed the internal tree: each
    parameter's spec over ``tensor`` (and ``pipe``)."""

    axis, sets, offers = "tensor", frozenset({"specs"}), None

    def apply(self, draft: Draft) -> Draft:
        return dataclasses.replace(draft, specs=param_specs(draft.internal, draft.plan,
                                                            draft.pipeline, draft.name))


def split_summary(specs: nnx.State) -> str:
    """Which parameters ``specs`` split over ``tensor``, and on which dimension: one line."""
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    named = {}
    for path, spec in flat:
        spec = spec.get_value() if isinstance(spec, nnx.Variable) else spec
        dims = [i for i, a in enumerate(spec)
                if a == "tensor" or (isinstance(a, tuple) and "tensor" in a)]
        if dims:
            named["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = dims
    if not named:
        return f"none of its {len(flat)} parameters is split over `tensor`"
    shown = ", ".join(f"{p} (dim {d[0]})" for p, d in list(named.items())[:8])
    return (f"{len(named)} of {len(flat)} parameters split over `tensor`: {shown}"
            f"{', ...' if len(named) > 8 else ''}")
