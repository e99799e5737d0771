"""An ordinary Flax NNX model as a :class:`~fiddlejax.staged.StagedModel`, its code untouched.

``fj.parallelize(model, optimizer, plan, layers="decoder.blocks", loss=loss_fn)`` names where the
repeated blocks live: a Python list or tuple, an ``nnx.List``, or numbered attributes
(``"decoder.block_*"`` for ``block_0``, ``block_1``...). From that alone:

- the blocks' parameters are stacked on a leading layer axis (under the key ``layers``, the
  path itself) and unstacked again for the canonical tree, so ``trainer.params(state)``,
  gradients and checkpoints keep the model's own ``nnx.state(model, nnx.Param)``
  (:meth:`AdaptedModel.to_staged` and :meth:`AdaptedModel.to_model`);
- the model's own ``__call__`` is split around the blocks: the blocks are replaced by stand-ins
  that stop the forward at the first block (the prologue) or feed the stack's output to what
  follows the last block (the epilogue), so no part of the model's code is copied;
- side inputs the blocks receive (masks, positions, segment ids, rotary tables: whatever
  arrays ``__call__`` passes besides the activation) travel with the activation: the message
  between layers and stages is a dict of the activation and the side inputs, each in its own
  dtype, which each layer unpacks (those computed from the parameters, an encoder's output,
  with their gradient; the others with none);
- blocks that differ in static attributes (local and global attention...) are grouped into the
  shortest repeating unit (5 local + 1 global: units of 6 blocks), or refused with an error that
  names the differing attribute.

The model is called with the batch entries named like parameters of its ``__call__`` (those a
next-token model or loss declares shifted, :func:`~fiddlejax.staged.next_token`, as
``x[:, :-1]``; never implied by a key's name), and with None for a required
parameter typed optional that the batch lacks (``cache: Cache | None``: a training forward has no
KV cache); the loss gets its outputs and the whole batch. One shapes-only trace per batch shape
checks that the split is faithful: each block called once, in order, back to back, every block
given the same side inputs; side inputs computed from the parameters are noted. Anything else is an
error naming the model, the blocks and the fix, never a traceback from inside tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
from typing import Any

import jax
import numpy as np
from flax import nnx

from fiddlejax import intercept, sharding
from fiddlejax.adaptation import dropout, scanned
from fiddlejax.adaptation.blocks import (
    FROZEN,
    block_constants,
    check_frozen,
    check_unwritten,
    find_blocks,
    refuse_reads,
    repeating_unit,
    stack_params,
    stacked_at,
    unstack_params,
    watch,
)
from fiddlejax.adaptation.side_inputs import (
    activation,
    constant_leaves,
    counted,
    key,
    keys_of,
    pack,
    unpack,
)
from fiddlejax.adaptation.standins import Stop, acting, check_log, depends, without_blocks
from fiddlejax.staged import Loss, StagedModel, Sums, as_sums, unpad_outputs


@dataclasses.dataclass(frozen=True)
class AdaptedModel(StagedModel):
    """A :class:`StagedModel` of an unmodified NNX model (build with :func:`adapt`)."""

    unit: int = 1                      # blocks per stacked layer
    unit_graphdefs: tuple = ()         # graph definitions of a unit's blocks
    unit_rest: tuple = ()              # their RNG streams (rate-0 dropout)
    unit_consts: tuple = ()            # their frozen state (statistics), stacked over units
    block_keys: tuple = ()             # state paths of the blocks in the model's tree
    template: Any = None               # the model's canonical parameters (shapes, metadata)
    sides: dict = dataclasses.field(default_factory=dict)  # side_inputs.key -> Side
    callsite: str = ""
    call_names: tuple = ()             # parameter names of the model's __call__, in order
    call_nones: frozenset = frozenset()  # required ones typed optional: None if not given
    shift: tuple = ()                  # batch keys the model gets as x[:, :-1] (next token)
    dropout_base: Any = None           # key data every dropout key is folded from
    scanned: bool = False              # the blocks are one nnx.vmap stack applied by a scan
    ignored: tuple = ()                # attributes that differ between blocks, presumed unread
    block_output: Any = None           # picks the activation from a block's return (None: 1st)
    # batch shapes -> (a block output's treedef, the constant side inputs {index: value})
    checked: dict = dataclasses.field(default_factory=dict)

    # -- the canonical tree (the model's own) <-> the staged tree (blocks stacked) -----------
    def to_staged(self, params: nnx.State) -> nnx.State:
        """The model's parameter tree with the blocks stacked under ``self.stack``; every leaf
        takes the variable type and sharding names of the canonical template (so params
        without metadata, e.g. restored ones, are laid out as the trainer planned)."""
        return stack_params(params, self.template, self.block_keys, self.unit, self.stack,
                            self.callsite.split(".")[0], self.scanned)

    def to_model(self, params: nnx.State) -> nnx.State:
        """The inverse of :meth:`to_staged`: blocks unstacked into the model's own tree."""
        return unstack_params(params, self.template, self.block_keys, self.unit, self.stack,
                              self.scanned)

    # -- the forward, split around the blocks ------------------------------------------------
    def _outer(self, params: nnx.State) -> nnx.Module:
        outer = nnx.State({k: v for k, v in params.items() if k != self.stack})
        return nnx.merge(self.graphdef, outer, self.rest, copy=True)

    def _call(self, model: nnx.Module, batch: dict) -> Any:
        """The model on a batch: every batch entry named like a parameter of ``__call__`` as
        that keyword (None for the required optional ones the batch lacks, as a training script
        passes ``cache=None``); the declared ``shift`` keys as ``x[:, :-1]``, the first
        positional argument when no parameter has their name."""
        batch = {k: v[:, :-1] if k in self.shift else v for k, v in batch.items()}
        kwargs = {k: v for k, v in batch.items() if k in self.call_names}
        first = [batch[k] for k in self.shift if k not in self.call_names][:1]
        skip = set(kwargs) | (set(self.call_names[:1]) if first else set())
        defaults = {k: None for k in self.call_nones - skip}
        if kwargs or first:
            return model(*first, **defaults, **kwargs)
        raise KeyError(
            f"the batch has keys {sorted(batch)}, none of them a parameter of "
            f"{self.callsite.split('.')[0]}.__call__ {sorted(self.call_names)}: fiddlejax calls "
            "an adapted model with the batch entries named like its parameters; rename the "
            "batch keys (or declare next-token inputs: loss=fj.next_token(loss_fn, key))")

    def prologue(self, params: nnx.State, batch: dict) -> dict:
        """Runs the model's ``__call__`` up to its first block: the message."""
        if _shape_key(batch) not in self.checked:
            self._check_split(params, batch)
        keys = dropout.example_keys(self.dropout_base, batch) if self.dropout else None
        with (dropout.keys(keys, -1),  # the prologue's dropouts are "layer" -1
              self._offered()):
            args, kwargs = self._first_call(self._outer(params), batch)
        _, consts, learned, _ = self.checked[_shape_key(batch)]
        return pack(args[0], args[1:], kwargs, self.sides, self.callsite, consts, keys,
                    counter=self._counted, learned=learned)

    @property
    def num_blocks(self) -> int:
        """The blocks at ``layers`` (units x blocks per unit)."""
        return self.num_layers * self.unit

    @property
    def reshapes(self) -> bool:
        """Whether a block may return an activation shaped unlike its input (unequal blocks:
        :mod:`fiddlejax.adaptation.hetero`)."""
        return False

    @property
    def _counted(self) -> bool:
        """Whether the message counts the blocks run (blocks pick their constants by it)."""
        return self._frozen

    @property
    def _frozen(self) -> bool:
        return any(jax.tree.leaves(c) for c in self.unit_consts)

    def _block(self, j: int, params: nnx.State, u: Any) -> nnx.Module:
        """Block ``j`` of unit ``u`` (an index, traced or not): its frozen state is its own."""
        states = [params, self.unit_rest[j]]
        if self._frozen:
            xp = np if isinstance(u, int) else jax.numpy  # a traced index: a traced gather
            states.append(jax.tree.map(lambda c: xp.asarray(c)[u], self.unit_consts[j]))
        return nnx.merge(self.unit_graphdefs[j], *states, copy=True)

    def _offered(self):
        """The model's own code outside its blocks sees :attr:`offered` (Gist's encodings)
        through the interception, beside what is already offered there."""
        return intercept.setting(ops=self.with_offered(intercept.current().ops))

    def _tracing(self):
        """The model's own scan over a stacked module runs unrolled while fiddlejax traces its
        pieces (:mod:`fiddlejax.adaptation.scanned`); lists of blocks need nothing."""
        return scanned.unrolled() if self.scanned else contextlib.nullcontext()

    def _first_call(self, model: nnx.Module, batch: dict) -> tuple[tuple, dict]:
        with acting("prologue"), self._tracing():
            try:
                self._call(model, dropout.without_indices(batch))
            except Stop as stop:
                return stop.args_, stop.kwargs_
        raise ValueError(f"{self.callsite}: the model's __call__ never called these blocks; "
                         "name the blocks that __call__ runs")

    def layer(self, layer_params: nnx.State, x: dict, ops: Any = None) -> dict:
        """One stacked unit of blocks on the message; the blocks reach ``ops`` (what
        the layout offers) through :mod:`fiddlejax.intercept`, being the user's own."""
        side, ops = self.sides[key(x)], self.with_offered(ops)
        h, args, kwargs = unpack(x, side)
        keys, count = keys_of(x)
        for j in range(self.unit):
            block = self._block(j, layer_params[j] if self.unit > 1 else layer_params, count)
            with (dropout.keys(keys, None if count is None else count * self.unit + j),
                  intercept.setting(ops=ops)):
                h = activation(block(h, *args, **kwargs), self.block_output)
        return counted({**x, "x": h.reshape(x["x"].shape).astype(x["x"].dtype)}, 1)

    def weighted_loss(self, params: nnx.State, x: Any, batch: dict) -> tuple[jax.Array, Sums]:
        """Runs the model's ``__call__`` after its blocks on the stack's output, then the loss."""
        outputs, batch = self.outputs(params, x, batch)
        return as_sums(self.loss_fn(outputs, batch), self.loss_fn)

    def outputs(self, params: nnx.State, x: Any, batch: dict) -> tuple[Any, dict]:
        """The model's outputs (its ``__call__`` after the blocks) and the batch, as the loss
        gets them."""
        h, _, _ = unpack(x, self.sides[key(x)])
        keys = keys_of(x)[0]
        with (acting("epilogue", h, self.checked[_shape_key(batch)][0]),
              dropout.keys(keys, -2), self._tracing(), self._offered()):
            outputs = self._call(self._outer(params), dropout.without_indices(batch))
        outputs = unpad_outputs(outputs, self.vocab_pads)
        return self.lay_out_loss(outputs, dropout.without_indices(batch), self.loss_fn)

    # -- checks, once per batch shape: the forward splits as assumed --------------------------
    def _check_split(self, params: nnx.State, batch: dict) -> None:
        """Trace the whole forward once (shapes only) with the real blocks and check that it
        calls them once each, in order, back to back, with the same side inputs, and note the
        side inputs that depend on the parameters (carried with their gradient)."""
        outer = _abstract(nnx.State({k: v for k, v in params.items() if k != self.stack}))
        flat = dict(nnx.to_flat_state(self.template))
        blocks = [nnx.from_flat_state([(p[len(key):], _abstract(v)) for p, v in flat.items()
                                       if p[: len(key)] == key]) for key in self.block_keys]
        n = self.num_blocks
        if self.scanned:  # one stacked module: its layers, one by one
            blocks = [scanned.per_layer(blocks[0], i) for i in range(n)]
        b = _abstract(dropout.without_indices(batch))
        info, hits = {}, []

        def record(o, bps, bt):
            model = nnx.merge(self.graphdef, o, self.rest, copy=True)
            real = [self._block(i % self.unit, bp, i // self.unit)
                    for i, bp in enumerate(bps)]
            frozen = [jax.tree.leaves(nnx.state(r, FROZEN)) for r in real]
            for block in real:
                watch(block, self.ignored, hits)
            log = []
            with acting("record", real, log), dropout.keys(None, 0), self._tracing():
                self._call_checked(model, bt)  # eval mode: shapes only
            info["out"] = check_log(log, n, self.callsite, self.block_output, self.reshapes)
            info["io"] = tuple(tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (
                args[0], activation(out, self.block_output))) for _, args, _, out in log)
            check_unwritten(self.callsite, frozen, [jax.tree.leaves(nnx.state(r, FROZEN))
                                                    for r in real])

        jax.eval_shape(record, outer, blocks, b)
        refuse_reads(self.callsite, hits)
        if info["out"].extras:
            self._check_extras_unused(info["out"], outer, b)

        def side_inputs(o, bt):
            args, kwargs = self._first_call(nnx.merge(self.graphdef, o, self.rest, copy=True), bt)
            return [a for a in jax.tree.leaves((args[1:], kwargs)) if isinstance(a, jax.Array)]

        with dropout.keys(None, 0):
            closed = jax.make_jaxpr(side_inputs)(outer, b)
        consts = constant_leaves(closed)  # rotary tables, causal masks: handed over whole
        learned = frozenset(  # an encoder's output: carried with its gradient
            k for k, (dep, a) in enumerate(zip(depends(closed.jaxpr, len(jax.tree.leaves(outer))),
                                               closed.out_avals, strict=True))
            if dep and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact))
        self.checked[_shape_key(batch)] = (info["out"], consts, learned, info["io"])

    def _check_extras_unused(self, out: Any, outer: nnx.State, batch: dict) -> None:
        """Refuse a loss that uses what blocks return besides the activation (training drops
        it: the epilogue sees zeros)."""
        h = out.leaves[out.index]

        def tail(extras, o, bt):
            model = nnx.merge(self.graphdef, o, self.rest, copy=True)
            with acting("epilogue", h, out, extras), dropout.keys(None, -2), self._tracing():
                outputs = self._call(model, bt)
            return jax.tree.leaves(self.loss_fn(unpad_outputs(outputs, self.vocab_pads), bt))

        h = jax.numpy.zeros(h.shape, h.dtype)
        closed = jax.make_jaxpr(tail)(out.extras, outer, batch)
        if any(depends(closed.jaxpr, len(out.extras))):
            raise ValueError(
                f"{self.callsite}: the loss uses what the blocks return besides the activation "
                f"({len(out.extras)} more arrays: states?); fiddlejax carries the first array a "
                "block returns and drops the rest in training. Leave the rest out of the "
                "model's outputs, or out of the loss")

    def _call_checked(self, model: nnx.Module, batch: dict) -> Any:
        """:meth:`_call`, a shape error from inside the model turned into one that names the
        batch, what the model was given and how to declare next-token inputs."""
        try:
            return self._call(model, batch)
        except (TypeError, ValueError, AssertionError) as e:
            if "fiddlejax" in str(e):
                raise
            shapes = {k: tuple(np.shape(v)) for k, v in batch.items()}
            given = (f"the keys {sorted(self.shift)} shifted to x[:, :-1] (next token)"
                     if self.shift else "every entry whole (no key is shifted unless declared: "
                     "loss=fj.next_token(loss_fn, key) or a model attribute "
                     "shift_inputs = (key,))")
            raise ValueError(
                f"{self.callsite}: the model's __call__ fails on a batch shaped {shapes}, "
                f"given {given}: {type(e).__name__}: {str(e).splitlines()[0][:300]}. Give "
                "batch entries of the shapes the model takes") from e


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _shape_key(batch: dict) -> tuple:
    return tuple(sorted((k, tuple(np.shape(v))) for k, v in batch.items()))


def _required_optional(params: list[inspect.Parameter]) -> frozenset:
    """The parameters without a default whose annotation admits None (``X | None``,
    ``Optional[X]``, also as strings): Flax's Gemma requires ``cache`` and trains with None."""
    out = set()
    for p in params:
        ann = p.annotation if isinstance(p.annotation, str) else repr(p.annotation)
        keyword = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        optional = {"None", "Optional"} & set(re.findall(r"\w+", ann))
        if keyword and optional and p.default is inspect.Parameter.empty:
            out.add(p.name)
    return frozenset(out)


def adapt(model: nnx.Module, loss_fn: Loss | None, layers: str,
          block_output=None) -> tuple[AdaptedModel, nnx.State]:
    """Split an unmodified ``model`` around the blocks at ``layers``; returns the staged model
    and the model's own (canonical) parameter tree. ``block_output(out)`` picks the activation
    from what a block returns (default: its first array)."""
    name = type(model).__name__
    shift = tuple(getattr(loss_fn, "shift_inputs", ()) or getattr(model, "shift_inputs", ()))
    if loss_fn is None:
        if not callable(getattr(model, "loss", None)):
            raise TypeError(f"{name} has no loss(outputs, batch); pass parallelize(..., loss=fn) "
                            "with fn(outputs, batch) -> scalar mean or (sum, weight)")
        loss_fn = type(model).loss.__get__(model)
    params = [p for p in inspect.signature(type(model).__call__).parameters.values()
              if p.name != "self"]
    stack = stacked_at(model, layers)
    if stack is None:
        paths, blocks = find_blocks(model, layers)
    else:  # one module stacked with nnx.vmap: the layer axis is already there
        paths, blocks = (tuple(layers.split(".")),), [stack[0]]
    check_frozen(model, layers)
    if stack is None:
        sharding.infer_names(model)
    else:
        with scanned.one_layer_view(stack[0]):  # names from one layer's shapes
            sharding.infer_names(model)
        scanned.name_layers(stack[0])
    canonical = nnx.state(model, nnx.Param)
    sharding.check_ranks(canonical, name)
    unit, ignored = (repeating_unit(model, layers, blocks, unequal=True) if stack is None
                     else (1, ()))
    unit_graphdefs, unit_rest = [], []
    for b in blocks[:unit]:
        gd, _, rest = nnx.split(b, nnx.Param, nnx.RngState, ...)[:3]
        unit_graphdefs.append(gd)
        unit_rest.append(rest if stack is None else scanned.per_layer(rest, 0))
    consts = block_constants(blocks, unit, stack is not None)
    # The model without its blocks: stand-ins take their places (on a copy).
    copy = without_blocks(model, layers, paths,
                          None if stack is None else scanned.ScanStandIn(stack[1]))
    graphdef, _, rest = nnx.split(copy, nnx.Param, ...)
    n_layers = len(blocks) // unit if stack is None else stack[1]
    staged = AdaptedModel(
        graphdef=graphdef, rest=rest, stack=layers, layer_graphdef=tuple(unit_graphdefs),
        num_layers=n_layers, loss_fn=loss_fn, unit=unit, scanned=stack is not None,
        ignored=ignored, block_output=block_output,
        unit_graphdefs=tuple(unit_graphdefs), unit_rest=tuple(unit_rest), unit_consts=consts,
        block_keys=paths, template=_abstract(canonical),
        callsite=f"{name}.{layers}",
        call_names=tuple(p.name for p in params), call_nones=_required_optional(params),
        shift=shift, dropout=bool(dropout.rates(model)),
        dropout_base=np.asarray(dropout.base_key(model)))
    return staged, canonical


__all__ = ["AdaptedModel", "adapt"]
