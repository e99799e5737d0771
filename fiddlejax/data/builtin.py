"""Data that ships with every machine, served through grain (``fiddlejax.data`` re-exports it).

- ``stdlib_corpus``: a byte-level text corpus made of the Python standard library's own source
  files (tests excluded), split into train/validation by file with a stable hash, so the split
  never depends on file order or the machine.
- ``digits``: 8x8 grey images of the digits 0-9: scikit-learn's bundled set when installed
  (``pip install fiddlejax[digits]``), otherwise generated glyphs with noise and jitter.
- ``random_tokens``: synthetic tokens for tests.

Pipelines are grain ``MapDataset``s: deterministic for a seed, sharded per process (each process
reads only the rows of its own devices), and their iterators are checkpointable
(``get_state`` / ``set_state``).
"""

from __future__ import annotations

import functools
import os
import sysconfig
import zlib
from collections.abc import Callable
from pathlib import Path

import grain
import numpy as np

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (tests excluded), sorted by relative path."""
    return list(_stdlib_files())


@functools.cache
def _stdlib_files() -> tuple[Path, ...]:
    # A walk that never enters the skipped folders: site-packages alone can hold tens of
    # thousands of files, and listing them was most of a job's start on the bundled corpus.
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def _is_validation(relpath: str, every: int) -> bool:
    return zlib.crc32(relpath.encode()) % every == 0


def stdlib_corpus(split: str = "train", *, validation_every: int = 20,
                  max_bytes: int | None = None) -> np.ndarray:
    """The corpus as a ``uint8`` array: files joined by NUL bytes, split by file name hash.

    About 1 in ``validation_every`` files goes to ``"validation"``. ``max_bytes`` keeps a prefix.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r} must be 'train' or 'validation'")
    root = Path(sysconfig.get_paths()["stdlib"])
    want_val = split == "validation"
    parts, total = [], 0
    for p in stdlib_files():
        if _is_validation(p.relative_to(root).as_posix(), validation_every) != want_val:
            continue
        data = p.read_bytes() + b"\0"
        parts.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(parts), dtype=np.uint8)
    return corpus[:max_bytes] if max_bytes is not None else corpus


class Windows(grain.sources.RandomAccessDataSource):
    """Non-overlapping windows of ``length`` tokens over a 1-D token array."""

    def __init__(self, tokens: np.ndarray, length: int):
        if len(tokens) < length:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one window "
                             f"({length}); use a shorter seq_len")
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return len(self.tokens) // self.length

    def __getitem__(self, i: int) -> np.ndarray:
        s = int(i) * self.length
        return self.tokens[s:s + self.length].astype(np.int32)


def check_tokens(tokens: np.ndarray, vocab_size: int, source: str = "the corpus",
                 fix: str = "use a vocab_size of at least {need}") -> None:
    """Raise if any id of ``tokens`` is outside ``[0, vocab_size)``: once per source, because
    an out-of-range id does not fail in the model, it silently makes the loss NaN.

    ``fix`` ends the message; each ``{need}`` in it becomes the smallest vocabulary that fits. The
    caller knows which setting decides the vocabulary (a job's ``model.vocab_size``, or a
    pretrained checkpoint's), so it says what to change."""
    if len(tokens) == 0:
        return
    lo, hi = int(np.min(tokens)), int(np.max(tokens))
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise ValueError(f"{source} holds token id {bad} but the vocabulary is [0, {vocab_size})"
                         f"; {fix.replace('{need}', str(hi + 1))}")


def token_batches(tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int = 0,
                  shuffle: bool = True, repeat: bool = True, process_index: int = 0,
                  process_count: int = 1, vocab_size: int | None = None) -> grain.IterDataset:
    """Batches ``{"tokens": int32[batch_size / process_count, seq_len + 1]}`` for this process.

    ``batch_size`` is global; each process gets its contiguous share of every global batch, the
    rows its own devices hold when the batch is sharded over ``data``. With ``vocab_size`` every
    id of ``tokens`` is checked to be below it, once, here.
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len),
                    ("process_count", process_count)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if vocab_size is not None:
        check_tokens(tokens, vocab_size)
    if batch_size % process_count:
        raise ValueError(f"batch_size={batch_size} must divide evenly over "
                         f"{process_count} processes")
    ds = grain.MapDataset.source(Windows(tokens, seq_len + 1))
    return _batched(ds, batch_size, lambda x: {"tokens": x}, seed, shuffle, repeat,
                    process_index, process_count)


def _batched(ds: grain.MapDataset, batch_size: int, to_dict: Callable, seed: int, shuffle: bool,
             repeat: bool, process_index: int, process_count: int) -> grain.IterDataset:
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat()
    ds = ds.batch(batch_size, drop_remainder=True)
    local = batch_size // process_count
    lo = process_index * local
    ds = ds.map(lambda b: to_dict(b[lo:lo + local]) if not isinstance(b, dict)
                else {k: v[lo:lo + local] for k, v in b.items()})
    return ds.to_iter_dataset()


def random_tokens(key: int, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """Synthetic ``{"tokens": int32[batch_size, seq_len + 1]}`` uniform over the vocabulary."""
    rng = np.random.default_rng(key)
    return {"tokens": rng.integers(0, vocab_size, (batch_size, seq_len + 1), dtype=np.int32)}


# -- images ------------------------------------------------------------------------------------

_GLYPHS = [
    "01110 10001 10011 10101 11001 10001 01110",
    "00100 01100 00100 00100 00100 00100 01110",
    "01110 10001 00001 00010 00100 01000 11111",
    "11111 00010 00100 00010 00001 10001 01110",
    "00010 00110 01010 10010 11111 00010 00010",
    "11111 10000 11110 00001 00001 10001 01110",
    "00110 01000 10000 11110 10001 10001 01110",
    "11111 00001 00010 00100 01000 01000 01000",
    "01110 10001 10001 01110 10001 10001 01110",
    "01110 10001 10001 01111 00001 00010 01100",
]


def generated_digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 8x8 images of 5x7 digit glyphs, randomly shifted, scaled and noised, with labels."""
    rng = np.random.default_rng(seed)
    glyphs = np.array([[[c == "1" for c in row] for row in g.split()] for g in _GLYPHS],
                      dtype=np.float32)
    labels = rng.integers(0, 10, n)
    images = np.zeros((n, 8, 8), np.float32)
    dy, dx = rng.integers(0, 2, n), rng.integers(0, 4, n)
    for i in range(n):
        images[i, dy[i]:dy[i] + 7, dx[i]:dx[i] + 5] = glyphs[labels[i]]
    images *= rng.uniform(0.6, 1.0, (n, 1, 1))
    images += rng.normal(0.0, 0.15, images.shape)
    return np.clip(images, 0, 1)[..., None].astype(np.float32), labels.astype(np.int32)


def digits(split: str = "train", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(images float32[N, 8, 8, 1] in [0, 1], labels int32[N])``; 1 in 5 held out."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        images = (d.images / 16.0).astype(np.float32)[..., None]
        labels = d.target.astype(np.int32)
    except ImportError:
        images, labels = generated_digits(2000, seed=1234)
    val = np.arange(len(labels)) % 5 == 0
    keep = val if split == "validation" else ~val
    return images[keep], labels[keep]


def image_batches(images: np.ndarray, labels: np.ndarray, batch_size: int, *, seed: int = 0,
                  shuffle: bool = True, repeat: bool = True, process_index: int = 0,
                  process_count: int = 1) -> grain.IterDataset:
    """Batches ``{"images": float32[b, H, W, C], "labels": int32[b]}`` for this process."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) \
            or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    src = [(images[i], labels[i]) for i in range(len(labels))]
    ds = grain.MapDataset.source(src).map(lambda r: {"images": r[0], "labels": r[1]})
    return _batched(ds, batch_size, dict, seed, shuffle, repeat, process_index, process_count)
