"""Logical axis names -> mesh ``PartitionSpec``s.

Models annotate parameters with logical names (``out_sharding`` metadata such as
``("embed", "mlp")``); the rules below map them to mesh axes, giving Megatron's tensor
parallelism: attention heads and the MLP hidden dimension are split over ``tensor``
(column-parallel in, row-parallel out) and the vocabulary is split over ``tensor``
(vocabulary-parallel embedding and head).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

# Logical axis -> mesh axis (None: replicated).
DEFAULT_RULES: Mapping[str, str | None] = {
    "batch": "data",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",  # grouped-query attention's key/value heads
    "mlp": "tensor",
    "embed": None,
    "head_dim": None,
    "layers": None,
    "seq": None,
    "channels": None,
    "height": None,
    "width": None,
    "classes": None,
}


def logical_to_spec(
    names: Sequence[str | None] | None, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> P:
    """Map a tuple of logical axis names to a ``PartitionSpec`` through ``rules``."""
    if not names:
        return P()
    out = []
    for n in names:
        if n is None:
            out.append(None)
        elif n in rules:
            out.append(rules[n])
        else:
            raise ValueError(
                f"logical axis {n!r} has no sharding rule; known: {sorted(rules)}. "
                "Add it to the rules or use one of the known names"
            )
    return P(*out)


def logical_names(state: nnx.State) -> nnx.State:
    """The logical ``out_sharding`` names of every variable (``()`` when unannotated)."""

    def names(v):
        meta = v.get_metadata() if isinstance(v, nnx.Variable) else {}
        return tuple(meta.get("out_sharding") or ())

    return jax.tree.map(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_specs(
    state: nnx.State, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> nnx.State:
    """A ``PartitionSpec`` per variable of ``state`` (an ``nnx.state(model, ...)`` tree)."""

    def spec(v):
        meta = v.get_metadata() if isinstance(v, nnx.Variable) else {}
        return logical_to_spec(meta.get("out_sharding"), rules)

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
