"""`fj.Plan` checks everything it holds at construction, and the Trainer's input checks."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.models.gpt import GPT, GPTConfig


def mesh(data=1, pipe=1, tensor=1):
    return fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[:data * pipe * tensor])


BAD = [
    (dict(schedule="1f1b"), "pipe=1; use schedule=None"),  # a pipeline without a pipe axis
    (dict(schedule="1fb1", pipe=2), "did you mean '1f1b'"),
    (dict(remat="sometimes"), "remat='sometimes' is not a known policy"),
    (dict(grad_allreduce="carrier-pigeon"), "grad_allreduce='carrier-pigeon' cannot reduce"),
    (dict(grad_allreduce="packed-trees"), "needs a topology"),
    (dict(encodings=["bogus"]), "unknown encoding 'bogus'"),
    (dict(partition="unifrom"), "did you mean 'uniform'"),
    (dict(schedule="1f1b", pipe=2, virtual_stages=2), "needs an interleaved schedule"),
    (dict(grad_allreduce="topk", schedule="1f1b", pipe=2), "not supported with a pipeline"),
    (dict(microbatches=0), "microbatches=0 must be a positive int"),
    (dict(remat="auto"), "needs Plan\\(memory_budget"),
    (dict(remat="auto", memory_budget=-1), "memory_budget=-1 must be a positive number"),
    (dict(zero=4), "zero=4 must be 0"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[m for _, m in BAD])
def test_bad_plan_fails_at_construction(kw, message):
    kw = dict(kw)
    m = mesh(data=2, pipe=kw.pop("pipe", 1))
    with pytest.raises((ValueError, TypeError), match=message):
        fj.Plan(mesh=m, **kw)


def test_schedule_kinds_follow_the_registry():
    from fiddlejax.pipeline import schedules

    assert fj.plan.SCHEDULES == tuple(schedules.kinds())
    assert fj.plan.interleaves("interleaved-1f1b") and not fj.plan.interleaves("1f1b")
    assert fj.Plan(mesh=mesh(data=2)).schedule is None  # default: no pipeline without pipe
    assert fj.Plan(mesh=mesh(pipe=2)).schedule == "1f1b"


CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)


@pytest.fixture(scope="module")
def checked():
    model = GPT(CFG, rngs=nnx.Rngs(0))
    plan = fj.Plan(mesh=mesh(data=2), check_inputs=True)
    trainer = fj.parallelize(model, optax.adamw(1e-3), plan)
    return model, trainer


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, CFG.vocab_size, (4, CFG.seq_len + 1)).astype(np.int32)}


def test_check_inputs_names_the_step_and_the_bad_id(checked):
    _, trainer = checked
    state, _ = trainer.step(trainer.init(), batch())
    bad = batch(1)
    bad["tokens"][2, 5] = CFG.vocab_size + 3  # silently a NaN loss without the check
    with pytest.raises(ValueError, match=r"step 2: batch\['tokens'\] holds id 35 at \[2, 5\], "
                                         r"outside \[0, 32\) of GPT's vocabulary"):
        trainer.step(state, bad)


def test_check_inputs_stops_a_non_finite_loss(checked):
    from fiddlejax.checks import NonFiniteLoss

    model, _ = checked
    plan = fj.Plan(mesh=mesh(data=2), check_inputs=True)
    trainer = fj.parallelize(model, optax.sgd(1e30), plan)  # diverges at once
    state, _ = trainer.step(trainer.init(), batch())
    with pytest.raises(NonFiniteLoss, match="step 2: the loss is (nan|inf)") as e:
        for _ in range(3):
            state, _ = trainer.step(state, batch())
    assert e.value.step == 2


def test_one_dimensional_tokens_and_missing_optimizer_are_clear(checked):
    model, trainer = checked
    with pytest.raises(ValueError, match=r"has 1 dimension\(s\).*a leading batch dimension"):
        trainer.step(trainer.init(), {"tokens": batch()["tokens"][0]})
    with pytest.raises(TypeError, match="optimizer must be an optax.GradientTransformation"):
        fj.parallelize(model, None, fj.Plan(mesh=mesh(data=2)))
    with pytest.raises(TypeError, match="model must be a Flax NNX module"):
        fj.parallelize("gpt", optax.adamw(1e-3), fj.Plan(mesh=mesh(data=2)))


def test_data_checks_token_ranges_once_per_source():
    from fiddlejax import data

    tokens = np.arange(300) % 260
    with pytest.raises(ValueError, match="holds token id 259 but the vocabulary is \\[0, 256\\)"):
        data.token_batches(tokens, 8, 4, vocab_size=256)
    assert next(iter(data.token_batches(tokens, 8, 4, vocab_size=260)))["tokens"].shape == (4, 9)
    with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
        data.token_batches(tokens, 8, 0)
