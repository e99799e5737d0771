"""Byte counts as people write them (``2GiB``, ``512MB``, ``1e9``), for budgets and shard sizes."""

from __future__ import annotations

import re
from typing import Any

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any, key: str = "bytes") -> int:
    """``2GiB``, ``512MB``, ``1e9`` or an int -> bytes (> 0)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m and m.group(2).lower() in _UNITS:
        try:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        except ValueError:
            n = 0
        if n > 0:
            return n
    raise ValueError(f"{key}={value!r} must be a positive byte count such as 2GiB, 512MB or "
                      f"2000000000; e.g. {key}=2GiB")
