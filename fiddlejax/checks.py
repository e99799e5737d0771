"""Input checks on values (not just shapes): id ranges of a batch and finite losses; and a
name-based remat policy that would find no names in a model's layers.

A token id at or above the vocabulary size does not fail inside XLA: the embedding gather clamps
or the cross-entropy reads past the logits, and the loss silently turns to NaN. These checks turn
that into an error naming the step, the key, the bad id and the valid range. They run on the
host and cost a device-to-host sync per step, so they are opt-in (``Plan(check_inputs=True)``);
the data pipelines check a whole source once instead (``fiddlejax.data``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np


class NonFiniteLoss(FloatingPointError):
    """The loss (or the gradient norm) of a step is NaN or infinite; ``step`` says which.

    ``state``: the state the step returned, whose update was skipped (the last good parameters:
    :meth:`fiddlejax.train.Trainer.step` raises with it under ``Plan(check_inputs=True)``).
    """

    def __init__(self, step: int, value: float, hint: str = "", what: str | None = None,
                 state: Any = None):
        self.step, self.value, self.state = step, value, state
        super().__init__(f"step {step}: {what or f'the loss is {value}'}{hint}")


def nonfinite_what(loss: float, grad_norm: float) -> str:
    """What was not finite in a step, as a message says it."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    return f"the gradient norm is {grad_norm} (the loss is {loss:.4g})"


def value_ranges(model: Any) -> dict[str, tuple[int, int, str]]:
    """``{batch key: (low, high, what)}``, the valid ids of a model's integer inputs.

    Read from the model's config: ``vocab_size`` bounds token keys, ``num_classes`` labels.
    Models without either get no range checks.
    """
    cfg = getattr(model, "config", None)
    vocab, classes = getattr(cfg, "vocab_size", None), getattr(cfg, "num_classes", None)
    name = type(model).__name__
    out = {}
    if isinstance(vocab, int):
        for key in ("tokens", "inputs", "targets"):
            out[key] = (0, vocab, f"{name}'s vocabulary (vocab_size={vocab})")
    if isinstance(classes, int):
        out["labels"] = (0, classes, f"{name}'s classes (num_classes={classes})")
    return out


def check_values(batch: dict, ranges: dict[str, tuple[int, int, str]], step: int) -> None:
    """Raise ``ValueError`` if an integer array of ``batch`` holds an id outside its range."""
    for key, (lo, hi, what) in ranges.items():
        if key not in batch:
            continue
        x = np.asarray(batch[key])
        if x.size == 0 or not np.issubdtype(x.dtype, np.integer):
            continue
        bad = (x < lo) | (x >= hi)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            fix = "fix the data" + ("" if int(x[where]) < lo else " or enlarge the vocabulary")
            raise ValueError(
                f"{f'step {step}: ' if step else ''}batch[{key!r}] holds id {int(x[where])} at "
                f"{list(where)}, outside [{lo}, {hi}) of {what}; {fix} ({int(bad.sum())} ids "
                "out of range)")


def check_finite(metrics: dict, step: int, state: Any = None) -> None:
    """Raise :class:`NonFiniteLoss` if ``metrics["loss"]`` or ``metrics["grad_norm"]`` (scalar
    or per-step) is not finite; ``state`` (the step's result) travels with the error."""
    losses = np.atleast_1d(np.asarray(metrics["loss"], np.float64))
    norms = np.atleast_1d(np.asarray(metrics.get("grad_norm", 0.0), np.float64))
    norms = np.broadcast_to(norms, losses.shape)
    for i, (value, norm) in enumerate(zip(losses, norms)):
        if not (math.isfinite(float(value)) and math.isfinite(float(norm))):
            raise NonFiniteLoss(step + i, float(value), (
                "; the update was skipped, so the parameters are still the last good ones (the "
                "state returned with this error, e.state): lower the learning rate, check the "
                "data (Plan(check_inputs=True) checks ids) or restore a checkpoint"),
                what=nonfinite_what(float(value), float(norm)), state=state)


def check_not_donated(state: Any, call: str = "trainer.step") -> None:
    """A clear error for a TrainState whose buffers an earlier step consumed (donated): using
    one crashes the process inside XLA instead (a segmentation fault, jax 0.10.2). Tracers
    (``trainer.step`` inside a user's ``jax.jit`` or ``lax.scan``) own no buffers: skipped."""
    import jax

    if any(not isinstance(x, jax.core.Tracer) and getattr(x, "is_deleted", lambda: False)()
           for x in jax.tree.leaves(state)):
        raise ValueError(
            f"this TrainState was consumed by an earlier {call} (its buffers were donated to "
            "the new state, to save memory) and cannot be used again; use the state that call "
            "returned: `state, metrics = trainer.step(state, batch)`")


def check_ids(batch: dict, ranges: dict[str, tuple[int, int, str]]) -> None:
    """:func:`check_values` for the host (NumPy) arrays of ``batch``, without a step number:
    the default check, which costs no device sync (device arrays are left to the step)."""
    host = {k: v for k, v in batch.items() if isinstance(v, np.ndarray) and v.size
            and np.issubdtype(v.dtype, np.integer)}
    for key, (lo, hi, _) in ranges.items():
        x = host.get(key)
        if x is not None and (x.min() < lo or x.max() >= hi):
            check_values({key: x}, {key: ranges[key]}, 0)


def skip_bad_ids(step, ranges: dict[str, tuple[int, int, str]]):
    """``step(state, batch)`` run only when every id of ``batch`` is in its range, decided
    in-graph (a ``lax.cond``: no host sync): a batch with any other is skipped as a
    non-finite step is (the counter advanced, the parameters kept, ``nonfinite_skipped`` 1,
    the loss NaN); ``metrics["bad_ids"]`` counts them. A device batch's ids out of range
    trained on a finite meaningless loss before."""
    import jax
    import jax.numpy as jnp

    def gated(state, batch):
        bounds = tuple((k, lo, hi) for k, (lo, hi, _) in sorted(ranges.items()) if k in batch
                       and jnp.issubdtype(batch[k].dtype, jnp.integer))
        bad = _count_bad(bounds)({k: batch[k] for k, _, _ in bounds})
        shapes = jax.eval_shape(step, state, batch)[1]

        def skip(s):
            m = jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan if jnp.issubdtype(
                x.dtype, jnp.inexact) else 0, x.dtype), shapes)
            return s.advanced(), {**m, "nonfinite_skipped": jnp.ones_like(
                m["nonfinite_skipped"])}

        new, metrics = jax.lax.cond(bad == 0, lambda s: step(s, batch), skip, state)
        return new, {**metrics, "bad_ids": bad}

    return gated


@functools.cache
def _count_bad(bounds: tuple):
    import jax
    import jax.numpy as jnp

    def count(arrays):
        total = jnp.zeros((), jnp.int32)
        for key, lo, hi in bounds:
            total = total + jnp.sum((arrays[key] < lo) | (arrays[key] >= hi), dtype=jnp.int32)
        return total

    return jax.jit(count)


def check_rank(batch: dict, spec: dict, model_name: str) -> None:
    """A clear error when an array has the wrong number of dimensions (e.g. 1-D tokens)."""
    for key, want in spec.items():
        x = batch.get(key)
        if x is not None and len(np.shape(x)) != len(want.shape):
            dims = ", ".join(["batch"] + [str(d) for d in want.shape[1:]])
            shape = list(np.shape(x))
            raise ValueError(
                f"batch[{key!r}] has {len(shape)} dimension(s), shape {shape}, but "
                f"{model_name} expects [{dims}]: a leading batch dimension, e.g. x[None] for "
                "one example")


def checkpoint_names(fn: Any, *example: Any) -> set[str]:
    """The ``checkpoint_name`` tags ``fn(*example)`` applies (traced, nothing runs)."""
    import jax

    found: set[str] = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                found.add(eqn.params["name"])
            for sub in _sub_jaxprs(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(fn)(*example).jaxpr)
    return found


def _sub_jaxprs(params: dict):
    for v in params.values():
        for x in v if isinstance(v, tuple | list) else (v,):
            inner = getattr(x, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield inner
            elif hasattr(x, "eqns"):
                yield x


def check_remat_names(policy: Any, layer: Any, layer_params: Any, x: Any,
                      model_name: str) -> None:
    """A name-based remat policy (``remat="minimal"``, ``"offload"``, ``policy(save=...)``) on a
    layer that tags none of its names saves nothing: it silently equals ``remat="full"``.
    Raise naming the missing names and the fix. ``policy`` is a
    :class:`fiddlejax.memory.policies.Policy`."""
    wanted = set(getattr(policy, "saved", ())) | set(getattr(policy, "offloaded", ()))
    if not wanted:
        return
    tagged = checkpoint_names(layer, layer_params, x)
    if not wanted & tagged:
        raise ValueError(
            f"remat={policy.name!r} keeps the checkpoint names {sorted(wanted)}, but a layer of "
            f"{model_name} tags {sorted(tagged) or 'none'} (jax.ad_checkpoint.checkpoint_name), "
            "so it would save nothing and equal remat='full'. Use remat='full', 'dots' or "
            "'dots_no_batch' (by primitive), or fj.memory.policy(save=[names the layer tags])")


def check_canonical(params: Any, template: Any, model_name: str) -> None:
    """``params`` must have the model's own parameter tree, shapes and dtypes, with values."""
    import jax

    want = jax.tree.map(lambda a: (a.shape, a.dtype), template)
    got = jax.tree.map(lambda a: (tuple(a.shape), a.dtype), params)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ValueError(f"params do not match {model_name}'s parameter tree and shapes")
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        raise ValueError(
            f"{model_name} is abstract (built with nnx.eval_shape): it has no weights "
            "to initialise. Measure it with trainer.memory(batch_size) or "
            "trainer.lower_step(trainer.abstract_state(), batch), or pass real params or a "
            "loader such as trainer.init(model.pretrained_params)")
