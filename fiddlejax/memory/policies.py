"""Named rematerialization policies over ``jax.checkpoint_policies``.

A policy decides which of a layer's intermediates the backward pass keeps (stashes) and which it
recomputes from the layer input. The Trainer and the pipeline runtime wrap their per-layer function
with :func:`remat_layer` inside their ``lax.scan`` over layers, so the choice is per layer and the
stash grows by exactly the policy's bytes per layer.

Names (see the README's memory section for bytes per layer of the GPT block):

- ``none``: no remat; autodiff keeps every residual it wants.
- ``full``: keep nothing but the layer input (``nothing_saveable``).
- ``dots``: keep every matmul/conv output (``dots_saveable``), recompute the elementwise rest.
- ``dots_no_batch``: keep matmuls without batch dimensions, i.e. the weight projections but not
  attention's ``QK^T`` / ``PV`` (``dots_with_no_batch_dims_saveable``).
- ``minimal``: keep only the named projection outputs of :data:`names.PROJECTIONS`.
- ``offload``: like ``minimal`` but the named outputs go to pinned host memory
  (``save_and_offload_only_these_names``).
- ``policy(save=[...], offload=[...])``: any named subset, kept on device or offloaded.

``jax.checkpoint_policies.save_anything_except_these_names`` is a stub that saves everything in
this jax (0.10.2); nothing here builds on it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

from fiddlejax.memory import names

__all__ = [
    "POLICY_NAMES",
    "Policy",
    "offload_supported",
    "policy",
    "remat_layer",
    "resolve",
]

F = TypeVar("F", bound=Callable[..., Any])
JaxPolicy = Callable[..., Any]

POLICY_NAMES = ("none", "full", "dots", "dots_no_batch", "minimal", "offload")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A remat policy: ``jax_policy`` is handed to ``jax.checkpoint``; ``None`` means no remat.

    ``saved`` and ``offloaded`` list the checkpoint names a name-based policy keeps (empty for the
    primitive-based ones); ``offload_dst`` is the memory kind offloaded names go to, or ``None``
    when offloading fell back to keeping them on device (see :func:`offload_supported`).
    """

    name: str
    jax_policy: JaxPolicy | None
    description: str
    saved: tuple[str, ...] = ()
    offloaded: tuple[str, ...] = ()
    offload_dst: str | None = None

    @property
    def remat(self) -> bool:
        """Whether layers are wrapped in ``jax.checkpoint`` at all."""
        return self.jax_policy is not None


def offload_supported(backend: str | None = None) -> tuple[bool, str]:
    """Whether the default device exposes a ``pinned_host`` memory to offload into, and why not.

    On this jax's CPU backend ``pinned_host`` exists and offloading compiles and runs, but the
    CPU lowering of ``device_put`` between memory kinds is the identity: the "offloaded" stash stays
    in the same (host) memory and counts in ``temp_size_in_bytes``. On GPU/TPU XLA moves it to host
    memory (``host_temp_size_in_bytes``).
    """
    try:
        device = jax.devices(backend)[0]
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception as e:  # a backend without the memories API
        return False, f"memory kinds unavailable on {backend or 'default'} backend: {e}"
    if "pinned_host" not in kinds:
        return False, f"{device.platform} device has memories {sorted(kinds)}, no 'pinned_host'"
    if device.platform == "cpu":
        return True, "CPU: pinned_host is the same physical memory; offload is a no-op copy"
    return True, f"{device.platform}: offloaded names live in pinned host memory"


def _check_names(arg: str, values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise ValueError(f"{arg}={values!r} must be a list of checkpoint names, e.g. [{values!r}]")
    out = tuple(values)
    for v in out:
        if not isinstance(v, str) or not v:
            raise ValueError(
                f"{arg} holds {v!r}; checkpoint names are non-empty strings such as "
                f"{names.ALL} (fiddlejax.memory.names)"
            )
    if len(set(out)) != len(out):
        raise ValueError(f"{arg}={list(out)} repeats a name; list each name once")
    return out


def policy(save: Iterable[str] = (), offload: Iterable[str] = (), name: str = "custom") -> Policy:
    """A name-based policy: keep ``save`` on device, move ``offload`` to pinned host memory.

    Everything else in the layer is recomputed from the layer input. Names are the
    ``checkpoint_name`` tags of :mod:`fiddlejax.memory.names` (or a model's own tags). When the
    backend has no ``pinned_host`` memory, offloaded names are kept on device instead, with a
    warning (the program and gradients are unchanged, only where the bytes live).
    """
    save = _check_names("save", save)
    offload = _check_names("offload", offload)
    both = sorted(set(save) & set(offload))
    if both:
        raise ValueError(
            f"names {both} are in both save= and offload=; a name is kept on device or offloaded, "
            "not both: drop them from one list"
        )
    if not offload:
        return Policy(
            name,
            jax.checkpoint_policies.save_only_these_names(*save),
            f"keep {list(save)} on device, recompute the rest" if save else "keep nothing",
            saved=save,
        )
    ok, why = offload_supported()
    if not ok:
        warnings.warn(
            f"offload to pinned_host unavailable ({why}); keeping {list(offload)} on device",
            stacklevel=2,
        )
        return Policy(
            name,
            jax.checkpoint_policies.save_only_these_names(*save, *offload),
            f"keep {list(save + offload)} on device (offload unavailable: {why})",
            saved=save + offload,
        )
    return Policy(
        name,
        jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(save),
            names_which_can_be_offloaded=list(offload),
            offload_src="device",
            offload_dst="pinned_host",
        ),
        f"keep {list(save)} on device, offload {list(offload)} to pinned host ({why})",
        saved=save,
        offloaded=offload,
        offload_dst="pinned_host",
    )


def _named(name: str) -> Policy:
    cp = jax.checkpoint_policies
    if name == "none":
        return Policy("none", None, "no remat: autodiff keeps every residual")
    if name == "full":
        return Policy("full", cp.nothing_saveable, "keep only the layer input, recompute the layer")
    if name == "dots":
        return Policy("dots", cp.dots_saveable, "keep all matmul/conv outputs")
    if name == "dots_no_batch":
        return Policy(
            "dots_no_batch",
            cp.dots_with_no_batch_dims_saveable,
            "keep weight matmuls (no batch dims), recompute attention scores",
        )
    if name == "minimal":
        p = policy(save=names.PROJECTIONS, name="minimal")
        return dataclasses.replace(p, description=f"keep the named projections {names.PROJECTIONS}")
    if name == "offload":
        return policy(offload=names.PROJECTIONS, name="offload")
    raise AssertionError(name)


def resolve(remat: str | Policy | None) -> Policy:
    """The :class:`Policy` for a plan's ``remat=`` value (a name, a Policy, or ``None``)."""
    if remat is None:
        return _named("none")
    if isinstance(remat, Policy):
        return remat
    if isinstance(remat, str):
        if remat in POLICY_NAMES:
            return _named(remat)
        if remat == "auto":
            raise ValueError(
                "remat='auto' is chosen by compiling the step: call "
                "fiddlejax.memory.choose_policy(make_step, budget_bytes) and pass its result"
            )
        raise ValueError(
            f"remat={remat!r} is not a known policy; use one of {POLICY_NAMES}, 'auto', None, "
            "or fiddlejax.memory.policy(save=[...], offload=[...])"
        )
    raise TypeError(
        f"remat={remat!r} ({type(remat).__name__}) must be a policy name, a Policy or None"
    )


def remat_layer(fn: F, remat: str | Policy | None, *, prevent_cse: bool = True) -> F:
    """``fn`` (one layer) wrapped in ``jax.checkpoint`` under ``remat``; ``fn`` itself for none.

    Inside a ``lax.scan`` over layers pass ``prevent_cse=False``: the scan already keeps XLA from
    merging the recomputation into the forward, and the barrier only costs fusion.
    """
    p = resolve(remat)
    if p.jax_policy is None:
        return fn
    return jax.checkpoint(fn, policy=p.jax_policy, prevent_cse=prevent_cse)
