"""Device meshes with the named axes fiddlejax uses: ``data``, ``pipe``, ``context``, ``expert``,
``tensor``.

The axis order is fixed (``data`` outermost, ``tensor`` innermost) so that, with devices listed
host by host, a tensor group sits on the fastest links inside one node, the pipeline crosses the
next-fastest, and data parallelism spans the rest. ``context`` sits between ``pipe`` and
``tensor`` (Megatron orders tensor, context, data, pipe from the inside out): its ring moves
every layer's K/V, more bytes per step than a pipeline's one activation per tick, but overlaps
them with the attention blocks, which tensor's per-matmul all-reduces cannot. ``expert`` sits
inside ``context``, next to ``tensor`` (MaxText, Megatron and DeepSpeed keep expert groups
within a node): every MoE layer sends its tokens out and back by all-to-all, twice forward and
twice backward, each the size of the layer's activations times top-k (times the padding of
static shapes, :mod:`fiddlejax.parallel.expert`), none of it overlapped (the experts wait for
their tokens), while an all-to-all crosses the group's every pair of devices, the pattern
slow inter-node links price worst. Axes are ``Auto``: the runtime makes ``data`` and ``pipe``
manual inside ``jax.shard_map`` and leaves ``tensor``, ``context`` and ``expert`` to the GSPMD
partitioner, ``context`` becoming manual only inside attention and ``expert`` only inside the
MoE layers (docs/architecture.md, "Facts the runtime relies on").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "pipe", "context", "expert", "tensor")


def _resolve_sizes(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
    for name, size in sizes.items():
        if not isinstance(size, int | np.integer) or isinstance(size, bool):
            raise TypeError(f"{name}={size!r} must be an int (or -1 to infer it)")
        if size == 0 or size < -1:
            raise ValueError(f"{name}={size} must be a positive int, or -1 to infer it")
    inferred = [n for n, s in sizes.items() if s == -1]
    if len(inferred) > 1:
        raise ValueError(
            f"only one axis may be -1 (inferred), got {', '.join(f'{n}=-1' for n in inferred)}; "
            "give explicit sizes for all but one"
        )
    known = math.prod(s for s in sizes.values() if s != -1)
    if inferred:
        if n_devices % known:
            raise ValueError(
                f"cannot infer {inferred[0]}: {n_devices} devices are not divisible by the "
                f"product {known} of the other axes ({_fmt(sizes)})"
            )
        sizes = {**sizes, inferred[0]: n_devices // known}
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(
            f"mesh {_fmt(sizes)} needs {math.prod(sizes.values())} devices but {n_devices} are "
            f"available; make data*pipe*context*expert*tensor equal {n_devices} (or pass -1 "
            "for one axis)"
        )
    return sizes


def _fmt(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def make_mesh(
    data: int = -1,
    pipe: int = 1,
    tensor: int = 1,
    *,
    context: int = 1,
    expert: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh with axes ``("data", "pipe", "context", "expert", "tensor")``; ``-1`` infers one
    axis from the devices. ``context`` splits every sequence (:mod:`fiddlejax.parallel.context`);
    ``expert`` splits MoE experts and, outside them, the batch (:mod:`fiddlejax.parallel.expert`).

    ``devices`` defaults to ``jax.devices()`` (every process's devices, host-major), so ``tensor``
    varies fastest and stays within a host whenever ``tensor`` divides the devices per host.
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("devices= is empty; pass at least one device")
    sizes = _resolve_sizes({"data": data, "pipe": pipe, "context": context, "expert": expert,
                            "tensor": tensor}, len(devs))
    shape = tuple(sizes[a] for a in AXES)
    grid = np.array(devs, dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh: Mesh, name: str) -> int:
    """Size of ``name`` in ``mesh`` (1 if the mesh lacks that axis)."""
    return int(mesh.shape.get(name, 1))
