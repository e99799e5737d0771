"""The schedule vocabulary: ops, default costs, ``ScheduleError``, ``Action`` and
``ScheduleLike``, the read-only view of a schedule that validation and the timelines take.

Plain data with no imports from the other modules, so every one of them can build on it;
the ``Schedule`` dataclass itself lives in ``schedule``, above validation and the timelines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

OPS = ("F", "B", "I", "W")
DEFAULT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class ScheduleError(ValueError):
    """A schedule that cannot run as written; the message names the first violation."""


class Action(NamedTuple):
    """One unit of work on a stage: ``op`` of ``microbatch`` through ``chunk``."""

    op: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.op}(m={self.microbatch}, chunk={self.chunk})"

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "microbatch": self.microbatch, "chunk": self.chunk}


class ScheduleLike(Protocol):
    """What ``validate``, ``simulate``, ``tick_table`` and ``stash_slots`` read of a schedule.

    ``Schedule`` provides all of it; typing against this protocol keeps validation and the
    timelines below the ``schedule`` module that builds on them.
    """

    @property
    def stages(self) -> int: ...

    @property
    def microbatches(self) -> int: ...

    @property
    def virtual_stages(self) -> int: ...

    @property
    def placement(self) -> tuple[int, ...]: ...

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]: ...

    @property
    def num_chunks(self) -> int: ...

    @property
    def total_microbatches(self) -> int: ...

    @property
    def num_actions(self) -> int: ...

    @property
    def held_peak(self) -> tuple[int, ...]: ...

    def chunks_of(self, stage: int) -> tuple[int, ...]: ...


def _action(a: Action | Mapping[str, Any] | tuple) -> Action:
    if isinstance(a, Mapping):
        return Action(a["op"], a["microbatch"], a["chunk"])
    return Action(*a)


def _short(a: Action) -> str:
    return f"{a.op}{a.microbatch}.{a.chunk}"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _count(value: object, name: str, minimum: int = 1) -> int:
    if not _is_int(value):
        hint = minimum
        if isinstance(value, float) and value.is_integer() and value >= minimum:
            hint = int(value)
        raise ScheduleError(f"{name}={value!r} must be an integer, e.g. {name}={hint}")
    if value < minimum:
        raise ScheduleError(f"{name}={value} must be at least {minimum}, e.g. {name}={minimum}")
    return value
