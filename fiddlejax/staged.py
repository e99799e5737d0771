"""A Flax NNX model seen as pure functions: prologue, one layer of the stack, head and loss.

Every layout (data, tensor, pipeline) is built from this one declaration, so no user model is
rewritten per layout. A model qualifies when it has:

- ``stack: str``: the attribute holding its layers, built with parameters stacked on a leading
  layer axis (e.g. ``nnx.vmap`` over the layer constructor);
- ``prologue(batch) -> x``: what runs before the stack (embeddings);
- ``head(x) -> outputs``: what runs after it (final norm, projection);
- ``loss(outputs, batch) -> scalar``: the mean loss (overridable in ``parallelize``);
- optionally ``batch_spec(batch_size) -> {name: jax.ShapeDtypeStruct}`` for input checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

Loss = Callable[[Any, dict], jax.Array]


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """Static structure of a model; parameters travel separately as an ``nnx.State``."""

    graphdef: Any            # whole-model graph definition
    rest: nnx.State          # non-parameter state (constants during training)
    stack: str               # attribute name of the stacked layers
    layer_graphdef: Any      # graph definition of one layer
    num_layers: int
    loss_fn: Loss | None     # overrides model.loss when given

    def _bind(self, params: nnx.State) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self.rest, copy=True)

    def prologue(self, params: nnx.State, batch: dict) -> Any:
        """Activations entering layer 0 (``params[stack]`` is not read)."""
        return self._bind(params).prologue(batch)

    def layer(self, layer_params: nnx.State, x: Any) -> Any:
        """One layer of the stack, given that layer's (unstacked) parameters."""
        return nnx.merge(self.layer_graphdef, layer_params, copy=True)(x)

    def epilogue(self, params: nnx.State, x: Any, batch: dict) -> jax.Array:
        """Head and loss on the activations leaving the last layer."""
        model = self._bind(params)
        outputs = model.head(x)
        if self.loss_fn is not None:
            return self.loss_fn(outputs, batch)
        return model.loss(outputs, batch)


def split(model: nnx.Module, loss_fn: Loss | None = None) -> tuple[StagedModel, nnx.State]:
    """Split ``model`` into its static :class:`StagedModel` and its parameters."""
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
    layer_graphdef, layer_state = nnx.split(layers)
    if nnx.state(layers, nnx.RngState):
        raise ValueError(
            f"{type(model).__name__}.{model.stack} holds RNG state (dropout > 0?); parallelized "
            "training runs deterministic layers only for now: set dropout=0.0"
        )
    leaves = jax.tree.leaves(layer_state)
    if not leaves:
        raise ValueError(f"{type(model).__name__}.{model.stack} has no parameters")
    num_layers = int(leaves[0].shape[0])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if nnx.state(model, nnx.RngState):
        raise ValueError(
            f"{type(model).__name__} holds RNG state (dropout > 0?); parallelized training runs "
            "deterministic models only for now: set dropout=0.0"
        )
    return StagedModel(graphdef, rest, model.stack, layer_graphdef, num_layers, loss_fn), params
