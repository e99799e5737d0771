"""A Flax NNX model seen as pure functions: prologue, one layer of the stack, head and loss.

Every layout (data, tensor, pipeline) is built from this one declaration, so no user model is
rewritten per layout. There are two ways to give it:

- any NNX model, unmodified: ``parallelize(model, opt, plan, layers="path.to.blocks",
  loss=fn)``; :mod:`fiddlejax.adaptation.adapt` finds the rest (see there);
- the explicit form, the :class:`Staged` protocol below, for models that stack their layers
  themselves (``nnx.vmap``) and scan over them.

A pair ``(sum, weight)`` from a loss is reduced exactly: fiddlejax sums numerators and weights
over microbatches and data shards and divides once, so the loss and gradients equal the
single-device weighted mean however the batch is split. A scalar counts as ``(mean, 1)`` per
microbatch (the mean of equal-sized shards). The weight must not depend on the parameters (it
is not differentiated). A vocabulary padded for sharding never reaches a loss: the framework
slices the head's outputs back to the true vocabulary first (:func:`unpad_outputs`).

A loss may also report metrics of its own (:class:`Reported`): they travel beside the loss
sum through microbatches, pipeline stages and data shards and reach the step's metrics,
reduced the same exact way, so they too are the same on every layout.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from fiddlejax import intercept

Loss = Callable[[Any, dict], Any]  # (outputs, batch) -> scalar mean, or (sum, weight)
# the step's own metrics: a loss may not report under these names
STEP_METRICS = ("loss", "grad_norm", "nonfinite_skipped", "bad_ids")


class Reported(NamedTuple):
    """A loss's ``value`` (scalar mean or ``(sum, weight)``) with metrics the step reports
    beside it, each a scalar: ``means`` are averaged as the loss is (give what ``value`` gives:
    a mean per microbatch, or a sum over the loss's weight), ``sums`` are added up over the
    whole batch (counts; an integer array too, summed exactly). Not differentiated."""

    value: Any
    means: dict = {}
    sums: dict = {}


class Sums(NamedTuple):
    """What a microbatch's loss adds up besides its differentiated sum: the loss's weight and
    the numerators of its reported metrics (:class:`Reported`), all float32 scalars."""

    weight: jax.Array
    means: dict
    sums: dict


@runtime_checkable
class Staged(Protocol):
    """The explicit staged protocol: what a model declares to be split into stages."""

    stack: str
    """The attribute holding the layers, parameters stacked on a leading layer axis (e.g.
    ``nnx.vmap`` over the layer constructor with ``transform_metadata={nnx.PARTITION_NAME:
    "layers"}``); one layer maps a message to one of the same structure, shapes and dtypes.
    A message is the activation array, or any pytree of arrays that travels with it between
    layers and pipeline stages (int32 segment ids and positions, float32 statistics): each leaf
    is stashed and sent in its own dtype, integer leaves are not differentiated
    (:mod:`fiddlejax.message`). A layer whose ``__call__`` takes an ``ops`` keyword gets
    what the layout offers it there (:class:`fiddlejax.parallel.ops.Ops`: attention across a
    ``context`` split, expert dispatch), to hand to ``fiddlejax.models.common.attention`` and
    ``MoE``; one that does not still reaches them when it calls those functions."""

    def prologue(self, batch: dict) -> Any:
        """What runs before the stack (embeddings): the message entering layer 0. Like a
        layer, the prologue, ``head`` and ``loss`` may declare an ``ops`` keyword: they then
        get ``ops.vocab`` under zero=3 (the embedding and head split by vocabulary, for
        ``fiddlejax.models.common.embedding``, ``vocab_rows`` and ``cross_entropy``; a model
        opts in with ``vocab_services = True``)."""
        ...

    def head(self, x: Any) -> Any:
        """What runs after the stack (final norm, projection) on the last layer's message:
        the loss's ``outputs``."""
        ...

    def loss(self, outputs: Any, batch: dict) -> jax.Array | tuple[jax.Array, jax.Array]:
        """The mean loss, or ``(sum, weight)``; overridable with ``parallelize(loss=)``.
        ``outputs`` are never vocabulary-padded (fiddlejax slices padding off first)."""
        ...


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """Static structure of a model; parameters travel separately as an ``nnx.State``."""

    graphdef: Any            # whole-model graph definition
    rest: nnx.State          # non-parameter state (constants during training)
    stack: str               # attribute name of the stacked layers
    layer_graphdef: Any      # graph definition of one layer
    num_layers: int
    loss_fn: Loss | None     # overrides model.loss when given
    # (padded, true) sizes of vocabulary axes padded for sharding: outputs are sliced back
    # before the loss sees them, so padding never reaches a loss (see ``layout.pad_vocab``).
    vocab_pads: tuple[tuple[int, int], ...] = ()
    layer_rest: Any = None   # a layer's non-parameter state (rate-0 RNG streams), if any
    # a layout's hook on what reaches the loss: (outputs, batch) -> (outputs, batch), same
    # values, other shardings (``parallel.expert.loss_inputs``); None: as the head left them
    loss_layout: Callable | None = None
    # the model draws dropout masks per example: the step puts each row's step and example
    # index in its batch (``fiddlejax.adaptation.dropout.with_indices``; a staged-protocol
    # model: one that sets ``dropout_seed``, LoRA dropout)
    dropout: bool = False
    # services offered to every call of the prologue, layers, head and loss whatever the
    # layout (an Ops: the plan's Gist encodings), merged into the ops a layout passes
    offered: Any = None

    def with_offered(self, ops: Any) -> Any:
        """``ops`` (None: none) with :attr:`offered`'s services added."""
        if self.offered is None:
            return ops
        if ops is None:
            return self.offered
        return ops.adding(**{k: v for k, v in vars(self.offered).items() if v is not None})

    def _bind(self, params: nnx.State) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self.rest, copy=True)

    def prologue(self, params: nnx.State, batch: dict, ops: Any = None) -> Any:
        """Activations entering layer 0 (``params[stack]`` is not read); ``ops``: what the
        layout offers the model's own prologue (given only when not None)."""
        return _offering(self._bind(params).prologue, self.with_offered(ops), batch)

    def layer(self, layer_params: nnx.State, x: Any, ops: Any = None) -> Any:
        """One layer of the stack, given that layer's (unstacked) parameters; ``ops``: what the
        layout offers it (:class:`fiddlejax.parallel.ops.Ops`), passed as the block's ``ops``
        keyword when it takes one, else through :mod:`fiddlejax.intercept`."""
        rest = () if self.layer_rest is None else (self.layer_rest,)
        block = nnx.merge(self.layer_graphdef, layer_params, *rest, copy=True)
        ops = self.with_offered(ops)
        if ops is None:
            return block(x)
        if takes_ops(type(block)):
            return block(x, ops=ops)
        with intercept.setting(ops=ops):
            return block(x)

    def weighted_loss(self, params: nnx.State, x: Any, batch: dict,
                      ops: Any = None) -> tuple[jax.Array, Sums]:
        """Head and loss on the activations leaving the last layer, as float32
        ``(sum, Sums)``: the loss is ``sum / Sums.weight`` (a mean loss has weight 1);
        ``ops``: what the layout offers the model's own head and loss (not a user's loss)."""
        model = self._bind(params)
        outputs, batch = self.outputs(params, x, batch, ops)
        value = (self.loss_fn(outputs, batch) if self.loss_fn is not None
                 else _offering(model.loss, self.with_offered(ops), outputs, batch))
        return as_sums(value, self.loss_fn or type(model).loss)

    def outputs(self, params: nnx.State, x: Any, batch: dict, ops: Any = None
                ) -> tuple[Any, dict]:
        """The head's outputs on the last layer's activations, and the batch, as the loss
        gets them (what DPO's in-step reference scores: :mod:`fiddlejax.finetune.dpo`)."""
        model = self._bind(params)
        outputs = unpad_outputs(_offering(model.head, self.with_offered(ops), x),
                                self.vocab_pads)
        return self.lay_out_loss(outputs, batch, self.loss_fn or type(model).loss)

    def lay_out_loss(self, outputs: Any, batch: dict, fn: Loss) -> tuple[Any, dict]:
        """``outputs`` and ``batch`` as the loss ``fn`` gets them (:attr:`loss_layout`;
        not for a loss marked :func:`vocab_parallel`, which takes the head's layout)."""
        if self.loss_layout is None or getattr(fn, "vocab_parallel", False):
            return outputs, batch
        return self.loss_layout(outputs, batch)

    def epilogue(self, params: nnx.State, x: Any, batch: dict, ops: Any = None) -> jax.Array:
        """Head and loss on the activations leaving the last layer (the scalar loss). ``ops`` is
        passed on only when given: an adapted model's ``weighted_loss`` takes none (its
        services reach it through :mod:`fiddlejax.intercept`)."""
        total, sums = self.weighted_loss(params, x, batch, *(() if ops is None else (ops,)))
        return total / sums.weight

    # The canonical tree (the model's own ``nnx.state(model, nnx.Param)``) and the staged tree
    # (layers stacked under ``stack``) are the same for a model with the staged protocol; an
    # adapted model (fiddlejax.adaptation.adapt) stacks its blocks here.
    def to_staged(self, params: nnx.State) -> nnx.State:
        """The staged tree of canonical ``params``."""
        return params

    def to_model(self, params: nnx.State) -> nnx.State:
        """The canonical tree of staged ``params`` (the inverse of :meth:`to_staged`)."""
        return params


@functools.cache
def takes_ops(cls: type, method: str = "__call__") -> bool:
    """Whether a class's ``method`` (a block's ``__call__``) declares the ``ops`` keyword."""
    try:
        return "ops" in inspect.signature(getattr(cls, method)).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def _offering(method: Callable, ops: Any, *args: Any) -> Any:
    """``method(*args)``, given ``ops=ops`` when there are ops. A method that does not declare
    the keyword gets them as a layer's block does, through :mod:`fiddlejax.intercept` (for the
    attention it computes), unless they split the vocabulary: a prologue or loss that ignored
    that would compute with the wrong slices."""
    if ops is None:
        return method(*args)
    owner, name = type(method.__self__), method.__name__
    if not takes_ops(owner, name) and getattr(ops, "vocab", None) is None:
        with intercept.setting(ops=ops):
            return method(*args)
    if not takes_ops(owner, name):
        raise TypeError(f"{owner.__name__}.{name} takes no `ops` keyword, yet the layout "
                        f"offers it {ops}; declare `{name}(..., ops=None)` and pass ops.vocab "
                        "on (fiddlejax.models.common), or set vocab_services = False")
    return method(*args, ops=ops)


def vocab_parallel(loss_fn: Loss) -> Loss:
    """Mark ``loss_fn`` as written for logits split over their vocabulary (a one-hot
    cross-entropy, as the bundled models' losses): under ``expert`` x ``tensor`` it gets the
    head's outputs as they are, where any other loss gets their rows split and the vocabulary
    whole (``parallel.expert.loss_inputs``: XLA's partitioner aborts on some ops, a gather
    among them, over vocabulary-split logits whose rows are split over ``expert``)."""
    loss_fn.vocab_parallel = True
    return loss_fn


def mean_loss(value: Any) -> jax.Array:
    """The scalar loss a loss function's result stands for: ``sum / weight`` for a pair."""
    total, weight = as_weighted(value)
    return total / weight


def as_sums(value: Any, fn: Any = None) -> tuple[jax.Array, Sums]:
    """A loss function's result as float32 ``(sum, Sums)``: its weight and reported metrics
    (none unless it returned a :class:`Reported`)."""
    means, sums = (value.means, value.sums) if isinstance(value, Reported) else ({}, {})
    total, weight = as_weighted(value, fn)
    name = getattr(fn, "__qualname__", None) or "the loss"
    for key in (*means, *sums):
        if key in STEP_METRICS or (key in means and key in sums):
            raise ValueError(f"{name} reports a metric {key!r} that the step (or its other "
                             f"metrics) already names; rename it (taken: {STEP_METRICS})")

    def scalar(key, v, counts=False):
        v = jax.lax.stop_gradient(jnp.asarray(v))
        if counts and v.shape and jnp.issubdtype(v.dtype, jnp.integer):
            return v  # an array of counts, added up exactly (the router's loads)
        v = v.astype(jnp.float32)
        if v.shape != ():
            raise TypeError(f"{name} reports metric {key!r} of shape {v.shape}; report "
                            "scalars (reduce over the batch, e.g. .sum() or .mean())")
        return v

    return total, Sums(weight, {k: scalar(k, v) for k, v in means.items()},
                       {k: scalar(k, v, True) for k, v in sums.items()})


def as_weighted(value: Any, fn: Any = None) -> tuple[jax.Array, jax.Array]:
    """A loss function's result as float32 ``(sum, weight)``; a scalar is ``(value, 1)``
    (a :class:`Reported` one: its value's)."""
    if isinstance(value, Reported):
        value = value.value
    name = getattr(fn, "__qualname__", None) or "the loss"
    if isinstance(value, tuple | list):
        if len(value) != 2:
            raise TypeError(f"{name} returned {len(value)} values; return a scalar mean loss "
                            "or a pair (sum, weight)")
        total, weight = value
        weight = jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))
    else:
        total, weight = value, jnp.ones((), jnp.float32)
    total = jnp.asarray(total)
    if total.shape != () or weight.shape != ():
        raise TypeError(
            f"{name} must return a scalar (the mean loss) or a pair of scalars (sum, weight); "
            f"got shapes {total.shape} and {weight.shape}. Reduce over the batch in the loss, "
            "e.g. (per_token.sum(), mask.sum())")
    return total.astype(jnp.float32), weight


def unpad_outputs(outputs: Any, vocab_pads: tuple[tuple[int, int], ...]) -> Any:
    """Slice every output whose last axis is a padded vocabulary back to the true vocabulary."""
    if not vocab_pads:
        return outputs
    sizes = dict(vocab_pads)

    def cut(a):
        n = sizes.get(a.shape[-1]) if getattr(a, "ndim", 0) else None
        return a if n is None else jax.lax.slice_in_dim(a, 0, n, axis=a.ndim - 1)

    return jax.tree.map(cut, outputs)


def next_token(loss_fn: Loss, *keys: str) -> Loss:
    """``loss_fn`` declaring next-token inputs: an adapted model gets ``batch[key][:, :-1]``
    for each of ``keys`` (default ``"tokens"``) while the loss sees the whole batch (its
    targets ``batch[key][:, 1:]``). Nothing is shifted unless a loss (or the model, with a
    ``shift_inputs = (key, ...)`` attribute) declares it."""
    import functools

    @functools.wraps(loss_fn)
    def loss(outputs, batch):
        return loss_fn(outputs, batch)

    loss.shift_inputs = keys or ("tokens",)
    return loss


def check_dropout(model: nnx.Module) -> None:
    """Refuse dropout > 0 (fiddlejax runs deterministic models); rate-0 RNG streams are fine."""
    for path, m in nnx.iter_graph(model):
        rate = (getattr(m, "rate", 0.0) if isinstance(m, nnx.Dropout)
                else getattr(m, "dropout_rate", 0.0) if isinstance(m, nnx.Module) else 0.0)
        if isinstance(rate, int | float) and rate > 0:
            where = ".".join(str(p) for p in path) or "the model"
            raise ValueError(
                f"{type(model).__name__}.{where} has dropout rate {rate}: a model with the "
                "explicit staged protocol trains without dropout; pass layers= (the adapted "
                "form draws per-example dropout masks) or build the model with dropout 0.0")
