"""Varying-manual-axes typing for hand-written collective schedules.

psum is typed Varying -> Invariant; a schedule of ppermutes stays Varying even though every
device ends with the same bits. :func:`mark_invariant` records that fact with a no-op primitive
(the same role as jax's own pvary in the other direction), so a custom all-reduce is typed as
psum's result is and an out_spec may omit the reduced axes. Only values that really are equal on
every device of the axes go through it: the results of complete all-reduce / broadcast
schedules.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

AxisName = Any  # str or tuple of str

_invariant_p = Primitive("fj_assert_invariant")
_invariant_p.def_impl(lambda x, *, axes: x)


def _invariant_abstract_eval(aval, *, axes):
    mat = aval.mat
    return aval.update(
        manual_axis_type=mat.update(varying=frozenset(a for a in mat.varying if a not in axes))
    )


_invariant_p.def_abstract_eval(_invariant_abstract_eval)
mlir.register_lowering(_invariant_p, lambda ctx, x, *, axes: [x])
batching.primitive_batchers[_invariant_p] = lambda args, dims, *, axes: (
    _invariant_p.bind(args[0], axes=axes),
    dims[0],
)


def axes_of(axis_name: AxisName) -> tuple:
    """``axis_name`` as a tuple of mesh axes (one name, or several)."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _varying(x: jax.Array) -> frozenset:
    return jax.typeof(x).mat.varying


def mark_invariant(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Type `x` as invariant over `axis_name` (no data moves). Only for values that are equal on
    every device of the axes."""
    axes = tuple(a for a in axes_of(axis_name) if a in _varying(x))
    return _invariant_p.bind(x, axes=axes) if axes else x


def make_varying(x: jax.Array, axes: tuple) -> jax.Array:
    """Type `x` as varying over every axis of `axes` (a ppermute schedule needs it so)."""
    missing = tuple(a for a in axes if a not in _varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x
