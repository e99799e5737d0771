"""``remat="auto"``: the cheapest policy whose compiled step fits a memory budget.

Each candidate is compiled (nothing runs): the device footprint comes from ``memory_analysis()``
(temp + arguments + outputs - aliased, exact and machine independent) and the cost from
``cost_analysis()["flops"]``. Among the candidates that fit, the one with the fewest FLOPs (least
recomputation) wins; ties go to the smaller footprint.

``cost_analysis`` counts a ``scan``/``while`` body once whatever its trip count, so compare
policies on the same program structure (as ``make_step`` does: only the policy changes): the
per-layer recomputation then ranks them as the executed FLOPs do. Give it the scanned step, not
an unrolled one: XLA on CPU merges straight-line recomputation back into the forward (despite
``jax.checkpoint``'s CSE barrier), which hides both the recomputed FLOPs and the memory saved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from fiddlejax.memory.policies import Policy, offload_supported, resolve

__all__ = ["Measurement", "choose_policy", "default_candidates", "measure", "measure_compiled"]

StepMaker = Callable[[Policy], Any]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One candidate's compiled footprint (bytes on the device) and FLOPs."""

    policy: Policy
    device_bytes: int
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    host_temp_bytes: int
    flops: float


def default_candidates() -> tuple[str, ...]:
    """Policies ``auto`` tries, cheapest first; ``offload`` only where it really moves bytes."""
    base = ("none", "dots_no_batch", "dots", "minimal")
    ok, why = offload_supported()
    real = ok and not why.startswith("CPU")
    return (*base, "offload", "full") if real else (*base, "full")


def measure_compiled(compiled: Any, policy: Policy) -> Measurement:
    """Footprint and FLOPs of a compiled step (``jax.stages.Compiled``)."""
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per module
        cost = cost[0] if cost else {}
    temp = int(m.temp_size_in_bytes)
    arg = int(m.argument_size_in_bytes)
    out = int(m.output_size_in_bytes)
    alias = int(m.alias_size_in_bytes)
    return Measurement(
        policy=policy,
        device_bytes=temp + arg + out - alias,
        temp_bytes=temp,
        argument_bytes=arg,
        output_bytes=out,
        alias_bytes=alias,
        host_temp_bytes=int(getattr(m, "host_temp_size_in_bytes", 0)),
        flops=float(cost.get("flops", 0.0)),
    )


def _compile(made: Any, policy: Policy) -> Any:
    if isinstance(made, jax.stages.Compiled):
        return made
    if isinstance(made, jax.stages.Lowered):
        return made.compile()
    if isinstance(made, tuple) and len(made) == 2 and callable(made[0]):
        fn, args = made
        return jax.jit(fn).lower(*args).compile()
    raise TypeError(
        f"make_step({policy.name!r}) returned {type(made).__name__}; return a "
        "jax.stages.Compiled, a jax.stages.Lowered, or a pair (fn, args) to jit and lower"
    )


def measure(
    make_step: StepMaker, candidates: Sequence[str | Policy] | None = None
) -> list[Measurement]:
    """Compile ``make_step(policy)`` for each candidate and measure it."""
    cands = default_candidates() if candidates is None else tuple(candidates)
    if not cands:
        raise ValueError("candidates is empty; pass policy names such as ('dots', 'full')")
    out = []
    for c in cands:
        p = resolve(c)
        out.append(measure_compiled(_compile(make_step(p), p), p))
    return out


def choose_policy(
    make_step: StepMaker,
    budget_bytes: int,
    candidates: Sequence[str | Policy] | None = None,
) -> Policy:
    """The policy with the fewest FLOPs whose compiled step fits ``budget_bytes`` per device.

    ``make_step(policy)`` builds the training step under ``policy`` and returns a
    ``jax.stages.Compiled``, a ``jax.stages.Lowered`` or a pair ``(fn, args)`` (args may be
    ``jax.ShapeDtypeStruct``s). Raises ``ValueError`` naming the smallest footprint when none fits.
    """
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive int (bytes per device)")
    return choose(measure(make_step, candidates), budget_bytes).policy


def choose(measurements: Sequence[Measurement], budget_bytes: int) -> Measurement:
    """The fitting measurement with the fewest FLOPs (then fewest bytes, then list order)."""
    fits = [m for m in measurements if m.device_bytes <= budget_bytes]
    if not fits:
        small = min(measurements, key=lambda m: m.device_bytes)
        tried = ", ".join(f"{m.policy.name}={m.device_bytes}" for m in measurements)
        raise ValueError(
            f"no remat policy fits memory_budget={budget_bytes} bytes per device; the smallest is "
            f"{small.policy.name!r} at {small.device_bytes} bytes (tried {tried}): raise the "
            "budget, use fewer samples per microbatch, more pipeline stages or Gist encodings"
        )
    return min(fits, key=lambda m: (m.flops, m.device_bytes))
