"""Pipelines over unequal blocks (issue 50): an MLP whose widths change and a small CNN whose
blocks downsample, grouped one group per pipeline chunk (:mod:`fiddlejax.adaptation.hetero`),
exact against one device on data x pipe and pipe=4, under GPipe and 1F1B."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from test_any_model import check_exact


class Dense(nnx.Module):
    def __init__(self, i: int, o: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(i, o, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class MLP(nnx.Module):
    """Blocks of widths 6 -> 12 -> 4 -> 16 -> 8 -> 10 -> 6 -> 5: no two alike."""

    def __init__(self, widths=(6, 12, 4, 16, 8, 10, 6, 5), rngs=None):
        self.blocks = nnx.List([Dense(a, b, rngs) for a, b in zip(widths, widths[1:])])
        self.head = nnx.Linear(widths[-1], 3, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


BATCH = {"x": jax.random.normal(jax.random.key(0), (8, 6)),
         "y": jax.random.normal(jax.random.key(1), (8, 3))}


@pytest.mark.parametrize("layout_", [(8, 1, 1, None, 1, 1), (2, 2, 2, "gpipe", 4, 1),
                                     (2, 2, 2, "1f1b", 4, 1), (2, 4, 1, "1f1b", 4, 1)],
                         ids=["data", "gpipe-2x2", "1f1b-2x2", "1f1b-pipe4"])
def test_unequal_mlp_exact(layout_):
    model = MLP(rngs=nnx.Rngs(0))
    trainer = check_exact(model, lambda m: m(BATCH["x"]), mse, BATCH, "blocks", layout_)
    assert trainer.staged.num_layers == layout_[1]
