"""A user's model as its static :class:`~fiddlejax.staged.StagedModel` and its parameters.

The one entry every layout starts from: a model that declares the staged protocol is taken as
it declares itself; any other NNX model is adapted (:mod:`fiddlejax.adaptation.adapt`) from the path
of its repeated blocks.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
from flax import nnx

from fiddlejax import sharding
from fiddlejax.adaptation import adapt, hetero
from fiddlejax.staged import Loss, StagedModel, check_dropout


def split_model(model: nnx.Module, loss_fn: Loss | None = None, layers: str | None = None,
                block_output=None) -> tuple[StagedModel, nnx.State]:
    """Split ``model`` into its static :class:`StagedModel` and its parameters.

    ``layers``: the path of the repeated blocks of a model without the staged protocol;
    ``block_output(out)``: the activation among what such a block returns (default: the first
    array).
    """
    if layers is not None and not isinstance(layers, str):
        raise _one_stack(model, layers)
    explicit = all(hasattr(model, a) for a in ("stack", "prologue", "head"))
    if layers is not None and not (explicit and layers == model.stack):
        staged, params = adapt.adapt(model, loss_fn, layers, block_output)
        if staged.unit > 1 and staged.num_layers == 1:  # blocks that repeat in no pattern
            warnings.warn(
                f"{staged.callsite}: the {staged.unit} blocks repeat in no pattern; they run as "
                "unequal blocks, one group per pipeline stage (docs/byom.md, 'Blocks that "
                "differ'): tensor splits nothing inside them. Make them identical to stack "
                "them", stacklevel=sharding.user_stacklevel())
            staged = hetero.HeteroModel(**{f.name: getattr(staged, f.name)
                                           for f in dataclasses.fields(staged)})
        return staged, params
    if block_output is not None:
        raise TypeError(f"block_output= picks the activation of the blocks at layers=; "
                        f"{type(model).__name__} declares the staged protocol, whose layers "
                        "return their message themselves: pass layers=, or drop block_output")
    for attr in ("stack", "prologue", "head"):
        if not hasattr(model, attr):
            raise TypeError(
                f"{type(model).__name__} lacks `{attr}`: fiddlejax needs a model that declares "
                "`stack` (name of its stacked layers), `prologue(batch)`, `head(x)` and "
                "`loss(outputs, batch)` (see fiddlejax.staged)"
            )
    if loss_fn is None and not hasattr(model, "loss"):
        raise TypeError(f"{type(model).__name__} has no `loss(outputs, batch)`; pass loss=")
    layers = getattr(model, model.stack, None)
    if not isinstance(layers, nnx.Module):
        raise TypeError(f"{type(model).__name__}.{model.stack} must be an nnx.Module of layers")
    # RNG streams of rate-0 dropouts are constants; a rate above 0 is refused by name.
    check_dropout(model)
    layer_graphdef, layer_state, _ = nnx.split(layers, nnx.Param, ...)
    leaves = jax.tree.leaves(layer_state)
    if not leaves:
        raise ValueError(f"{type(model).__name__}.{model.stack} has no parameters")
    num_layers = int(leaves[0].shape[0])
    sharding.name_stack(model, model.stack)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sharding.check_ranks(params, type(model).__name__)
    # A rate-0 dropout's RNG streams in the layers: layer 0's serve every layer (never drawn).
    layer_rest = jax.tree.map(lambda a: a[0], nnx.state(layers, nnx.Not(nnx.Param)))
    return StagedModel(graphdef, rest, model.stack, layer_graphdef, num_layers, loss_fn,
                       layer_rest=layer_rest,
                       dropout=getattr(model, "dropout_seed", None) is not None), params


def _one_stack(model: nnx.Module, layers) -> Exception:
    """The error for a ``layers=`` that is no path; naming several (an encoder's and a
    decoder's blocks): one stack is pipelined and the other runs before or after it."""
    name = type(model).__name__
    if not (isinstance(layers, list | tuple) and layers
            and all(isinstance(p, str) for p in layers)):
        return TypeError(f"layers={layers!r} must be the path of {name}'s repeated blocks, "
                         "a string such as 'decoder.blocks'")
    first, last = layers[0], layers[-1]
    return ValueError(
        f"layers={layers!r}: fiddlejax pipelines one stack of blocks, named by one path. For "
        f"an encoder-decoder name one of them: layers='{last}' runs {name}'s code before "
        "it (the encoder) in the prologue, its output reaching every block with its gradient; "
        f"layers='{first}' runs the code after it (the decoder) in the epilogue (docs/byom.md, "
        "'Encoder-decoders'). Both stacks in one pipeline is not supported yet")
