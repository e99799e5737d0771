"""One protocol for a parallel concern, and the draft layout the concerns fold over.

A concern (``tensor``, ``context``, sequence parallelism, ``expert``, LoRA's freezing,
``pipe``, ``data`` as a store, ``data`` as replicas) is a typed object that declares what it
does to a layout being built:

- ``sets``: the :class:`Draft` fields it writes: ``staged`` (it wraps the model as it
  computes), ``pipeline``, ``internal`` and ``specs`` (the parameters' tree and where it lives),
  ``zero`` and ``model`` (how the parameters are stored and seen), ``stepper`` (the state the
  gradient exchange adds to ``TrainState``);
- ``offers``: the field of :class:`fiddlejax.parallel.ops.Ops` its wrapper hands to every layer
  call (the collectives blocks may use; ``data``'s store hands ``vocab`` to the model's own
  prologue, head and loss instead), or None;
- ``apply(draft) -> draft``: the step itself, a pure function of the draft.

:func:`fold` applies an ordered tuple of them (``fiddlejax.parallel.compose.CONCERNS``) and
refuses a concern that writes a field it did not declare, so the declaration is the truth and
nothing is patched afterwards: a newcomer adding an axis writes one class and adds it to the
tuple where it belongs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import optax
from flax import nnx

from fiddlejax.plan import Plan

if TYPE_CHECKING:
    from fiddlejax.pipeline.runtime import Pipeline

class Stepper(Protocol):
    """How gradients are exchanged (:func:`fiddlejax.parallel.exchange.pick`'s choice): what
    the state holds for it and what it accepts."""

    residual: bool          # a per-replica residual in TrainState (top-k's error feedback)
    local_optimizer: bool   # one optimizer state per data replica
    versions: int           # weight versions in TrainState (2BW keeps two)

    def check(self, optimizer: optax.GradientTransformation) -> None: ...


FIELDS = ("staged", "pipeline", "internal", "specs", "zero", "model", "stepper")


@dataclasses.dataclass(frozen=True)
class Draft:
    """A layout being built: the job's inputs, then what the concerns so far have made."""

    plan: Plan
    name: str                        # the model's class name, for messages
    canonical: nnx.State             # the parameters as the user's model holds them
    template: nnx.State              # the same as ShapeDtypeStructs
    example: dict | None             # one microbatch's shapes (``batch_spec(1)``)
    optimizer: optax.GradientTransformation
    staged: Any                      # the model as it computes, wrapped by each concern so far
    pipeline: Pipeline | None = None
    internal: nnx.State | None = None  # the internal parameters' ShapeDtypeStructs
    specs: nnx.State | None = None     # their PartitionSpecs
    zero: object | None = None       # a fiddlejax.parallel.zero.Zero (a concern: not imported)
    model: Any = None                # as a step sees it (through the ZeRO view), if not staged
    stepper: Stepper | None = None


class Concern(Protocol):
    """One parallel concern (see the module docstring)."""

    axis: str                 # the mesh axis it serves ("" for one that splits none)
    sets: frozenset[str]      # the Draft fields it writes
    offers: str | None        # the Ops field its wrapper adds for blocks

    def apply(self, draft: Draft) -> Draft: ...


def fold(concerns: tuple[Concern, ...], draft: Draft) -> Draft:
    """``draft`` after each concern in turn; a concern that writes an undeclared field is a
    bug in that concern, named here rather than found as a wrong layout later."""
    for concern in concerns:
        after = concern.apply(draft)
        wrote = {f for f in FIELDS if getattr(after, f) is not getattr(draft, f)}
        inputs = {f.name for f in dataclasses.fields(Draft)} - set(FIELDS)
        wrote |= {f for f in inputs if getattr(after, f) is not getattr(draft, f)}
        if not wrote <= concern.sets:
            raise TypeError(f"{type(concern).__name__} wrote {sorted(wrote - concern.sets)} "
                            f"but declares sets={sorted(concern.sets)}")
        draft = after
    return draft
