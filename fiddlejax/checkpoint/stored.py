"""One saved array still on disk, read a part at a time: what a one-process export holds.

Orbax restores whole arrays; a stacked leaf (every layer of one matrix: 80 x 8192 x 28672 in
Llama-3-70B, 75 GB in float32) would be held whole while its layers are written one by one.
Indexing a :class:`StoredArray` reads only that part, through the TensorStore spec Orbax itself
reads with (``ocp.type_handlers.get_json_tspec_read``). The save's fingerprint
(:func:`fiddlejax.checkpoint.manifest._fingerprint`, a position-weighted sum mod 2**32) is a
sum over elements, so the parts' sums, each at its offset, add up to it: once every part has
been read, the array is checked as a whole restore checks it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fiddlejax.checkpoint import manifest

_CHUNK = 1 << 22  # elements per fingerprint block: bounds its temporaries (~50 MB)


def fingerprint_part(part: np.ndarray, offset: int) -> int:
    """The fingerprint's sum over ``part``, whose first element is at flat position
    ``offset`` of its array (mod 2**32; the parts of an array add up to its fingerprint)."""
    flat = np.ascontiguousarray(part).reshape(-1)
    if flat.dtype == np.bool_:
        bits = flat.astype(np.uint32)
    else:
        bits = flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[flat.dtype.itemsize])
    total = np.uint32(0)
    for start in range(0, flat.size, _CHUNK):
        b = bits[start:start + _CHUNK].astype(np.uint32)
        index = ((np.arange(b.size, dtype=np.uint64) + (offset + start)) % 2**32).astype(np.uint32)
        weights = (index * np.uint32(2654435761) + np.uint32(1)) | np.uint32(1)
        total = np.uint32(total + np.sum(b * weights, dtype=np.uint32))
    return int(total)


class StoredArray:
    """Array ``name`` of a saved tree in ``directory`` (an Orbax PyTree item's directory):
    ``x[i]`` reads part ``i`` along the first axis, ``np.asarray(x)`` all of it. Each part's
    fingerprint is added once; after the last, the sum must equal ``fingerprint`` (the
    save's), else ValueError naming the array. ``where``: how errors name the checkpoint."""

    def __init__(self, directory: Path, name: str, shape: tuple[int, ...], dtype,
                 fingerprint: int, where: str):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim = len(self.shape)
        self._directory, self._name, self._where = Path(directory), name, where
        self._want, self._sum, self._seen = fingerprint, 0, set()
        self._store = None
        self._block: tuple[range, np.ndarray] | None = None

    @property
    def verified(self) -> bool:
        return len(self._seen) == (self.shape[0] if self.shape else 1)

    def _open(self):
        if self._store is None:
            import orbax.checkpoint as ocp
            import tensorstore as ts
            from etils import epath

            context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 0}})
            info = ocp.type_handlers.ParamInfo(
                name=self._name, parent_dir=epath.Path(self._directory),
                is_ocdbt_checkpoint=True, use_zarr3=False, ts_context=context)
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
            self._store = self._named(lambda: ts.open(spec, context=context, open=True).result())
        return self._store

    def _named(self, read):
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - TensorStore's errors, named for a user
            raise ValueError(f"{self._where} is truncated or corrupted: {self._name} cannot be "
                             f"read ({manifest.io_cause(e)})") from e

    def _read(self, index) -> np.ndarray:
        store = self._open()
        return self._named(lambda: np.asarray(store[index].read().result()))

    def _count(self, parts: range, sum_: int) -> None:
        """Add ``sum_``, the fingerprint sum of ``parts`` (first-axis indices) read together."""
        if not set(parts) <= self._seen:
            if self._seen & set(parts):  # a whole read after some parts: count it alone
                self._seen, self._sum = set(), 0
            self._seen.update(parts)
            self._sum = (self._sum + sum_) % 2**32
        if self.verified and self._sum != self._want:
            raise ValueError(f"{self._where} is corrupted: {self._name} does not match the "
                             f"fingerprint recorded when it was saved ({self._sum} != "
                             f"{self._want})")

    def __getitem__(self, i) -> np.ndarray:
        if not isinstance(i, int | np.integer) or not self.shape:
            return np.asarray(self)[i]
        i = int(i) % self.shape[0]
        if self._block is None or i not in self._block[0]:
            # the stored chunks' rows around i, read once (one row for a checkpoint saved
            # with save_args; an older one's chunk may hold several layers)
            k = max(1, int(self._open().chunk_layout.read_chunk.shape[0] or 1))
            rows = range(i - i % k, min(i - i % k + k, self.shape[0]))
            self._block = None  # one block held at a time
            self._block = (rows, self._read(slice(rows.start, rows.stop)))
        rows, block = self._block
        row = int(np.prod(self.shape[1:], dtype=np.int64))
        if i not in self._seen:
            self._count(range(i, i + 1), fingerprint_part(block[i - rows.start], i * row))
        return block[i - rows.start]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._read(())
        self._count(range(self.shape[0] if self.shape else 1), fingerprint_part(whole, 0))
        return whole if dtype is None else whole.astype(dtype)

    def check(self) -> None:
        """Read the parts not read yet (their fingerprints): every array an export reads ends
        checked whole, even one whose every part was not written."""
        for i in range(self.shape[0] if self.shape else 0):
            if i not in self._seen:
                self[i]
        if not self.shape and not self.verified:
            np.asarray(self)


CHUNK_BYTES = 64 << 20  # a stacked leaf's storage chunks: one layer, at most this many bytes


def save_args(paths: list[tuple[str, ...]], leaves: list, staged):
    """Orbax ``SaveArgs`` per leaf: a stacked leaf (the ``staged`` model's stack in its path,
    its layers along the first axis) is stored in chunks of one layer (split further past
    :data:`CHUNK_BYTES`), so reading a layer reads only that layer's chunks (Orbax would
    store a device's shard as one chunk, every layer in it, or split its largest axis
    first); the rest as Orbax stores them."""
    import orbax.checkpoint as ocp

    stack, layers = getattr(staged, "stack", None), getattr(staged, "num_layers", 0)

    def one(path, x):
        if stack in path and x.ndim >= 2 and x.shape[0] == layers:
            return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=(0,))
        return ocp.SaveArgs()

    return [one(p, x) for p, x in zip(paths, leaves)]


def snapshot_bound(gb: float | None, trainer) -> float | None:
    """Orbax's ``save_device_host_concurrent_gb`` for a save that holds at most ``gb`` GB of
    snapshot on the host at once (None: the whole state at once, the quickest async save).

    Orbax moves whole arrays and refuses one above the bound, so the bound is at least the
    largest array of the state (its global bytes: no process holds more of it)."""
    if gb is None:
        return None
    if not (isinstance(gb, (int, float)) and not isinstance(gb, bool) and gb > 0):
        raise ValueError(f"snapshot_gb={gb!r} must be a positive number of GB (or None: the "
                         "whole state's snapshot at once)")
    import jax

    state = trainer.abstract_state()
    largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return max(float(gb), (largest + 1) / 1e9)


def snapshot_limits(gb: float | None, trainer) -> dict:
    """Orbax's handler limits for ``snapshot_gb`` (:func:`snapshot_bound`; {} for None): the
    device-to-host snapshot and the write path both held to the bound. Bounding only the
    snapshot let tensorstore's writes gather 2.8x the bf16 checkpoint's bytes above the state
    in the fine-tune job's final save (a 14-layer Llama, RSS sampled every 20 ms), more than
    the step itself held."""
    bound = snapshot_bound(gb, trainer)
    return {} if bound is None else {"save_device_host_concurrent_gb": bound,
                                     "save_concurrent_gb": bound}
