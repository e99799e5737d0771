"""How the computation sees the parameters: cast to the compute dtype and, under FSDP, gathered.

Parameters are stored float32 (master weights) and, with ``Plan(zero=3)``, sharded over ``data``
on one dimension each. A layer sees them only through :meth:`ParamView.layer`, which casts its
shards to ``Plan(compute_dtype=)`` and all-gathers them over ``data`` just before use (a 16-bit
dtype as its bits: half the bytes of gathering float32). The layer runs under one
``jax.checkpoint`` whose policy never saves a gathered or cast weight, so the backward gathers
again instead of keeping a full copy: nothing is held longer than one layer needs it, and the
stash holds activations only. Without a remat policy the layer inside is sealed
(:mod:`fiddlejax.memory.sealed`): it saves what plain differentiation saves, its own
checkpoints (MoE's blocked experts) with their own policies, which an enclosing policy would
otherwise override. The gradient is that of gathering the float32 shard and casting
after: the cotangent back in float32, then the all-gather's transpose, a reduce-scatter, so each
replica's gradient arrives already summed (in float32) and sharded.

Without a pipeline the stack runs as :meth:`ParamView.stack` instead: the same gathers and
casts, one layer ahead (:mod:`fiddlejax.compute.prefetch`).

The prologue and epilogue (embedding, head) see the parameters outside the stack the same way
(:class:`ViewedModel`).

``Plan(fsdp_gather="step")`` gathers instead once per step (:func:`gather_whole`, in the compute
dtype) and reduce-scatters the gradient, accumulated over the microbatches in float32 at full
size, once after the last (:func:`scatter_whole`): 1/m of the traffic for a whole stage held.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from fiddlejax.compute.shards import (
    SMALL,
    add_data_axis,
    free_of,
    fsdp_dims,
    only_data,
    with_data_axis,
)
from fiddlejax.memory.sealed import sealed
from fiddlejax.memory.storage import from_storage, to_storage

# Primitives whose results a layer's checkpoint never saves: the gathered and cast weights
# (and :func:`_fsdp_gather_16bit`'s, a ``custom_vjp_call``: see :func:`_not_saved`).
_NOT_SAVED = ("all_gather", "all_gather_invariant", "convert_element_type")


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def grad_dtype(dtype) -> jnp.dtype:
    """The dtype gradients accumulate in: float32 for 16-bit floats (weights gathered once in
    the compute dtype still sum their microbatches' gradients in float32)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in (jnp.bfloat16, jnp.float16) else dtype


def gather_whole(params: Any, dims: Any, specs: Any, dtype: Any = None,
                 over: tuple[Any, tuple[str, ...]] | None = None) -> Any:
    """Every leaf cast to ``dtype`` (``None``: kept) and then, on its FSDP dimension,
    all-gathered over ``data``: half the traffic of gathering float32 and casting after. Inside
    ``shard_map`` over ``data``; the gradient of the result is reduced by :func:`scatter_whole`.

    ``specs``: each leaf's sharding without ``data`` (its pipe and tensor split), which the
    gathered leaf keeps. ``over=(mesh, axes)``: the shards are over the automatic ``axes``
    (``context``) alone, with no ``shard_map`` over ``data`` (data=1): gathered over them in a
    ``shard_map`` on ``mesh`` (16-bit floats as their bits, as over ``data``)."""
    def leaf(x, d, spec):
        if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        if d < 0:
            return x
        if over is not None:  # over the manual ``axes`` inside a shard_map of its own
            mesh, axes = over[0], free_of(over[1], spec)
            return _per_device(
                lambda a: from_storage(_gathered(to_storage(a), d, axes, False), a.dtype),
                x, spec, add_data_axis(spec, d, axes), mesh)
        return _per_device(lambda a: _bits_gathered(a, d), x, spec)

    return _per_leaf(leaf, dims, params, specs)


def scatter_whole(grads: Any, dims: Any, specs: Any,
                  over: tuple[Any, tuple[str, ...]] | None = None) -> Any:
    """Each replica's full-size gradient (of :func:`gather_whole`'s result) summed over
    ``data`` and scattered back to its FSDP shard, in float32, split as ``specs`` say;
    replicated leaves unchanged. ``over=(mesh, axes)``: as :func:`gather_whole`'s; the sum over
    ``axes`` is the partitioner's (an all-reduce), each device keeping its shard."""
    def leaf(g, d, spec):
        g = g.astype(grad_dtype(g.dtype))
        if d < 0:
            return g
        if over is not None:  # the partitioner sums the replicas; each keeps its slice
            mesh, axes = over[0], free_of(over[1], spec)

            def own_slice(a):  # the transpose of _gathered's tiled gather over ``axes``
                size = a.shape[d] // math.prod(mesh.shape[ax] for ax in axes)
                return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(axes) * size, size, d)

            return _per_device(own_slice, g, add_data_axis(spec, d, axes), spec, mesh)
        return _per_device(lambda a: jax.lax.psum_scatter(a, "data", scatter_dimension=d,
                                                          tiled=True), g, spec)

    return _per_leaf(leaf, dims, grads, specs)


def _data_manual() -> bool:
    """Whether a ``shard_map`` over ``data`` encloses the trace (with data=1 none does)."""
    return "data" in jax.sharding.get_abstract_mesh().manual_axes


def _gathered(x: jax.Array, d: int, also: tuple[str, ...], data: bool | None = None
              ) -> jax.Array:
    """``x`` all-gathered on dimension ``d``: over the (manual) ``also`` axes, then over
    ``data`` when it is manual (``data``: whether it is, when known). Over ``also`` the result
    is invariant (every device of the axis holds the same), so the backward slices the
    cotangent the partitioner has summed."""
    from jax._src.lax.parallel import all_gather_invariant  # not yet public in jax 0.10

    if data is None:
        data = _data_manual()
    if also:
        x = all_gather_invariant(x, also, axis=d, tiled=True)
    if data:
        x = jax.lax.all_gather(x, "data", axis=d, tiled=True)
    return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _fsdp_gather_16bit(x: jax.Array, d: int, also: tuple[str, ...], data: bool,
                       dtype: Any) -> jax.Array:
    """``x`` cast to the 16-bit float ``dtype`` and then gathered as :func:`_gathered` does,
    as its bits (``uint16``: XLA's CPU would otherwise send the 16-bit floats as float32): half
    the traffic and the transient memory of gathering ``x`` and casting after. The gradient is
    that of gathering first: the cotangent back in ``x``'s dtype (float32), then the gather's
    transpose, so that the reduction over ``data`` (a reduce-scatter) and ``also`` sums
    float32. (The bits are integers, which autodiff would give no cotangent.) A layer's
    checkpoint never saves the result (:func:`_not_saved`)."""
    return from_storage(_gathered(to_storage(x.astype(dtype)), d, also, data), dtype)


def _fsdp_gather_16bit_fwd(x, d, also, data, dtype):
    return _fsdp_gather_16bit(x, d, also, data, dtype), x  # x: the stored shard, held anyway


def _fsdp_gather_16bit_bwd(d, also, data, dtype, x, ct):
    transpose = jax.linear_transpose(lambda a: _gathered(a, d, also, data), x)
    return transpose(ct.astype(x.dtype))


_fsdp_gather_16bit.defvjp(_fsdp_gather_16bit_fwd, _fsdp_gather_16bit_bwd)


def _not_saved(prim, params: dict) -> bool:
    """Whether a layer's checkpoint must not save this equation's results: a gather or a cast
    of the weights (:data:`_NOT_SAVED`), or :func:`_fsdp_gather_16bit` (a ``custom_vjp_call``,
    known by its function's name)."""
    if prim.name in _NOT_SAVED:
        return True
    if prim.name != "custom_vjp_call":
        return False
    jaxpr = params.get("call_jaxpr")
    info = getattr(getattr(jaxpr, "jaxpr", jaxpr), "debug_info", None)
    return getattr(info, "func_name", None) == _fsdp_gather_16bit.__name__


def _keeping(policy: Callable | None) -> Callable:
    """``policy`` (``None``: save everything) that never saves a gathered or cast weight."""
    base = policy or jax.checkpoint_policies.everything_saveable

    def keep(prim, *args, **params):
        return False if _not_saved(prim, params) else base(prim, *args, **params)

    return keep


def _bits_gathered(x: jax.Array, d: int) -> jax.Array:
    """``x`` all-gathered over ``data`` on dimension ``d``; 16-bit floats as their bits, so that
    a backend without 16-bit arithmetic (XLA's CPU) sends 16 bits instead of converting to
    float32 before the collective (a GPU sends 16 bits either way; the bitcasts cost nothing)."""
    return from_storage(jax.lax.all_gather(to_storage(x), "data", axis=d, tiled=True), x.dtype)


def _per_device(f: Callable, x: jax.Array, spec: P, in_spec: P | None = None,
                mesh: Any = None) -> jax.Array:
    """``f`` (a collective over the manual ``data``) on each device's block of ``x``, split as
    ``spec`` says over the axes not yet manual (``in_spec``: as stored, when ``f`` gathers an
    automatic axis too). Left to the partitioner, a collective over one
    manual axis first replicates its operand over the automatic ones: every stage's layers on
    every device, a tensor-parallel weight whole on each of its devices. ``mesh``: the mesh
    when no ``shard_map`` over ``data`` encloses the call (``data=1``)."""
    inner = jax.sharding.get_abstract_mesh()
    mesh = mesh if inner.empty and mesh is not None else inner
    free = {a for a in (*mesh.auto_axes, *mesh.explicit_axes) if a != "data"}
    if not free:
        return f(x)

    def kept(part):  # the axes of one dimension's entry that are still free
        names = part if isinstance(part, tuple) else (part,)
        names = tuple(a for a in names if a in free)
        return names if len(names) > 1 else (names[0] if names else None)

    out = P(*(kept(part) for part in spec))
    held = out if in_spec is None else P(*(kept(part) for part in in_spec))
    return jax.shard_map(f, in_specs=held, out_specs=out, axis_names=free,
                         mesh=None if mesh is inner else mesh)(x)


def _per_leaf(f: Callable, dims: Any, tree: Any, specs: Any) -> Any:
    """``f(leaf, dim, spec)`` over a tree whose ``dims`` and ``specs`` trees are prefixes."""
    def one(d, v, spec):
        spec = spec.get_value() if _is_var(spec) else spec
        return jax.tree.map(lambda a: f(a, d, spec), v)

    return jax.tree.map(one, dims, tree, specs)


@dataclasses.dataclass(frozen=True)
class ParamView:
    """Gather (over ``data`` on each leaf's FSDP dimension; -1: none) and cast (to the compute
    dtype; ``None``: keep) parameters. ``dims`` trees are prefixes of the parameter trees;
    ``specs`` trees (the same prefixes) give each gathered leaf's split over the other axes.
    ``matmul="fp8"``: each layer's dense matmuls in float8 (:mod:`fiddlejax.compute.fp8`). ``also``:
    automatic axes the FSDP shards also split over, inside ``data`` (``("context",)``: context
    replicas hold the same parameters, so they store a share each, as data replicas do; or
    ``("expert",)`` for the weights not already split over it: :func:`free_of`)."""

    dtype: Any = None
    matmul: str | None = None
    also: tuple[str, ...] = ()
    mesh: Any = None  # for gathers over ``also`` outside a shard_map over ``data``

    def leaf(self, x: jax.Array, dim: int, spec: P | None = None) -> jax.Array:
        cast = (self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
                and x.dtype != self.dtype)
        if dim >= 0:
            spec = spec if spec is not None else P()
            also = free_of(self.also, spec)
            stored = add_data_axis(spec, dim, also) if also else None
            if cast and jnp.dtype(self.dtype) in (jnp.bfloat16, jnp.float16):
                def gather(a):  # cast first: the gather in the compute dtype
                    return _fsdp_gather_16bit(a, dim, also, _data_manual(),
                                              jnp.dtype(self.dtype))

                return _per_device(gather, x, spec, stored, self.mesh)
            x = _per_device(lambda a: _gathered(a, dim, also), x, spec, stored, self.mesh)
        if cast:
            x = x.astype(self.dtype)
        return x

    def tree(self, params: Any, dims: Any, specs: Any = None) -> Any:
        if specs is None:
            specs = jax.tree.map(lambda _: P(), dims)
        return _per_leaf(self.leaf, dims, params, specs)

    def layer(self, layer: Callable, dims: Any, policy: Callable | None, specs: Any = None,
              prevent_cse: bool = True) -> Callable:
        """``layer(params, x)`` on gathered, cast parameters, under a checkpoint ``policy``
        (``None``: save everything else) that never saves the gathered or cast weights."""
        keep = _keeping(policy)

        def run(w, x):
            if self.matmul == "fp8":
                from fiddlejax.compute import fp8

                return fp8.layer(layer, w, x)
            return layer(w, x)

        # no policy: the layer's own residuals, its inner checkpoints' policies kept (sealed)
        inner = run if policy is not None else sealed(run)

        def viewed(lp, x):
            return inner(self.tree(lp, dims, specs), x)

        return jax.checkpoint(viewed, policy=keep, prevent_cse=prevent_cse)

    def stack(self, layer: Callable, dims: Any, policy: Callable | None,
              specs: Any = None, unroll: bool = False) -> Callable:
        """``run(stacked, x)``: the whole stack of ``layer``, each layer's weights gathered one
        layer ahead and its gradient scattered one behind (:mod:`fiddlejax.compute.prefetch`); what
        a scan of :meth:`layer` computes, with the same residuals saved."""
        from fiddlejax.compute import prefetch

        if specs is None:
            specs = jax.tree.map(lambda _: P(), dims)
        keep = _keeping(policy)

        def apply(w, x):
            if self.matmul == "fp8":
                from fiddlejax.compute import fp8

                return fp8.layer(layer, w, x)
            return layer(w, x)

        # data=1 with the shards over ``also`` (context): no shard_map over data encloses the
        # stack, so its gathers run in shard_maps of their own over ``also``
        over = (self.mesh, self.also) if self.also and not _data_manual() else None
        return prefetch.stack(apply if policy is not None else sealed(apply),
                              lambda lp: gather_whole(lp, dims, specs, self.dtype, over),
                              lambda g: scatter_whole(g, dims, specs, over), keep, unroll)


class ViewedModel:
    """A staged model whose prologue and epilogue see the outer parameters through a view.

    ``ops``: what the layout offers the model's own prologue, head and loss, passed as their
    ``ops`` argument (``ops.vocab``: the embedding and head stay split by vocabulary over
    ``data``, the view does not gather them, and the model computes with the slices:
    :mod:`fiddlejax.compute.vocab`); ``None``: nothing. Everything else (``stack``,
    ``num_layers``, ``layer``...) is the wrapped model's.
    """

    def __init__(self, inner, view: Callable, ops: Any = None):
        self._inner, self._view, self._ops = inner, view, ops

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _offered(self) -> tuple:  # the inner model's extra argument (none without ops)
        return () if self._ops is None else (self._ops,)

    def prologue(self, params, batch):
        return self._inner.prologue(self._view(params), batch, *self._offered())

    def weighted_loss(self, params, x, batch):
        return self._inner.weighted_loss(self._view(params), x, batch, *self._offered())

    def epilogue(self, params, x, batch):
        return self._inner.epilogue(self._view(params), x, batch, *self._offered())


__all__ = ["SMALL", "ParamView", "ViewedModel", "add_data_axis", "fsdp_dims", "gather_whole",
           "free_of", "grad_dtype", "only_data", "scatter_whole", "with_data_axis"]
