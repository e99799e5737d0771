"""The prepared corpus: a memory-mapped token store, read in constant time and memory.

The format is Megatron-LM's indexed dataset, one per split: the documents' tokens back to back
(``[BOS] ids EOS``, uint16 or uint32) in ``.bin`` files, and an index of where each document
ends (int64). numpy memory-maps both, so opening a store reads only its small ``meta.json``,
and a row reads its own tokens and a binary search of the index, never the corpus. Rows are
cut at read time (``model.seq_len`` is not part of the store):

- packed, row ``i`` is tokens ``[i L, (i + 1) L)`` of the split, its ``segment_ids`` number
  the documents it touches from 1 (exactly :func:`.packing.pack_rows` over the corpus);
- unpacked, a row table (``rows-L.npy``, made once per length) lists each document's chunks.

A store directory::

    meta.json                          counts, token dtype, ids' range, content hash, settings
    train.idx.npy  validation.idx.npy  each document's end offset in its split (int64)
    train.shards.npy ...               each piece's end offset in its split (int64)
    pieces/00000/train.bin ...         the tokens, one file per piece of the sources
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np

from fiddlejax.data import packing

SPLITS = ("train", "validation")
VERSION = 1


class Split:
    """One split's token stream: ``tokens(lo, hi)`` across its piece files, and its documents'
    end offsets, all memory-mapped (files open on first use); chat data has a loss mask beside
    the tokens (``mask(lo, hi)``: 1 where a token is the assistant's)."""

    def __init__(self, root: Path, name: str, dtype: np.dtype, masked: bool = False):
        self.root, self.name, self.dtype, self.masked = root, name, dtype, masked
        self.ends = np.load(root / f"{name}.idx.npy", mmap_mode="r")
        self.shard_ends = np.load(root / f"{name}.shards.npy")
        self.n_tokens = int(self.shard_ends[-1]) if len(self.shard_ends) else 0
        self._maps: dict[int, np.ndarray] = {}

    def _shard(self, i: int, what: str = "bin") -> np.ndarray:
        if (i, what) not in self._maps:
            path = self.root / "pieces" / f"{i:05d}" / f"{self.name}.{what}"
            self._maps[i, what] = np.memmap(path, dtype=self.dtype if what == "bin" else
                                            np.uint8, mode="r") if path.stat().st_size else \
                np.zeros(0, np.uint8)
        return self._maps[i, what]

    def mask(self, lo: int, hi: int) -> np.ndarray:
        """The loss mask of tokens ``[lo, hi)`` as int32."""
        return self.tokens(lo, hi, "mask.bin")

    def tokens(self, lo: int, hi: int, what: str = "bin") -> np.ndarray:
        """Tokens ``[lo, hi)`` of the split as int32 (a copy of just those)."""
        out = np.empty(hi - lo, np.int32)
        i = int(np.searchsorted(self.shard_ends, lo, side="right"))
        pos = lo
        while pos < hi:
            start = int(self.shard_ends[i - 1]) if i else 0
            end = min(hi, int(self.shard_ends[i]))
            if end > pos:
                out[pos - lo:end - lo] = self._shard(i, what)[pos - start:end - start]
                pos = end
            i += 1
        return out


class Rows:
    """Rows of ``length`` tokens of a :class:`Split` (``[lo, hi)`` of them: a view for the
    validation rows a too small corpus takes from its training rows)."""

    def __init__(self, split: Split, length: int, pack: bool, lo: int = 0,
                 hi: int | None = None):
        self.split, self.length, self.pack = split, length, pack
        self.table = None if pack else _row_table(split, length)
        total = split.n_tokens // length if pack else len(self.table)
        self.lo, self.hi = lo, total if hi is None else hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def view(self, lo: int, hi: int) -> Rows:
        """Rows ``[lo, hi)`` of these."""
        out = copy.copy(self)
        out.lo, out.hi = self.lo + lo, self.lo + hi
        return out

    def __getitem__(self, i: int) -> dict:
        i, n = self.lo + int(i), self.length
        if self.pack:
            toks = self.split.tokens(i * n, (i + 1) * n)
            doc = np.searchsorted(self.split.ends, np.arange(i * n, (i + 1) * n), side="right")
            seg = (doc - doc[0] + 1).astype(np.int32)
            row = {"tokens": toks, "segment_ids": seg,
                   "positions": packing._positions(seg[None])[0]}
            if self.split.masked:
                row["loss_mask"] = self.split.mask(i * n, (i + 1) * n)
            return row
        start, size = (int(x) for x in self.table[i])
        toks = np.zeros(n, np.int32)
        toks[:size] = self.split.tokens(start, start + size)
        seg = (np.arange(n) < size).astype(np.int32)
        row = {"tokens": toks, "segment_ids": seg,
               "positions": np.where(seg > 0, np.arange(n), 0).astype(np.int32)}
        if self.split.masked:
            row["loss_mask"] = np.zeros(n, np.int32)
            row["loss_mask"][:size] = self.split.mask(start, start + size)
        return row


class PreferenceRows(Rows):
    """Preference data: an example a row (:func:`.preference.row`), never packed or cut."""

    def __init__(self, split: Split, length: int, lo: int = 0, hi: int | None = None):
        from fiddlejax.data import preference

        self.split, self.length, self.pack, self.table = split, length, False, None
        self.row = preference.row
        ends = np.asarray(split.ends, np.int64)
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        longest = int((ends - self.starts).max()) if len(ends) else 0
        if longest > length:
            raise preference.DataError(
                f"the longest preference example holds {longest} tokens (prompt + chosen + "
                f"prompt + rejected), more than a row of model.seq_len + 1 = {length}; raise "
                f"model.seq_len to at least {longest - 1}, or drop the longer examples")
        self.lo, self.hi = lo, len(ends) if hi is None else hi

    def __getitem__(self, i: int) -> dict:
        i = self.lo + int(i)
        start, end = int(self.starts[i]), int(self.split.ends[i])
        return self.row(self.split.tokens(start, end), self.split.mask(start, end), self.length)


def _row_table(split: Split, length: int) -> np.ndarray:
    """``[rows, 2]`` (start, size) of each document's chunks of ``length`` (a lone last token
    has no target and is dropped): made once per length, kept in the store, memory-mapped."""
    path = split.root / f"{split.name}.rows-{length}.npy"
    if not path.is_file():
        ends = np.asarray(split.ends, np.int64)
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        lens = ends - starts
        chunks = -(-lens // length)
        first = np.repeat(starts, chunks)
        k = np.arange(len(first)) - np.repeat(np.cumsum(chunks) - chunks, chunks)
        begin = first + k * length
        size = np.minimum(length, np.repeat(ends, chunks) - begin)
        table = np.stack([begin, size], 1)[size > 1]
        _atomic_save(path, table)
    return np.load(path, mmap_mode="r")


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


class Store:
    """An opened store: its ``meta`` and a :class:`Split` per split (O(1) to open)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.meta = json.loads((self.root / "meta.json").read_text())
        dtype = np.dtype(self.meta["dtype"])
        masked = bool(self.meta.get("loss_mask"))
        self.splits = {s: Split(self.root, s, dtype, masked) for s in SPLITS}

    def rows(self, split: str, length: int, pack: bool = True) -> Rows:
        if self.meta.get("preference"):
            return PreferenceRows(self.splits[split], length)
        return Rows(self.splits[split], length, pack)


def complete(root: Path) -> bool:
    """Whether ``root`` is a finished store (``meta.json`` is written last, before the rename
    that publishes the directory)."""
    return (root / "meta.json").is_file()


def finalize(partial: Path, final: Path, infos: list[dict], meta: dict) -> None:
    """Index the finished pieces of ``partial`` (``infos``: each piece's counts), write
    ``meta.json`` and publish the directory as ``final`` with one rename."""
    for s in SPLITS:
        counts = [i["splits"][s]["docs"] for i in infos]
        ends = np.lib.format.open_memmap(partial / f"{s}.idx.npy", "w+", np.int64,
                                         (sum(counts),))
        at, offset = 0, 0
        for k, n in enumerate(counts):
            if n:
                lens = np.load(partial / "pieces" / f"{k:05d}" / f"{s}.len.npy")
                ends[at:at + n] = np.cumsum(lens) + offset
                offset, at = int(ends[at + n - 1]), at + n
        ends.flush()
        del ends
        tokens = np.cumsum([i["splits"][s]["tokens"] for i in infos], dtype=np.int64)
        np.save(partial / f"{s}.shards.npy", tokens)
    for tmp in (partial / "pieces").glob("*.tmp*"):  # a crashed run's leftovers
        shutil.rmtree(tmp, ignore_errors=True)
    tmp = partial / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, partial / "meta.json")
    try:
        os.rename(partial, final)
    except OSError:
        if not complete(final):  # another process of the job published the same store first
            raise
        shutil.rmtree(partial, ignore_errors=True)
