"""Which rows of each global batch this process loads, and who owns which mesh position.

Both read only the mesh's device array (each device's ``process_index``), so they work on a
fake mesh in tests and on any number of hosts.
"""

from __future__ import annotations


def data_shard(mesh, axis: str = "data", *, process_index: int | None = None) -> tuple[int, int]:
    """``(index, count)``: this process loads share ``index`` of ``count`` of each global batch.

    The share is the slice of ``axis`` that this process's devices own. Processes whose devices
    sit on the same ``data`` slice (``pipe`` or ``tensor`` spanning hosts) load the same rows.
    Pass the result as ``process_index`` / ``process_count`` to the pipelines in
    :mod:`fiddlejax.data`.
    """
    import numpy as np

    if process_index is None:
        import jax

        process_index = jax.process_index()
    me = process_index
    ax = list(mesh.axis_names).index(axis)
    size = mesh.devices.shape[ax]
    mine = sorted({idx[ax] for idx, d in np.ndenumerate(mesh.devices) if d.process_index == me})
    if not mine:
        raise ValueError(f"process {me} owns no device of the mesh; build the mesh from "
                         "jax.devices() (all processes' devices)")
    k = len(mine)
    if mine != list(range(mine[0], mine[0] + k)) or mine[0] % k or size % k:
        raise ValueError(
            f"process {me} owns {axis} slices {mine} of {size}, not one aligned contiguous "
            f"block, so its rows of a batch are not contiguous; order the mesh's devices host "
            f"by host (fj.make_mesh(..., devices=jax.devices()) does)")
    return mine[0] // k, size // k


def describe(mesh) -> str:
    """One line for logs: processes, devices, and which process owns each mesh position.

    The default order (``jax.devices()``, host-major, ``tensor`` innermost) keeps ``tensor``
    inside a host and lets ``pipe`` and then ``data`` span hosts.
    """
    import numpy as np

    owner = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    axes = " x ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.devices.shape))
    n_proc = len(set(owner.flat))
    return (f"{n_proc} processes x {mesh.devices.size // n_proc} devices; mesh {axes}; "
            f"process of each position: {owner.tolist()}")
