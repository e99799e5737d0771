"""Shared test helpers: single-device references and per-leaf relative errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# A leaf whose reference is tiny next to the whole tree has its error measured against
# FLOOR * ||tree|| instead of its own norm: such a leaf (a zero-initialised bias early on, an
# attention projection whose gradient cancels across tokens, the loss's gradient to a row
# nothing routes to) is a sum of float32 terms far larger than their result, so its
# rounding error scales with those terms, not with the leaf. At FLOOR = 1e-4 and tol 1e-5 the
# absolute bound is 1e-9 of the tree's norm, 60x below one float32 rounding of the tree
# (6e-8), and every leaf of the suite's models that is at least 1e-4 of its tree (GPT's
# wq/wk at 4e-4, Llama's mlp_norm at 7.6e-4 included) is bounded by its own norm.
FLOOR = 1e-4
# bf16 compute against the float32 reference, per leaf: bf16 rounds to 2**-9 = 2.0e-3, and a
# gradient meets a few such roundings per layer each way; measured 4.5e-3 .. 1.7e-2 on every
# leaf of the suite's bf16 checks (GPT data=2 with and without remat, and zero=3 / 1F1B on
# 2x2x2; Llama zero=3 on data=8 and on context=4 x tensor=2). 3e-2 is under twice the worst,
# and a leaf cut off (error 1) or a layer's gradient mis-scaled (error >= 0.1) still fails.
BF16 = 3e-2
# A key projection's bias shifts every score of a query by the same amount, which softmax
# ignores: its true gradient is exactly zero, so both sides hold float32 rounding noise
# (measured up to 7.2e-5 of FLOOR * ||tree||: 7e-9 of the tree's norm, the noise of the
# other leaves' sums). Such leaves are bounded at KEY_BIAS (1e-7 of the tree's norm).
KEY_BIAS = 1e-3


def key_bias_tol(tree) -> dict[str, float]:
    """``leaf_tol`` for every attention key bias of ``tree`` (``.../k/bias``, ``key/bias``)."""
    import re

    paths = [_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return {p: KEY_BIAS for p in paths if re.search(r"(^|/)(k|key|k_proj)/bias$", p)}


def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` over all leaves of two trees together (for single arrays and for
    checks that two trees differ; exactness checks use :func:`assert_close`)."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (
        f"{jax.tree.structure(a)} != {jax.tree.structure(b)}"
    )
    fa = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)])
    fb = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fb))


def _name(path) -> str:
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path
            if not isinstance(k, jax.tree_util.GetAttrKey)]  # nnx.Variable's `.value`
    return "/".join(map(str, keys)) or "."


def leaf_errors(got, want, floor: float = FLOOR) -> dict[str, float]:
    """Each leaf's ``||got - want|| / max(||want||, floor * ||want tree||)``, by path
    (``blocks/wq``), in float64."""
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        f"{jax.tree.structure(got)} != {jax.tree.structure(want)}"
    )
    paths = [_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
    a = [np.asarray(x, np.float64) for x in jax.tree.leaves(got)]
    b = [np.asarray(x, np.float64) for x in jax.tree.leaves(want)]
    assert all(x.shape == y.shape for x, y in zip(a, b)), [(x.shape, y.shape) for x, y in zip(a, b)]
    total = np.sqrt(sum(np.sum(y * y) for y in b))
    return {p: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), floor * total))
            for p, x, y in zip(paths, a, b, strict=True)}


def assert_close(got, want, tol: float = 1e-5, *, leaf_tol: dict[str, float] | None = None,
                 floor: float = FLOOR, what: str = "") -> dict[str, float]:
    """Every leaf of ``got`` within ``tol`` of ``want`` in relative error (:func:`leaf_errors`);
    ``leaf_tol`` names the leaves allowed more (each must exist and need it). Fails naming the
    worst leaves; returns the errors (printed, so ``pytest -s`` shows the worst)."""
    errors = leaf_errors(got, want, floor)
    return _check(errors, tol, leaf_tol, what)


def assert_loss_and_grads(got, want, tol: float = 1e-5, *,
                          leaf_tol: dict[str, float] | None = None,
                          floor: float = FLOOR) -> dict[str, float]:
    """``got = (loss, grads)`` equals ``want`` within ``tol``: the loss in relative error, and
    every gradient leaf as in :func:`assert_close` (``leaf_tol`` may name ``"loss"`` too)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    errors = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))}
    errors |= leaf_errors(grads, ref_grads, floor)
    return _check(errors, tol, leaf_tol, "loss and grads")


def _check(errors: dict[str, float], tol: float, leaf_tol: dict[str, float] | None,
           what: str) -> dict[str, float]:
    leaf_tol = leaf_tol or {}
    unknown = set(leaf_tol) - set(errors)
    assert not unknown, f"leaf_tol names no leaf: {sorted(unknown)}; leaves: {sorted(errors)}"
    bound = {p: leaf_tol.get(p, tol) for p in errors}
    worst = sorted(errors, key=lambda p: errors[p] / bound[p], reverse=True)
    table = ", ".join(f"{p} {errors[p]:.1e}" for p in worst[:4])
    print(f"{what or 'tree'}: worst of {len(errors)} leaves: {table}")
    bad = [p for p in worst if errors[p] >= bound[p]]
    assert not bad, (f"{what or 'tree'}: {len(bad)} of {len(errors)} leaves exceed their bound: "
                     + ", ".join(f"{p} {errors[p]:.2e} >= {bound[p]:.0e}" for p in bad[:6]))
    return errors


def reference_loss_fn(model: nnx.Module):
    """The plain single-device loss of ``model`` as a function of its parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, batch):
        m = nnx.merge(graphdef, p, rest, copy=True)
        from fiddlejax.staged import mean_loss

        return mean_loss(m.loss(m.head(_scan(m, m.prologue(batch))), batch))

    return loss, params


def _scan(m, x):
    from fiddlejax.models.common import scan_layers

    return scan_layers(getattr(m, m.stack), x)


def reference_loss_and_grads(model: nnx.Module, batch: dict):
    loss, params = reference_loss_fn(model)
    return jax.jit(jax.value_and_grad(loss))(params, batch)


def stale_reference(loss, optimizer: optax.GradientTransformation, params, batches):
    """PipeDream-2BW's rule on one device: W(t+1) = W(t) + update(grad loss(W(t-1))), with
    W(-1) = W(0). Returns (each step's loss, the last W(t-1), the last W(t))."""
    grad = jax.jit(jax.value_and_grad(loss))
    prev, cur, state, losses = params, params, optimizer.init(params), []
    for b in batches:
        value, g = grad(prev, b)
        updates, state = optimizer.update(g, state, cur)
        prev, cur = cur, optax.apply_updates(cur, updates)
        losses.append(float(value))
    return losses, prev, cur


def reference_train(model: nnx.Module, optimizer: optax.GradientTransformation, batches):
    """Plain single-device optax training; returns the losses and final parameters."""
    loss, params = reference_loss_fn(model)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(p, s, b):
        value, g = jax.value_and_grad(loss)(p, b)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    losses = []
    for b in batches:
        params, opt_state, loss_value = step(params, opt_state, b)
        losses.append(float(loss_value))
    return losses, params


def with_config(model, **change):
    """``model``'s weights under a changed config (a feature switched off, to show it matters)."""
    import dataclasses

    other = nnx.eval_shape(lambda: type(model)(dataclasses.replace(model.config, **change),
                                               rngs=nnx.Rngs(0)))
    nnx.update(other, nnx.state(model, nnx.Param))
    return other


def tokens(seed: int, batch: int, seq_len: int, vocab: int) -> dict:
    t = jax.random.randint(jax.random.key(seed), (batch, seq_len + 1), 0, vocab, jnp.int32)
    return {"tokens": np.asarray(t)}


def assert_trains_like_single_device(trainer, model, optimizer, batches, check_grads=True):
    """Loss and gradients of the first batch, then losses and parameters after stepping through
    ``batches``, equal plain single-device training (each leaf's relative error < 1e-5)."""
    state = trainer.init()
    if check_grads:
        assert_loss_and_grads(trainer.loss_and_grads(state, batches[0]),
                              reference_loss_and_grads(model, batches[0]))
    assert_steps_match(trainer, state, batches, *reference_train(model, optimizer, batches))


def assert_steps_match(trainer, state, batches, ref_losses, ref_params):
    """Stepping ``trainer`` from ``state`` through ``batches`` gives the reference losses and
    final parameters (each leaf's relative error < 1e-5)."""
    losses = []
    for b in batches:
        state, metrics = trainer.step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(trainer.params(state), ref_params, what="params")


def assert_exact_on_context_layouts(model, batch) -> None:
    """Loss and gradients equal one device's on zero=3 + sequence parallelism + the context
    ring (data2 x context2 x tensor2), then interleaved 1F1B (2 virtual stages) with the
    all-gathered K/V (pipe2 x context2 x tensor2): the frontier families' every-axis check."""
    import optax

    import fiddlejax as fj

    ref = reference_loss_and_grads(model, batch)
    for plan in (fj.Plan(mesh=fj.make_mesh(data=2, context=2, tensor=2), zero=3,
                         sequence_parallel=True, context_kernel="ring"),
                 fj.Plan(mesh=fj.make_mesh(data=1, pipe=2, context=2, tensor=2),
                         schedule="interleaved-1f1b", microbatches=2, virtual_stages=2)):
        trainer = fj.parallelize(model, optax.sgd(0.1), plan)
        assert_loss_and_grads(trainer.loss_and_grads(trainer.init(), batch), ref)
