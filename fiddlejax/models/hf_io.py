"""Hugging Face safetensors read by slices and written tensor by tensor: checkpoints at real size.

Reading (:func:`sources`, :func:`leaf_array`): every leaf of the parameters is assembled for its
target sharding from one array per device of this process, each read from the files with only
the rows and columns that device holds (``safe_open(...).get_slice``),
layer by layer, cast to the target dtype on the way. There is no dictionary of the whole
checkpoint and no float32 copy of it: a process holds its shards plus the slice in flight. A
file is opened per read, so the memory-mapped pages a read touched leave the resident set with
it. Converting a tensor is a transpose of its last two axes and a reshape that splits axes
(heads out of ``h * dh``), so a slice of ours is a slice of theirs: the read is exact.

Writing (:func:`write`): the tensors' names and shapes are planned first (the shard files'
names need their count, a file's safetensors header its tensors' byte ranges), then each
tensor is produced in turn and appended to its file: host memory is about one tensor. The
header is safetensors' documented layout (8-byte length, JSON, data in order); the library
itself writes only whole dictionaries.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
Index = tuple[slice, ...]
CHUNK = 1 << 22  # elements read and cast at once: the bf16 in flight is at most 8 MB


# -- tensors to read ---------------------------------------------------------------------------
class Stored:
    """One tensor of a safetensors file, read by slices; the file is opened per read."""

    def __init__(self, path: Path, name: str, shape: tuple[int, ...]):
        self.path, self.name, self.shape = path, name, shape

    def read(self, index: Index) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="numpy") as f:
            block = np.array(f.get_slice(self.name)[index])  # a copy, never the mapped pages
        # checked as read (a few MB at a time): a NaN weight would train on NaN losses
        if block.dtype.kind in "fcV" and not np.isfinite(block).all():
            raise ValueError(f"{where(self)} holds NaN or infinite values; restore or "
                             "re-download it (a model trained on it is NaN)")
        return block


def where(src) -> str:
    """A source, as a message names it: its tensor and file."""
    if isinstance(src, Part):
        return f"a part of {where(src.base)}"
    if isinstance(src, Stored):
        return f"{src.name} in {src.path}"
    return "an in-memory tensor"


class InMemory:
    """An array already in memory, read like a stored tensor."""

    def __init__(self, array):
        self.array, self.shape = array, tuple(np.shape(array))

    def read(self, index: Index) -> np.ndarray:
        return np.asarray(self.array[index])


class Part:
    """A block of another tensor, ``base[*lead, start:start + shape[0], ...]``: Phi-3's fused
    projections, transformers' fused experts."""

    def __init__(self, base, lead: tuple[int, ...], start: int, shape: tuple[int, ...]):
        self.base, self.lead, self.start, self.shape = base, lead, start, tuple(shape)

    def read(self, index: Index) -> np.ndarray:
        first, *rest = index
        s = slice(self.start + first.start, self.start + first.stop)
        return self.base.read((*(slice(i, i + 1) for i in self.lead), s, *rest)).reshape(
            [x.stop - x.start for x in index])


def files(directory: Path) -> list[str]:
    """The safetensors files of a directory: one, or the shards its index lists."""
    if (directory / INDEX).is_file():
        return sorted(set(json.loads((directory / INDEX).read_text())["weight_map"].values()))
    if (directory / SINGLE).is_file():
        return [SINGLE]
    raise FileNotFoundError(f"{directory} has neither {SINGLE} nor {INDEX}; pytorch_model.bin "
                            "checkpoints need converting to safetensors first")


def sources(directory: Path) -> dict[str, Stored]:
    """Every tensor of a directory by name, from the files' headers (no data read)."""
    from safetensors import safe_open

    out = {}
    for name in files(directory):
        with safe_open(str(directory / name), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                out[key] = Stored(directory / name, key, tuple(f.get_slice(key).get_shape()))
    return out


# -- ours from theirs, by slices ---------------------------------------------------------------
def _groups(theirs: list[int], ours: tuple[int, ...]) -> list[list[int]] | None:
    """Which of our axes each of their axes splits into (None: not a split of theirs)."""
    groups, j = [], 0
    for n in theirs:
        group, size = [], 1
        while j < len(ours) and (size < n or not group):
            size, group = size * ours[j], [*group, j]
            j += 1
        if size != n:
            return None
        groups.append(group)
    if len(ours) - j and math.prod(ours[j:]) == 1 and groups:
        groups[-1] += list(range(j, len(ours)))  # trailing size-1 axes
    elif j != len(ours):
        return None
    return groups


def matches(src, tr: bool, ours: tuple[int, ...]) -> bool:
    """Whether ``src`` (transposed if ``tr``) reshapes to ``ours`` by splitting axes."""
    t = list(src.shape)
    if tr:
        t[-2:] = t[-1], t[-2]
    return _groups(t, tuple(ours)) is not None


def read(src, tr: bool, ours: tuple[int, ...], index: Index) -> np.ndarray:
    """``src`` with its last two axes swapped (if ``tr``) and reshaped to ``ours``, at
    ``index`` (slices of ``ours``), reading only the block of ``src`` it needs."""
    t = list(src.shape)
    if tr:
        t[-2:] = t[-1], t[-2]
    groups = _groups(t, ours)
    region, dims, post = [], [], list(index)
    for n, group in zip(t, groups):
        inner = math.prod(ours[a] for a in group[1:])
        first = index[group[0]]
        if all(index[a] == slice(0, ours[a]) for a in group[1:]):  # a block of theirs
            region.append(slice(first.start * inner, first.stop * inner))
            dims += [first.stop - first.start, *(ours[a] for a in group[1:])]
            for a in group:
                post[a] = slice(None)
        else:  # a strided part: read the axis whole, slice after the reshape
            region.append(slice(0, n))
            dims += [ours[a] for a in group]
    if tr:
        region[-2:] = region[-1], region[-2]
    block = src.read(tuple(region))
    if tr:
        block = np.swapaxes(block, -1, -2)
    return block.reshape(dims)[tuple(post)]


def leaf_reader(layers: list, tr: bool, shape: tuple[int, ...], stacked: bool, experts: bool
                ) -> Callable[[Index], Iterable[tuple[tuple[int, ...], np.ndarray]]]:
    """A function of an index of one leaf of ours giving its pieces ``(start, block)``, a few
    MB each (``start``: where the block goes in the index's block): ``layers`` is one source
    (not ``stacked``), or one per layer, or (``experts``) one list of sources per layer."""
    inner = shape[(1 + experts) if stacked else 0:]

    def rows(src, index: Index, lead: tuple[int, ...]):
        # along their rows: a transposed matrix's are our columns (a band of our rows would
        # touch every page of their tensor)
        axis = len(index) - 1 if tr and len(index) == 2 else 0
        along = index[axis]
        other = math.prod(s.stop - s.start for i, s in enumerate(index) if i != axis)
        step = max(1, CHUNK // max(other, 1))
        for a in range(along.start, along.stop, step):
            part = list(index)
            part[axis] = slice(a, min(a + step, along.stop))
            start = [0] * len(index)
            start[axis] = a - along.start
            yield (*lead, *start), read(src, tr, inner, tuple(part))

    def pieces(index: Index):
        if not stacked:
            yield from rows(layers, index, ())
            return
        for k, i in enumerate(range(index[0].start, index[0].stop)):  # one layer at a time
            if not experts:
                for start, block in rows(layers[i], index[1:], ()):
                    yield (k, *start), block[None]
                continue
            for j, x in enumerate(range(index[1].start, index[1].stop)):
                for start, block in rows(layers[i][x], index[2:], ()):
                    yield (k, j, *start), block[None, None]

    return pieces


@functools.partial(jax.jit, donate_argnums=0)
def _update(buffer: jax.Array, block: jax.Array, start: tuple) -> jax.Array:
    return jax.lax.dynamic_update_slice(buffer, block.astype(buffer.dtype), start)


def _filled(shape: tuple[int, ...], pieces, dtype, device) -> jax.Array:
    """A device buffer of ``shape`` written piece by piece in place (donated): the host holds
    one piece at a time, never the whole block."""
    buffer = jnp.zeros(shape, dtype, device=device)
    for start, block in pieces:
        buffer = _update(buffer, block, tuple(np.int32(x) for x in start))
    return buffer


def leaf_array(shape: tuple[int, ...], sharding, reader, dtype) -> jax.Array:
    """The leaf as a ``jax.Array`` placed by ``sharding`` (None: the default device,
    uncommitted), each device's shard read alone, a piece at a time, cast on the device;
    devices holding the same shard share one read."""
    full = tuple(slice(0, n) for n in shape)
    if sharding is None:  # uncommitted, as jnp.asarray places it: any later jit may move it
        return _filled(tuple(shape), reader(full), dtype, None)
    arrays, done = [], {}
    for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape)) or full
        key = tuple((s.start, s.stop) for s in index)
        if key not in done:
            done[key] = _filled(tuple(s.stop - s.start for s in index), reader(index), dtype,
                                device)
            arrays.append(done[key])
        else:
            arrays.append(jax.device_put(done[key], device))
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def host(x, i: int | None = None) -> np.ndarray:
    """Layer ``i`` (or all) of a parameter as a host array: a sharded one is gathered (from
    every process when it spans several; each takes part); one still on disk reads that layer
    alone (:class:`~fiddlejax.checkpoint.stored.StoredArray`)."""
    if isinstance(x, jax.Array):
        x = x if i is None else x[i]
        if x.is_fully_addressable:
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x if i is None else x[i])


def stream(plan: list, leaf: Any) -> Any:
    """(name, array) for each tensor of ``plan``; ``leaf(key)`` gives our leaf (kept while the
    next tensors need it, then dropped: a restore reads each leaf once)."""
    held: dict = {}
    for name, _, needs, make in plan:
        keys = {k for k, _ in needs}
        for k in [k for k in held if k not in keys]:
            del held[k]
        for k in keys - set(held):
            held[k] = leaf(k)
        yield name, make([host(held[k], i) for k, i in needs])


def np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if dtype != "float32":
        raise ValueError(f"dtype={dtype!r} must be 'float32' or 'bfloat16'")
    return np.dtype(np.float32)


# -- writing -----------------------------------------------------------------------------------
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
           "int32": "I32", "uint8": "U8", "bool": "BOOL", "float64": "F64"}


def write(directory: Path, planned: list[tuple[str, tuple[int, ...]]],
          tensors: Iterable[tuple[str, np.ndarray]], max_shard_size: int, dtype,
          writer: bool = True) -> None:
    """Write ``tensors`` (name, array; in ``planned``'s order, cast to ``dtype``) as one
    ``model.safetensors`` or shards of at most ``max_shard_size`` bytes plus an index (a
    tensor larger than the limit gets a shard of its own), as transformers writes them.
    ``planned``: every (name, shape), known before the data, so each file's safetensors
    header is written first and each tensor appended as it comes: host memory is one tensor.
    ``writer=False``: consume the tensors (a process taking part in gathers), write nothing."""
    dtype = np.dtype(dtype)
    itemsize = dtype.itemsize
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in planned:
        nbytes = math.prod(shape) * itemsize
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append((name, tuple(shape)))
        size += nbytes
    n = len(groups)
    files = [SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
             for i in range(n)]
    if writer:
        for old in directory.glob("model*.safetensors*"):  # a previous save's would mix in
            if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", old.name):
                old.unlink()  # only names this writes: model_v1.safetensors is the user's
    stream = iter(tensors)
    for group, file in zip(groups, files):
        out = open(directory / file, "wb") if writer else None  # noqa: SIM115 - closed below
        try:
            if out is not None:
                out.write(_header(group, dtype))
            for want, shape in group:
                name, array = next(stream)
                if name != want or tuple(np.shape(array)) != shape:
                    raise ValueError(f"tensor {name} {np.shape(array)} came where {want} "
                                     f"{shape} was planned")
                if out is not None:
                    out.write(np.ascontiguousarray(np.asarray(array).astype(dtype, copy=False))
                              .tobytes())
                del array
        finally:
            if out is not None:
                out.close()
    if writer and n > 1:
        total = sum(math.prod(s) for _, s in planned) * itemsize
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: f for g, f in zip(groups, files) for k, _ in g}}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _header(group: list[tuple[str, tuple[int, ...]]], dtype: np.dtype) -> bytes:
    """A safetensors header: its length (8 bytes, little-endian), then JSON padded to 8
    bytes naming each tensor's dtype, shape and byte range, in order."""
    meta: dict = {"__metadata__": {"format": "pt"}}  # transformers refuses files without it
    offset = 0
    for name, shape in group:
        n = math.prod(shape) * dtype.itemsize
        meta[name] = {"dtype": _DTYPES[dtype.name], "shape": list(shape),
                      "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
