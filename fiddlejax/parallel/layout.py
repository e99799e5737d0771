"""``Layout``: one model laid out on the mesh, as :func:`fiddlejax.parallel.compose.lay_out`
made it. It holds no arrays: the structure every step function and conversion reads (the
model as it computes, its pipeline, its storage over ``data``, every sharding).

(:mod:`fiddlejax.layout` is lower: the per-parameter primitives, vocabulary padding and specs.)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import optax
from flax import nnx
from jax.sharding import NamedSharding

from fiddlejax import layout
from fiddlejax.parallel import tensor
from fiddlejax.parallel.concern import Stepper
from fiddlejax.parallel.zero import Zero
from fiddlejax.plan import Plan
from fiddlejax.staged import StagedModel
from fiddlejax.state import TrainState

if TYPE_CHECKING:
    from fiddlejax.compute import ViewedModel
    from fiddlejax.pipeline.runtime import Pipeline


@dataclasses.dataclass
class Layout:
    """How one model, optimizer and plan are laid out (see the module docstring)."""

    plan: Plan
    name: str                   # the model's class name, for messages
    source: StagedModel         # the model as it computes (no gathers, no casts)
    model: StagedModel | ViewedModel  # as a step runs it (through the ZeRO view, if any)
    template: nnx.State         # canonical parameters as ShapeDtypeStructs
    pipeline: Pipeline | None
    zero: Zero
    specs: nnx.State            # the internal parameters' PartitionSpecs
    param_shardings: nnx.State  # of NamedSharding, like the internal parameters
    grad_shardings: nnx.State
    opt_shardings: optax.OptState  # the optimizer state's own pytree, of NamedSharding
    residual_shardings: nnx.State | None  # top-k's per-replica residual
    state_shardings: TrainState
    batch_sharding: NamedSharding
    stepper: Stepper

    @property
    def mesh(self):
        return self.plan.mesh

    def to_internal(self, canonical: nnx.State,
                    shardings: nnx.State | optax.OptState | None = None) -> nnx.State:
        """Canonical parameters in this layout. ``shardings``: the internal tree's (default:
        the parameters'; an optimizer-state tree passes its own, ZeRO's split included)."""
        return to_internal(self.source, self.pipeline, self.plan, canonical,
                            shardings if shardings is not None else self.param_shardings)

    def to_canonical(self, internal: nnx.State, shardings: nnx.State | None = None) -> nnx.State:
        """The inverse of :meth:`to_internal`."""
        params = (self.pipeline.to_canonical(internal, shardings or self.param_shardings)
                  if self.pipeline else internal)
        return layout.unpad_vocab(self.source.to_model(params), self.template)



def to_internal(staged, pipeline, plan: Plan, canonical: nnx.State, shardings) -> nnx.State:
    """Canonical parameters in the internal tree (stacked, vocabulary-padded, per stage)."""
    # An adapted model's blocks are stacked first (fiddlejax.adaptation.adapt), then vocabularies
    # padded.
    params = layout.pad_vocab(staged.to_staged(canonical), tensor.vocab_multiple(plan))
    return params if pipeline is None else pipeline.to_internal(params, shardings)
