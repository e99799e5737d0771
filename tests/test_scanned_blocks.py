"""Blocks stacked with ``nnx.vmap`` and applied with ``nnx.scan`` run as they are (issue 37,
item 4): the Flax guide's scan-over-layers MLP (``tests/external/flax_scan``, Apache-2.0) inside
a user's tagger, through ``fj.parallelize(..., layers="mlp.blocks")``."""

from __future__ import annotations

from pathlib import Path

import jax
import optax
import pytest
from flax import nnx
from test_any_model import check_exact, load

import fiddlejax as fj

GUIDE = Path(__file__).parent / "external" / "flax_scan"


def tagger(n_layers=4, rate=None):
    """The user's model: an embedding, the guide's MLP (its own code), a vocabulary head."""
    guide = load(GUIDE / "linen_to_nnx.py", "flax_linen_to_nnx")

    class Tagger(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(32, 16, rngs=rngs)
            self.mlp = guide.MLP(16, n_layers, rngs)
            self.head = nnx.Linear(16, 32, rngs=rngs)

        def __call__(self, tokens):
            return self.head(self.mlp(self.embed(tokens)))

    model = Tagger(nnx.Rngs(0, dropout=1))
    if rate is not None:
        for _, m in nnx.iter_graph(model):
            if isinstance(m, nnx.Dropout):
                m.rate = rate
    return model


def tag_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


BATCH = {"tokens": jax.random.randint(jax.random.key(0), (8, 6), 0, 32),
         "labels": jax.random.randint(jax.random.key(1), (8, 6), 0, 32)}


@pytest.mark.parametrize("layout_", [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 2, 1),
                                     (4, 2, 1, "interleaved-1f1b", 2, 2)],
                         ids=["data-tensor", "pipe-tensor-1f1b", "interleaved"])
def test_guide_scan_over_layers_exact(layout_):
    model = tagger(rate=0.0)
    # the stack's leading axis is named like fiddlejax's own stacks; each block column-parallel
    fj.sharding.annotate(model, {r"mlp/blocks/linear/kernel": ("layers", "embed", "mlp"),
                                 r"mlp/blocks/linear/bias": ("layers", "mlp")})
    check_exact(model, lambda m: m(BATCH["tokens"]), tag_ce, BATCH, "mlp.blocks", layout_)


def test_guide_dropout_keeps_its_rate_and_masks_agree_across_layouts():
    """The guide's own Dropout(0.5) under the scan: keys per (step, example, layer), so two
    layouts that split the batch differently agree, and the mask changes after a step."""
    from test_any_model_round2 import check_dropout

    check_dropout(tagger(), tag_ce, BATCH, "mlp.blocks")


def test_stacked_batch_statistics_are_refused_by_name():
    """Flax's toy scan-over-layers example keeps BatchNorm statistics in training mode in its
    stack: no layout reproduces the whole batch's statistics, refused before any compile,
    naming the module and the fix (frozen statistics are carried: test_any_model_round3)."""
    toy = load(GUIDE / "scan_over_layers.py", "flax_scan_over_layers")  # runs its own demo
    model = toy.ScanMLP(8, n_layers=2, rngs=nnx.Rngs(0))
    fix = r"ScanMLP\['layers'\]\['bn'\].*non-parameter state.*use_running_average=True"
    with pytest.raises(ValueError, match=fix):
        fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(data=8)),
                       loss=lambda y, b: (y ** 2).mean(), layers="layers")
