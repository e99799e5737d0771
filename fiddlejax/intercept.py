"""How fiddlejax reaches into a user's unmodified model while tracing it: one mechanism.

A user's own model keeps its ``__call__``, its ``nnx.Dropout`` and its ``jax.lax.scan``;
fiddlejax still has to split its forward into pieces (:mod:`fiddlejax.adaptation.standins`), unroll
the scan over its stacked blocks (:mod:`fiddlejax.adaptation.scanned`), draw its dropout masks per
example (:mod:`fiddlejax.adaptation.dropout`) and offer its blocks the layout's collectives
(:class:`fiddlejax.parallel.ops.Ops`, read by ``fiddlejax.models.common.attention`` when a
block does not take ``ops`` itself). All four read one record, :func:`current`, which
:func:`setting` replaces for the extent of a ``with`` block while fiddlejax traces a piece.
The bundled models never read it: they take ``ops`` as an argument and their message as a
typed pytree. Outside fiddlejax's traces every field is unset and the user's code behaves
exactly as written.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class Interception:
    """What fiddlejax has set for the piece being traced (defaults: nothing)."""

    standins: tuple | None = None     # the stand-in blocks' mode (standins.acting)
    unroll_scan: bool = False         # the outermost jax.lax.scan runs as a loop
    scan_calls: list | None = None    # [calls so far] of the stacked blocks' stand-in
    dropout: Any = None               # per-example dropout keys (adaptation.dropout.keys)
    ops: Any = None                   # the layout's Ops for blocks that do not take them


_NOTHING = Interception()
_CURRENT: contextvars.ContextVar[Interception | None] = contextvars.ContextVar(
    "fiddlejax_interception", default=None)


def current() -> Interception:
    """The interception in force for the trace in progress."""
    return _CURRENT.get() or _NOTHING


@contextlib.contextmanager
def setting(**fields: Any) -> Iterator[Interception]:
    """Within this block the interception has ``fields`` changed (the rest as they were)."""
    token = _CURRENT.set(dataclasses.replace(current(), **fields))
    try:
        yield current()
    finally:
        _CURRENT.reset(token)
