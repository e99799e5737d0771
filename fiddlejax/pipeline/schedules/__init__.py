"""Pipeline schedules as data: an IR, generators, a validator and timeline simulators.

A schedule is one ordered list of actions per pipeline stage. A separate runtime executes it,
so schedules can be generated, written by hand, checked, simulated and drawn without JAX (this
package imports none). The design follows DeepSpeed's instruction schedules and PyTorch's
pipelining action lists.

Vocabulary:
  chunk   a global virtual stage, 0 .. stages*virtual_stages-1 in model order; ``placement[c]``
          is the stage that holds chunk c.
  F       forward of (microbatch, chunk).
  B       whole backward of (microbatch, chunk).
  I, W    a split backward: I computes the input gradient (what the previous chunk waits for),
          W the weight gradient (nobody waits for it, so it can fill bubbles).
  held    the activations of (microbatch, chunk) are held from its F until its B (or its W).

Dependencies: F(m, c) needs F(m, c-1); B(m, c) and I(m, c) need F(m, c) and the input-gradient
op (B or I) of (m, c+1); W(m, c) needs I(m, c). Each stage runs its own list strictly in order.

Modules, each importing only those above it: ``ir`` (ops, costs, ``Action``, ``ScheduleError``
and ``ScheduleLike``, the view of a schedule the next two read), ``validation``, ``timeline``
(simulation, tick table, stash slots), ``schedule`` (``Schedule``, JSON), ``generators``
(GPipe, 1F1B, interleaved, 2BW), ``zero_bubble`` (ZB-H1, ZB-V, interleaved ZB, splitting
and joining backwards) and ``registry`` (``register``, ``build``). Import names from this
package, not from the modules.
"""

# Names outside ``__all__`` are re-exported as before the split (``X as X`` marks them).
from fiddlejax.pipeline.schedules.generators import (
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    two_bw,
    weight_updates,
)
from fiddlejax.pipeline.schedules.ir import DEFAULT_COSTS, OPS, Action, ScheduleError
from fiddlejax.pipeline.schedules.registry import _REGISTRY as _REGISTRY
from fiddlejax.pipeline.schedules.registry import Generator as Generator
from fiddlejax.pipeline.schedules.registry import MinMicrobatches as MinMicrobatches
from fiddlejax.pipeline.schedules.registry import build, interleaves, kinds, register
from fiddlejax.pipeline.schedules.schedule import Schedule, dump, load
from fiddlejax.pipeline.schedules.timeline import (
    Simulation,
    Span,
    TickTable,
    simulate,
    stash_slots,
    tick_table,
)
from fiddlejax.pipeline.schedules.validation import Position as Position
from fiddlejax.pipeline.schedules.validation import validate
from fiddlejax.pipeline.schedules.zero_bubble import (
    interleaved_zb,
    join_backward,
    split_backward,
    zb_h1,
    zb_v,
)

__all__ = [
    "OPS",
    "DEFAULT_COSTS",
    "Action",
    "Schedule",
    "ScheduleError",
    "Span",
    "Simulation",
    "TickTable",
    "build",
    "register",
    "kinds",
    "interleaves",
    "load",
    "dump",
    "validate",
    "simulate",
    "tick_table",
    "stash_slots",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_v",
    "interleaved_zb",
    "split_backward",
    "join_backward",
    "two_bw",
    "weight_updates",
]
