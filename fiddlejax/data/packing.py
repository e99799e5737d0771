"""Documents into rows of ``length`` tokens, with ``segment_ids`` and ``positions``.

``pack_rows(..., pack=True)`` concatenates the documents (each ending in EOS) and cuts the
stream into rows: ``segment_ids`` number the documents of a row from 1, ``positions`` count
from 0 at each document's start and at each row's start (a document cut by a row boundary
continues in the next row from position 0). ``pack=False`` gives each document rows of its own,
padded with segment 0. A model attends only within a segment; the loss counts a target only
when it continues its input's document (:func:`loss_mask`), so the token after an EOS, which
begins another document, and the padding are never targets.

Rows carry ``length = seq_len + 1`` tokens, like ``tokens``: inputs are ``[:, :-1]``, targets
``[:, 1:]``.

Chat data (:mod:`.chat`) gives each document a mask too, 1 on the assistant's tokens: packed
alongside as ``loss_mask`` (int32, like ``tokens``; 0 on padding), a batch key the loss reads
(a target counts only where ``loss_mask[:, 1:]`` is 1 as well), so it is split, microbatched
and laid out like every other key of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def with_specials(ids: np.ndarray, eos_id: int, bos_id: int | None = None) -> np.ndarray:
    """A document's ids as they are packed: ``[BOS] ids EOS``."""
    parts = ([np.asarray([bos_id], np.int32)] if bos_id is not None else [])
    return np.concatenate([*parts, np.asarray(ids, np.int32), np.asarray([eos_id], np.int32)])


def _positions(segments: np.ndarray) -> np.ndarray:
    """Position of each column within its segment (restarting at each row's start)."""
    cols = np.broadcast_to(np.arange(segments.shape[1]), segments.shape)
    starts = np.ones(segments.shape, bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return (cols - np.maximum.accumulate(np.where(starts, cols, 0), axis=1)).astype(np.int32)


def pack_rows(docs: Sequence[np.ndarray], length: int, *, pack: bool = True,
              masks: Sequence[np.ndarray] | None = None) -> dict:
    """``{"tokens", "segment_ids", "positions"}``, each int32 ``[rows, length]``, and
    ``loss_mask`` when ``masks`` (one per document, its length) are given.

    Packed, the tail that does not fill a row is dropped; unpacked, each document fills
    ``ceil(len / length)`` rows, the last one padded (token 0, segment 0, position 0).
    """
    if masks is not None:
        if len(masks) != len(docs) or any(len(m) != len(d) for m, d in zip(masks, docs)):
            raise ValueError("pack_rows: give one mask per document, as long as it")
        keep = [i for i, d in enumerate(docs) if len(d)]
        rows = pack_rows([docs[i] for i in keep], length, pack=pack)
        # the masks ride through the same cut as tokens: pack them as if they were ids
        tagged = pack_rows([np.asarray(masks[i], np.int32) for i in keep], length, pack=pack)
        return {**rows, "loss_mask": np.where(rows["segment_ids"] > 0, tagged["tokens"], 0)}
    if length < 2:
        raise ValueError(f"rows of length {length} hold no target; use seq_len >= 1")
    docs = [np.asarray(d, np.int32) for d in docs if len(d)]
    if not docs:
        return {k: np.zeros((0, length), np.int32) for k in ("tokens", "segment_ids",
                                                            "positions")}
    if not pack:
        return _padded_rows(docs, length)
    lens = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    n = int(lens.sum()) // length * length
    stream = np.concatenate(docs)[:n]
    doc = np.repeat(np.arange(len(docs), dtype=np.int64), lens)[:n].reshape(-1, length)
    segments = (doc - doc[:, :1] + 1).astype(np.int32)
    return {"tokens": stream.reshape(-1, length), "segment_ids": segments,
            "positions": _positions(segments)}


def _padded_rows(docs: list[np.ndarray], length: int) -> dict:
    chunks = [d[i:i + length] for d in docs for i in range(0, len(d), length)
              if len(d[i:i + length]) > 1]  # a lone token has no target
    tokens = np.zeros((len(chunks), length), np.int32)
    segments = np.zeros((len(chunks), length), np.int32)
    for r, c in enumerate(chunks):
        tokens[r, :len(c)] = c
        segments[r, :len(c)] = 1
    positions = np.where(segments > 0, np.arange(length, dtype=np.int32), 0).astype(np.int32)
    return {"tokens": tokens, "segment_ids": segments, "positions": positions}


def loss_mask(segment_ids: np.ndarray) -> np.ndarray:
    """Which targets ``[:, 1:]`` count: the target continues its input's (non-padding)
    segment. numpy or jax arrays alike."""
    return (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
