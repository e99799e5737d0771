"""Reliability, round four (issue 49), in-process: ``trainer.step`` composes under a user's
``jax.jit``/``lax.scan``, readers never delete a writer's files, export never loses the user's
files or the previous export, and the lock file is never followed through a symlink.

The readers-during-training and failed-export faults run the real commands:
``benchmarks/faults.py`` (``readers``, ``export``)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)


@pytest.mark.parametrize("layout", ["pipelined", "zero3"])
def test_trainer_step_composes_under_jit_and_scan(layout):
    """The donated-state check called ``is_deleted()`` on tracers: a user's jitted, scanned
    loop over ``trainer.step`` failed with ConcretizationTypeError."""
    if layout == "pipelined":
        plan = fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, devices=jax.devices()[:4]),
                       schedule="1f1b", microbatches=2)
    else:
        plan = fj.Plan(mesh=fj.make_mesh(data=2, devices=jax.devices()[:2]), zero=3)
    t = fj.parallelize(GPT(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-2), plan)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 4, 9), 0, 32), np.int32)

    @jax.jit
    def two_steps(state, batches):
        def body(s, batch):
            s, m = t.step(s, batch)
            return s, m["loss"]

        return jax.lax.scan(body, state, batches)

    state, losses = two_steps(t.init(), {"tokens": tokens})
    eager, want = t.init(), []
    for i in range(2):
        eager, m = t.step(eager, {"tokens": tokens[i]})
        want.append(float(m["loss"]))
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    got, ref = t.params(state), t.params(eager)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
