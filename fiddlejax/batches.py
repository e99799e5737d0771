"""Global batches: checked against what the model and plan take, then placed over ``data``.

Every check runs on shapes before anything compiles, so a bad batch gets a message naming the
key, its shape and the fix. With several processes each passes only its own rows, the slice of
the global batch its devices own on ``data`` (``fiddlejax.distributed.data_shard(mesh)``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fiddlejax import checks
from fiddlejax.plan import Plan


def check(batch: dict, plan: Plan, batch_spec: Callable | None, model_name: str) -> None:
    """Raise a clear error for a batch this plan and model cannot take, before compiling."""
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict of arrays, got {type(batch).__name__}")
    if batch_spec is not None:  # 1-D tokens must not pass as a batch of scalars
        checks.check_rank(batch, batch_spec(1), model_name)
    sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in batch.items()}
    bs = set(sizes.values())
    if len(bs) != 1 or None in bs:
        raise ValueError(f"batch arrays must share a leading batch dimension; got {sizes}")
    b = bs.pop()
    per = plan.data * plan.microbatches
    if b % per:
        raise ValueError(
            f"global batch size {b} is not divisible by data={plan.data} x "
            f"microbatches={plan.microbatches} = {per}; use a multiple of {per} "
            f"such as {max(per, b - b % per)}")
    if batch_spec is None:
        return
    # A model whose batch_spec takes the batch reads its length from it (the sequence length
    # belongs to the data: any length up to the model's maximum).
    takes_batch = "batch" in inspect.signature(batch_spec).parameters
    want = batch_spec(b, batch) if takes_batch else batch_spec(b)
    # Extra keys are allowed: a loss passed to parallelize may read more (e.g. a mask).
    if not set(want) <= set(batch):
        raise ValueError(f"{model_name} expects batch keys {sorted(want)}, got {sorted(batch)}")
    for k, spec in want.items():
        x = batch[k]
        if tuple(np.shape(x)) != tuple(spec.shape) or np.dtype(x.dtype) != spec.dtype:
            raise ValueError(
                f"batch[{k!r}] is {np.dtype(x.dtype).name}{list(np.shape(x))}, but "
                f"{model_name} expects {np.dtype(spec.dtype).name}{list(spec.shape)}")


def place(batch: dict, sharding: NamedSharding, check_fn: Callable[[dict], None],
          ranges: dict | None = None) -> dict:
    """``batch`` checked by ``check_fn`` (on its global shapes) and placed with ``sharding``;
    ShapeDtypeStructs (for lowering) come back as ShapeDtypeStructs carrying it. ``ranges``
    (:func:`fiddlejax.checks.value_ranges`): the ids of host (NumPy) arrays are checked too, a
    pass over the batch on the host that needs no device sync (an id outside the vocabulary
    gives a finite, meaningless loss, or NaN, never an error inside XLA)."""
    if ranges and isinstance(batch, dict):
        checks.check_ids(batch, ranges)
    if isinstance(batch, dict) and batch and all(
            isinstance(x, jax.ShapeDtypeStruct) for x in batch.values()):
        check_fn(batch)
        return {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                for k, x in batch.items()}
    if jax.process_count() == 1 or not isinstance(batch, dict):
        check_fn(batch)
        return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)
    from fiddlejax import distributed

    count = distributed.data_shard(sharding.mesh)[1]
    check_fn({k: jax.ShapeDtypeStruct((np.shape(x)[0] * count, *np.shape(x)[1:]), x.dtype)
              for k, x in batch.items()})
    return {k: jax.make_array_from_process_local_data(
                sharding, np.asarray(x), (np.shape(x)[0] * count, *np.shape(x)[1:]))
            for k, x in batch.items()}


def place_steps(batches: dict, sharding: NamedSharding, check_fn: Callable[[dict], None],
                ranges: dict | None = None) -> dict:
    """Batches ``[steps, batch, ...]`` for K steps in one program, each step's checked by
    ``check_fn`` (and host ids by ``ranges``) and split over ``data`` (``sharding`` is the
    one-step batch sharding)."""
    if not isinstance(batches, dict) or not batches:
        raise TypeError("batches must be a dict of arrays shaped [steps, batch, ...]")
    if ranges:
        checks.check_ids(batches, ranges)
    ks = {np.shape(v)[0] if np.ndim(v) > 1 else None for v in batches.values()}
    if len(ks) != 1 or None in ks:
        raise ValueError("batches must share a leading steps dimension: [steps, batch, ...]")
    check_fn({k: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype) for k, v in batches.items()})
    stepped = NamedSharding(sharding.mesh, P(None, *sharding.spec))
    return jax.tree.map(lambda x: jax.device_put(x, stepped), batches)

