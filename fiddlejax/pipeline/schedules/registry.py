"""The registry of schedule kinds and ``build``, the one entry point that generates and
validates a schedule of a named kind; the built-in kinds register here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fiddlejax.pipeline.schedules.generators import (
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    two_bw,
    weight_updates,
)
from fiddlejax.pipeline.schedules.ir import _count
from fiddlejax.pipeline.schedules.schedule import Schedule
from fiddlejax.pipeline.schedules.validation import validate
from fiddlejax.pipeline.schedules.zero_bubble import interleaved_zb, zb_h1, zb_v

Generator = Callable[[int, int, int], Schedule]


MinMicrobatches = Callable[[int, int], int]


@dataclass(frozen=True)
class _Entry:
    generator: Generator
    virtual: bool
    min_microbatches: MinMicrobatches | None
    multistep: bool = False  # the generator takes steps= (runs several optimizer steps)


_REGISTRY: dict[str, _Entry] = {}


def _normal(kind: str) -> str:
    return kind.strip().lower().replace("_", "-")


def register(
    kind: str,
    generator: Generator,
    *,
    virtual: bool = False,
    min_microbatches: MinMicrobatches | None = None,
    multistep: bool = False,
) -> None:
    """Make ``build(kind, ...)`` call ``generator(stages, microbatches, virtual_stages)``.

    ``virtual`` says whether the kind uses ``virtual_stages`` > 1 (kinds that do not accept
    only 1). ``min_microbatches(stages, virtual_stages)``, if given, is the fewest microbatches
    the kind can schedule; ``build`` reports anything lower. The generator returns a
    ``Schedule`` with any placement it likes; ``build`` validates it, and the runtime only
    reads the schedule, so a new kind needs no runtime change.
    """
    if not isinstance(kind, str) or not kind.strip():
        raise ValueError(f"kind={kind!r} must be a non-empty string")
    _REGISTRY[_normal(kind)] = _Entry(generator, virtual, min_microbatches, multistep)


def interleaves(kind: str) -> bool:
    """Whether ``kind`` places several chunks per stage (takes ``virtual_stages``)."""
    entry = _REGISTRY.get(_normal(kind)) if isinstance(kind, str) else None
    return bool(entry and entry.virtual)


def kinds() -> list[str]:
    """Registered schedule kinds, in registration order."""
    return list(_REGISTRY)


def build(kind: str, stages: int, microbatches: int, virtual_stages: int | None = None,
          steps: int = 1) -> Schedule:
    """Generate and validate a schedule of a registered ``kind``.

    ``virtual_stages`` defaults to 1, or to 2 for kinds that interleave. ``steps`` > 1 (optimizer
    steps without a flush between them) is for multi-step kinds (``2bw``).
    """
    if not isinstance(kind, str) or _normal(kind) not in _REGISTRY:
        raise ValueError(f"unknown schedule kind {kind!r}; known kinds: {', '.join(_REGISTRY)}")
    kind = _normal(kind)
    entry = _REGISTRY[kind]
    stages = _count(stages, "stages")
    microbatches = _count(microbatches, "microbatches")
    if virtual_stages is None:
        virtual_stages = 2 if entry.virtual else 1
    virtual_stages = _count(virtual_stages, "virtual_stages")
    if virtual_stages != 1 and not entry.virtual:
        _unused("virtual_stages", virtual_stages, kind, "virtual", "")
    steps = _count(steps, "steps")
    if steps != 1 and not entry.multistep:
        _unused("steps", steps, kind, "multistep", " (it flushes every step)")
    if entry.min_microbatches is not None:
        need = entry.min_microbatches(stages, virtual_stages)
        if microbatches < need:
            raise ValueError(
                f"microbatches={microbatches} is too few for {kind} with stages={stages} and "
                f"virtual_stages={virtual_stages}; use at least {need}"
            )
    if entry.multistep:
        schedule = validate(entry.generator(stages, microbatches, virtual_stages, steps=steps))
        weight_updates(schedule)  # two weight versions must be enough
        return schedule
    return validate(entry.generator(stages, microbatches, virtual_stages))


def _unused(name: str, value: int, kind: str, flag: str, why: str) -> None:
    """Raise for an option ``kind`` ignores, naming the kinds that take it."""
    users = [k for k, e in _REGISTRY.items() if getattr(e, flag)]
    raise ValueError(f"{name}={value} is not used by {kind!r}{why}; leave it at 1 or use one "
                     f"of: {', '.join(users)}")


register("gpipe", gpipe)
register("1f1b", one_f_one_b)
register("interleaved-1f1b", interleaved_1f1b, virtual=True)
register("zb-h1", zb_h1)
register("2bw", two_bw, multistep=True)
register("zb-v", zb_v, virtual=True)
register("interleaved-zb", interleaved_zb, virtual=True)
