"""What one config key accepts (:class:`Spec`), and the message that says so when it is not."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one key accepts: a type, optional choices and bounds, null, and extra words."""

    kind: type  # int, float, bool, str, list or dict
    choices: tuple | Callable[[], tuple] = ()  # allowed values (empty: any), or a function
    # that reads them from the module that owns them when a value is checked
    lo: float | None = None  # inclusive lower bound (exclusive when ``open_lo``)
    hi: float | None = None  # inclusive upper bound (exclusive when ``open_hi``)
    open_lo: bool = False
    open_hi: bool = False
    null: bool = False  # null is allowed
    words: tuple = ()  # strings a numeric key also takes ("auto")
    empty: bool = True  # a string key may be "" (paths may not: "" would mean "off" silently)

    def resolved(self) -> Spec:
        """This spec with choices another module owns (schedule kinds, remat policies,
        all-reduce algorithms) read now, so a kind registered there is accepted here."""
        if callable(self.choices):
            return dataclasses.replace(self, choices=tuple(self.choices()))
        return self

    def expected(self) -> str:
        extra = [repr(w) for w in self.words] + (["null"] if self.null else [])
        if self.choices:
            return _either([repr(c) for c in self.resolved().choices] + extra)
        if self.kind is bool:
            text = "true or false"
        elif self.kind is list:
            text = "a list, e.g. [a, b]"
        elif self.kind is dict:
            text = "a mapping, e.g. {a: b}"
        elif self.kind is str:
            text = "a string" if self.empty else "a non-empty string"
        else:
            text = "an integer" if self.kind is int else "a number"
            bounds = []
            if self.lo is not None:
                bounds.append(f"{'>' if self.open_lo else '>='} {_num(self.lo)}")
            if self.hi is not None:
                bounds.append(f"{'<' if self.open_hi else '<='} {_num(self.hi)}")
            text += (" " + " and ".join(bounds)) if bounds else ""
        return _either([text, *extra]) if extra else text

    def ok(self, v: Any) -> bool:
        choices = self.resolved().choices
        if v is None:
            return self.null
        if isinstance(v, str) and v in self.words:
            return True
        if self.kind is bool:
            return isinstance(v, bool)
        if self.kind is list:
            return isinstance(v, list)
        if self.kind is dict:
            return isinstance(v, dict)
        if self.kind is str:
            return (isinstance(v, str) and (not choices or v in choices)
                    and (self.empty or bool(v.strip())))
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return False  # NaN passes every comparison, so it must be refused by name
        if choices and v not in choices:
            return False
        if self.kind is int and not isinstance(v, int):
            return False
        if self.lo is not None and (v <= self.lo if self.open_lo else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.open_hi else v <= self.hi)


def inferred(default: Any) -> Spec | None:
    """The spec of a key declared without one: its default's type (null: anything)."""
    if isinstance(default, bool | int | float | str | list):
        return Spec(type(default))
    return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _either(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


POSITIVE = Spec(int, lo=1)
COUNT = Spec(int, lo=0)
MESH_AXIS = Spec(int, lo=-1)  # -1 infers the axis from the device count
FRACTION = Spec(float, lo=0, hi=1, open_hi=True)
DIR = Spec(str, null=True, words=("auto",), empty=False)  # a directory, auto, or null (none)
