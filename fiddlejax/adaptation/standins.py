"""Stand-ins that take the blocks' places to split a model's own forward, and the split's checks.

An adapted model keeps its ``__call__``; on a copy of the model its blocks are replaced by
:class:`StandIn` objects whose behaviour the active :func:`acting` mode picks: stop at the first
block (the prologue), hand the stack's output to what follows the last block (the epilogue), or
run the real blocks and record each call (the once-per-batch-shape check of :func:`check_log`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fiddlejax import intercept
from fiddlejax.adaptation.side_inputs import activation, describe


class Stop(Exception):  # noqa: N818 -- control flow, not an error
    """Raised by the first stand-in in prologue mode, carrying the first block's arguments."""

    def __init__(self, args, kwargs):
        self.args_, self.kwargs_ = args, kwargs


class StandIn:
    """Takes block ``i``'s place inside the model while its forward is split."""

    def __init__(self, i: int):
        self.i = i

    def __eq__(self, other):
        return isinstance(other, StandIn) and other.i == self.i

    def __hash__(self):
        return hash(("fiddlejax-block", self.i))

    def __repr__(self):
        return f"<fiddlejax block {self.i}>"

    def __call__(self, *args, **kwargs):
        mode = intercept.current().standins
        if mode is None:
            raise RuntimeError("a fiddlejax stand-in block was called outside fiddlejax")
        if mode[0] == "prologue":
            raise Stop(args, kwargs)
        if mode[0] == "epilogue":  # the stack's output, in the structure a block returns
            return mode[2].rebuild(mode[1] if self.i == 0 else args[0], *mode[3:])
        _, blocks, log = mode  # record: run the real block and note what it got
        out = blocks[self.i](*args, **kwargs)
        log.append((self.i, args, kwargs, out))
        return out


@contextlib.contextmanager
def acting(*mode: Any) -> Iterator[None]:
    """The stand-ins act in ``mode`` (see :class:`StandIn`) within this block:
    ``("prologue",)``, ``("epilogue", x, output[, extras])`` (``output``: a block's
    :class:`Output`) or ``("record", blocks, log)``."""
    with intercept.setting(standins=mode):
        yield


def without_blocks(model: nnx.Module, layers: str, paths: tuple[tuple, ...],
                   stack_stand_in: nnx.Module | None = None) -> nnx.Module:
    """A copy of ``model`` whose blocks (at the state ``paths``) are stand-ins
    (``stack_stand_in`` in place of the one stacked module at ``layers``,
    :mod:`fiddlejax.adaptation.scanned`)."""
    copy = nnx.merge(*nnx.split(model), copy=True)
    if stack_stand_in is not None:
        *outer, attr = layers.split(".")
        setattr(_at(copy, outer), attr, stack_stand_in)
        return copy
    lists: dict[tuple, list] = {}
    for i, path in enumerate(paths):
        if isinstance(path[-1], int):  # an element of a list: the list becomes stand-ins
            lists.setdefault(path[:-1], []).append(StandIn(i))
        else:  # a numbered attribute
            object.__setattr__(_at(copy, path[:-1]), path[-1], StandIn(i))
    for path, stand_ins in lists.items():
        object.__setattr__(_at(copy, path[:-1]), path[-1], tuple(stand_ins))
    return copy


def _at(module: Any, path) -> Any:
    for part in path:
        module = module[part] if isinstance(part, int) else getattr(module, part)
    return module


@dataclasses.dataclass(frozen=True)
class Output:
    """What a block returns: its tree, where the activation sits (the first array), and the
    other leaves (arrays as shapes: states that training drops, e.g. Mamba2's)."""

    treedef: Any
    index: int
    leaves: tuple

    @property
    def extras(self) -> list[jax.ShapeDtypeStruct]:
        return [v for k, v in enumerate(self.leaves)
                if k != self.index and isinstance(v, jax.ShapeDtypeStruct)]

    def rebuild(self, x: jax.Array, extras: list | None = None) -> Any:
        """A block's output holding ``x``; its other arrays are ``extras`` (zeros if None)."""
        given = iter(extras if extras is not None else
                     [jnp.zeros(e.shape, e.dtype) for e in self.extras])
        return jax.tree.unflatten(self.treedef, [
            x if k == self.index else next(given) if isinstance(v, jax.ShapeDtypeStruct) else v
            for k, v in enumerate(self.leaves)])


def _output(out: Any, select=None) -> Output | None:
    leaves, tdef = jax.tree.flatten(out)
    arrays = [k for k, a in enumerate(leaves) if isinstance(a, jax.Array)]
    if not arrays:
        return None
    x = activation(out, select)
    first = next((k for k in arrays if leaves[k] is x), None)
    if first is None:
        raise TypeError(f"block_output returned a new array for a block's {describe(out)}; it "
                        "must pick one of the block's outputs as it is, e.g. lambda out: out[1]")
    return Output(tdef, first, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                     if isinstance(a, jax.Array) else a for a in leaves))


def check_log(log: list, n: int, where: str, select=None, reshapes: bool = False) -> Output:
    """Check a recorded forward: each of the ``n`` blocks called once, in order, back to back,
    with the same side inputs, returning an activation (the first array, or what ``select``
    picks, shaped like the block's input unless ``reshapes``: unequal blocks) and maybe more
    that no later block receives; returns a block's output (the last one's if ``reshapes``)."""
    order = [i for i, *_ in log]
    if order != list(range(n)):
        raise ValueError(f"{where}: __call__ runs the blocks in the order {order[:8]}; "
                         f"fiddlejax needs each of the {n} blocks called once, in order")
    out_def = None
    for i, args, kwargs, out in log:
        if not args or not isinstance(args[0], jax.Array):
            raise TypeError(f"{where}: block {i} gets no array as its first argument; "
                            "fiddlejax passes the activation first")
        output = _output(out, select)
        if output is None or (not reshapes
                              and output.leaves[output.index].shape != args[0].shape):
            raise TypeError(
                f"{where}: block {i} returns {describe(out)}; fiddlejax carries one "
                f"activation between blocks: the first array a block returns (or the one "
                f"parallelize(block_output=) picks), shaped like its input "
                f"{tuple(args[0].shape)}; training drops the other outputs")
        out_def = output if reshapes else out_def or output
        if i == 0:
            continue
        prev = log[i - 1][3]
        if args[0] is not activation(prev, select):
            raise ValueError(
                f"{where}: __call__ changes the activation between block {i - 1} and block "
                f"{i}; fiddlejax runs the blocks back to back. Move that code into the "
                "blocks, or declare the staged protocol (fiddlejax.staged)")
        extras = [a for a in jax.tree.leaves(prev)
                  if isinstance(a, jax.Array) and a is not args[0]]
        if any(x is e for x in jax.tree.leaves((args[1:], kwargs)) for e in extras):
            raise ValueError(
                f"{where}: block {i} receives an output of block {i - 1} besides the "
                f"activation (block outputs: {describe(prev)}; a state or key threaded "
                "through the blocks); fiddlejax carries only the first array a block returns "
                "and drops the rest, so this forward cannot be split as it is. Fold that value "
                "into the activation, or compute it from the batch before the blocks")
        if not _same_sides(log[0][1][1:], log[0][2], args[1:], kwargs):
            raise ValueError(
                f"{where}: block {i} receives other side inputs than block 0 (a per-layer "
                "cache or mask?); fiddlejax passes every block the same side inputs")
    return out_def


def _same_sides(args0: tuple, kwargs0: dict, args: tuple, kwargs: dict) -> bool:
    """The same side inputs: the very same arrays, and equal static values."""
    first, now = jax.tree.flatten((args0, kwargs0)), jax.tree.flatten((args, kwargs))
    return first[1] == now[1] and all(
        (x is y) if isinstance(x, jax.Array) else _equal(x, y)
        for x, y in zip(first[0], now[0], strict=True))


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def depends(jaxpr: Any, n_inputs: int) -> list[bool]:
    """Whether each output of ``jaxpr`` depends on its first ``n_inputs`` inputs."""
    dep = {id(v) for v in jaxpr.invars[:n_inputs]}
    for eqn in jaxpr.eqns:
        if any(id(v) in dep for v in eqn.invars):
            dep.update(id(v) for v in eqn.outvars)
    return [id(v) in dep for v in jaxpr.outvars]
