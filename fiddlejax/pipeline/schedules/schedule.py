"""The ``Schedule`` dataclass and its JSON form (``load``, ``dump``).

Sits above ``validation`` and ``timeline``: the members that validate or simulate
(``from_dict``, ``simulation``, ``bubble_fraction``, ``ticks``) call them directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from fiddlejax.pipeline.schedules.ir import (
    OPS,
    Action,
    ScheduleError,
    _action,
    _count,
    _is_int,
    _short,
)
from fiddlejax.pipeline.schedules.timeline import Simulation, TickTable, simulate, tick_table
from fiddlejax.pipeline.schedules.validation import validate


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered action lists plus the chunk placement they run against.

    Construction does not validate (so broken hand-written schedules can be inspected and
    reported); ``build`` and ``load`` do. Derived figures are computed on first use.
    """

    kind: str
    stages: int
    microbatches: int
    virtual_stages: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    steps: int = 1  # optimizer steps the actions span (PipeDream-2BW runs several unflushed)

    def __post_init__(self) -> None:
        # Accept lists (hand-written code, JSON) but store tuples so the schedule is hashable.
        object.__setattr__(self, "placement", tuple(self.placement))
        object.__setattr__(
            self, "actions", tuple(tuple(_action(a) for a in row) for row in self.actions)
        )

    @property
    def num_chunks(self) -> int:
        return len(self.placement)

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """Chunks held by ``stage``, in model order."""
        return tuple(c for c, s in enumerate(self.placement) if s == stage)

    @property
    def total_microbatches(self) -> int:
        """Microbatch indices run over 0 .. steps x microbatches - 1."""
        return self.steps * self.microbatches

    def step_of(self, a: Action) -> int:
        """The optimizer step (batch) an action belongs to: its weight version's tag.

        In a ``2bw`` schedule the microbatches of step k run on the weights of version k-1
        (one step stale), so this is the version each action uses, offset by one.
        """
        return a.microbatch // self.microbatches

    @property
    def num_actions(self) -> int:
        return sum(len(row) for row in self.actions)

    @property
    def split_backward(self) -> bool:
        """True when the schedule uses I/W (zero-bubble style) anywhere."""
        return any(a.op in "IW" for row in self.actions for a in row)

    @cached_property
    def held_peak(self) -> tuple[int, ...]:
        """Per stage, the most (microbatch, chunk) activations held at once.

        Depends only on each stage's order (F adds one, B or W releases one), not on timing,
        so it is also the stash size the runtime needs on that stage.
        """
        peaks = []
        for row in self.actions:
            held = peak = 0
            for a in row:
                if a.op == "F":
                    held += 1
                    peak = max(peak, held)
                elif a.op in "BW":
                    held -= 1
            peaks.append(peak)
        return tuple(peaks)

    @property
    def max_held(self) -> int:
        return max(self.held_peak, default=0)

    @cached_property
    def simulation(self) -> Simulation:
        """Timeline with the default unit costs F=1, B=2, I=1, W=1 and no latency."""
        return simulate(self)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of stage-time in the default-cost timeline (see ``simulate``)."""
        return self.simulation.bubble_fraction

    @cached_property
    def ticks(self) -> TickTable:
        """The lockstep tick table the SPMD runtime executes (see ``tick_table``)."""
        return tick_table(self)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of docs/pipeline.md (plain lists and dicts)."""
        return {
            "kind": self.kind,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "placement": list(self.placement),
            "actions": [[self._action_dict(a) for a in row] for row in self.actions],
            **({"steps": self.steps} if self.steps > 1 else {}),
        }

    def _action_dict(self, a: Action) -> dict[str, Any]:
        return a.to_dict() | ({"step": self.step_of(a)} if self.steps > 1 else {})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check: bool = True) -> Schedule:
        """Parse the JSON form; with ``check`` (default) also ``validate`` it."""
        schedule = _parse(data)
        if check:
            validate(schedule)
        return schedule

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        head = (
            f"{self.kind}: stages={self.stages} microbatches={self.microbatches} "
            f"virtual_stages={self.virtual_stages}"
        )
        rows = [f"  stage {s}: " + " ".join(map(_short, row)) for s, row in enumerate(self.actions)]
        return "\n".join([head, *rows])


# ---------------------------------------------------------------------------------------------
# JSON


def _parse(data: Mapping[str, Any]) -> Schedule:
    if not isinstance(data, Mapping):
        raise ScheduleError(f"a schedule must be a JSON object, got {type(data).__name__}")
    missing = [k for k in ("stages", "microbatches", "placement", "actions") if k not in data]
    if missing:
        raise ScheduleError(f"schedule JSON lacks {', '.join(map(repr, missing))}")
    stages = _count(data["stages"], "stages")
    microbatches = _count(data["microbatches"], "microbatches")
    placement = data["placement"]
    if not isinstance(placement, list) or not all(_is_int(x) for x in placement):
        raise ScheduleError(f"placement={placement!r} must be a list of stage indices")
    virtual_stages = data.get("virtual_stages")
    if virtual_stages is None:
        virtual_stages = max(1, len(placement) // stages)
    virtual_stages = _count(virtual_stages, "virtual_stages")
    rows = data["actions"]
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ScheduleError("actions must be a list with one list of actions per stage")
    actions = []
    for s, row in enumerate(rows):
        parsed = []
        for i, a in enumerate(row):
            where = f"actions[{s}][{i}]"
            if not isinstance(a, Mapping) or not {"op", "microbatch", "chunk"} <= set(a):
                raise ScheduleError(f"{where}={a!r} must be {{'op', 'microbatch', 'chunk'}}")
            if a["op"] not in OPS:
                raise ScheduleError(f"{where}.op={a['op']!r} is not one of {', '.join(OPS)}")
            if not _is_int(a["microbatch"]) or not _is_int(a["chunk"]):
                raise ScheduleError(f"{where}={a!r}: microbatch and chunk must be integers")
            parsed.append(Action(a["op"], a["microbatch"], a["chunk"]))
        actions.append(parsed)
    return Schedule(
        kind=str(data.get("kind", "custom")),
        stages=stages,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        placement=placement,
        actions=actions,
        steps=_count(data.get("steps", 1), "steps"),
    )


def load(source: str | os.PathLike[str] | Mapping[str, Any], *, check: bool = True) -> Schedule:
    """Load a schedule from a JSON string, a path to a JSON file, or an already-parsed dict."""
    if isinstance(source, Mapping):
        return Schedule.from_dict(source, check=check)
    text = str(source)
    if not text.lstrip().startswith("{"):
        text = Path(source).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ScheduleError(f"schedule is not valid JSON: {err}") from err
    return Schedule.from_dict(data, check=check)


def dump(schedule: Schedule, path: str | os.PathLike[str] | None = None) -> str:
    """The schedule as JSON, one stage's action list per line (easy to read and edit by hand).

    Also written to ``path`` when given. ``load`` reads it back.
    """
    d = schedule.to_dict()
    head = [f" {json.dumps(k)}: {json.dumps(d[k])}," for k in d if k != "actions"]
    rows = ",\n".join("  " + json.dumps(row) for row in d["actions"])
    text = "{\n" + "\n".join(head) + '\n "actions": [\n' + rows + "\n ]\n}"
    if path is not None:
        Path(path).write_text(text + "\n")
    return text

