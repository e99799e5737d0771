"""The job's language-model batches over the user's data (``data.path`` / ``data.mixture``).

Documents are read (:mod:`.sources`), split into train and validation by a hash of each
document (``data.val_fraction``; or all of ``data.val_path`` is validation), tokenized in grain
worker processes (``data.workers``; 0 tokenizes in this process, in the tokenizer's threads),
packed into rows (:mod:`.packing`), and served by grain: each component shuffled by
``data.seed`` and repeated, components mixed by weight (``MapDataset.mix``), batched, and each
process keeps its rows of every global batch. The stream of global batches does not depend on
the layout or the process count, so the iterator state (the index of the next batch) resumes
exactly on any of them (:class:`Stream`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Callable, Sequence

import grain
import numpy as np

from fiddlejax.data import packing, sources
from fiddlejax.data import tokenizer as tokenizers
from fiddlejax.data.sources import DataError

DEFAULT_VAL_FRACTION = 0.05  # held out when neither data.val_path nor data.val_fraction is set
IDS_LOG = "FIDDLEJAX_EXAMPLE_IDS"  # a file: the train stream appends each batch's row ids


@dataclasses.dataclass
class Corpus:
    """One component's rows (``tokens``, ``segment_ids``, ``positions``: int32
    ``[rows, seq_len + 1]``) and what a checkpoint records of its sources."""

    train: dict
    validation: dict
    fingerprint: dict


class _Encode:
    """Tokenize a chunk of documents (picklable by the tokenizer's path, for grain workers)."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok

    def __call__(self, chunk: list) -> list[np.ndarray]:
        texts = [d for d in chunk if isinstance(d, str)]
        encoded = iter(self.tok.encode_batch(texts) if texts else [])
        ids = [next(encoded) if isinstance(d, str) else d for d in chunk]
        return [packing.with_specials(i, self.tok.eos_id, self.tok.bos_id) for i in ids]


def tokenize(docs: Sequence, tok: tokenizers.Tokenizer, workers: int = 0,
             chunk: int = 64) -> list[np.ndarray]:
    """Each document as ``[BOS] ids EOS`` (token-file documents pass through as ids), in
    order; ``workers > 0`` runs the tokenizer in that many grain worker processes."""
    chunks = [list(docs[i:i + chunk]) for i in range(0, len(docs), chunk)]
    ds = grain.MapDataset.source(chunks).map(_Encode(tok)).to_iter_dataset()
    if workers > 0 and len(chunks) > 1:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; we define none
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return [ids for part in ds for ids in part]


def doc_hash(doc) -> int:
    """A stable hash of a document's content (text or ids): the validation split's key."""
    data = doc.encode("utf-8") if isinstance(doc, str) else np.asarray(doc, np.int64).tobytes()
    return zlib.crc32(data)


def split(docs: list, fraction: float) -> tuple[list, list]:
    """(train, validation): a document is held out when its hash falls in ``fraction``."""
    cut = int(round(fraction * 2 ** 32))
    val = [doc_hash(d) < cut for d in docs]
    return ([d for d, v in zip(docs, val) if not v], [d for d, v in zip(docs, val) if v])


def read(path, opts: sources.Options, key: str) -> tuple[list, dict]:
    """(documents, fingerprint) of ``path``; a :class:`DataError` when it holds none."""
    files = sources.resolve(path, key)
    docs = list(sources.documents(files, opts))
    if not docs:
        raise DataError(f"{key}={path} holds no documents")
    return docs, sources.fingerprint(files)


def stdlib_documents() -> tuple[list, dict]:
    """The bundled corpus as documents (one standard-library file each) for a tokenizer."""
    from fiddlejax.data.builtin import stdlib_files

    files = stdlib_files()
    return [p.read_text(encoding="utf-8", errors="replace") for p in files], {
        "paths": ["<stdlib>"], "sizes": [sum(p.stat().st_size for p in files)],
        "sha256": "stdlib"}


def corpus(path, dcfg: dict, tok: tokenizers.Tokenizer, seq_len: int, key: str,
           log: Callable[[str], None] = print) -> Corpus:
    """Read, split, tokenize and pack one component of ``data.path`` / ``data.mixture``."""
    opts = sources.Options(dcfg.get("field", "text"), dcfg.get("eos_id"),
                           dcfg.get("token_dtype", "uint16"))
    docs, fp = stdlib_documents() if path is None else read(path, opts, key)
    val_path, fraction = dcfg.get("val_path"), dcfg.get("val_fraction")
    if val_path is not None:
        train_docs, fraction = docs, 0.0
        val_docs, val_fp = read(val_path, opts, "data.val_path")
        fp = {**fp, "validation": val_fp}
    else:
        fraction = DEFAULT_VAL_FRACTION if fraction is None else fraction
        train_docs, val_docs = split(docs, fraction)
    workers, pack = int(dcfg.get("workers", 0)), bool(dcfg.get("pack", True))
    train_ids, val_ids = tokenize(train_docs, tok, workers), tokenize(val_docs, tok, workers)
    log(summary(f"{key}={path or '<stdlib>'}", train_ids, val_ids, tok))
    train = packing.pack_rows(train_ids, seq_len + 1, pack=pack)
    val = packing.pack_rows(val_ids, seq_len + 1, pack=pack)
    if len(val["tokens"]) == 0 and fraction > 0 and len(train["tokens"]) > 1:
        # Too few documents for a hash split (one file, say): hold out the last rows instead.
        n = max(1, int(len(train["tokens"]) * fraction))
        val = {k: v[-n:] for k, v in train.items()}
        train = {k: v[:-n] for k, v in train.items()}
        log(f"data: {key}={path} has too few documents for a split by hash; its last {n} "
            "rows are the validation set")
    if len(train["tokens"]) == 0:
        raise DataError(f"{key}={path} gives no training row of model.seq_len + 1 = "
                        f"{seq_len + 1} tokens; add data or lower model.seq_len")
    return Corpus(train, val, fp)


def summary(what: str, train: list, val: list, tok: tokenizers.Tokenizer) -> str:
    """The job's data line: documents, tokens, the split and the tokenizer."""
    n = lambda docs: sum(len(d) for d in docs)  # noqa: E731
    return (f"# data: {what}: {len(train) + len(val):,} documents ({len(train):,} train, "
            f"{len(val):,} validation), {n(train):,} + {n(val):,} tokens; tokenizer "
            f"{tok.describe()} ({tok.vocab_size:,} ids)")


class _Rows(grain.sources.RandomAccessDataSource):
    """Row ``i`` of packed rows as a dict, with its id (component * 2**32 + row)."""

    def __init__(self, rows: dict, component: int):
        self.rows, self.component = rows, component

    def __len__(self) -> int:
        return len(self.rows["tokens"])

    def __getitem__(self, i: int) -> dict:
        i = int(i)
        return {**{k: v[i] for k, v in self.rows.items()},
                "example_ids": np.int64(self.component * 2 ** 32 + i)}


def batches(parts: list[dict], weights: list[float], batch_size: int, *, seed: int,
            shuffle: bool, process_index: int, process_count: int) -> grain.IterDataset:
    """Global batches of the mixed components; this process's rows of each."""
    ds = []
    for i, rows in enumerate(parts):
        d = grain.MapDataset.source(_Rows(rows, i))
        ds.append((d.shuffle(seed=seed + i) if shuffle else d).repeat())
    mixed = ds[0] if len(ds) == 1 else grain.MapDataset.mix(ds, weights)
    local = batch_size // process_count
    lo = process_index * local
    out = mixed.batch(batch_size, drop_remainder=True)
    return out.map(lambda b: {k: v[lo:lo + local] for k, v in b.items()}).to_iter_dataset()


class Stream:
    """An iterator of batches whose state a checkpoint keeps: the grain iterator's position
    plus what the data was (sources' fingerprints, the tokenizer's hash). ``set_state`` with a
    state of other data refuses to resume, naming the old and the new, unless
    ``allow_change``. The rows' ids leave the batch here (the model never sees them); with
    ``$FIDDLEJAX_EXAMPLE_IDS`` set, process 0 appends them to that file, one line a batch."""

    def __init__(self, ds: grain.IterDataset, identity: dict, allow_change: bool = False,
                 log_ids: bool = False):
        self.ds, self.it = ds, iter(ds)
        self.identity, self.allow_change = identity, allow_change
        self.ids_log = os.environ.get(IDS_LOG) if log_ids else None
        self.last_ids: list[int] = []

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.it)
        self.last_ids = [int(i) for i in batch.pop("example_ids")]
        if self.ids_log:
            with open(self.ids_log, "a") as f:
                f.write(json.dumps(self.last_ids) + "\n")
        return batch

    def get_state(self) -> dict:
        return {"iterator": self.it.get_state(), **self.identity}

    def set_state(self, state: dict) -> None:
        if not (isinstance(state, dict) and "iterator" in state):
            # a checkpoint of the bundled corpus in byte windows: other data altogether
            check_same_data({"sources": "the bundled stdlib corpus (byte windows)"},
                            self.identity, self.allow_change)
            return  # its position means nothing here: data.allow_change starts this stream
        check_same_data(state, self.identity, self.allow_change)
        self.it.set_state(state["iterator"])


def check_same_data(old: dict, new: dict, allow_change: bool) -> None:
    """Refuse to resume on other data or another tokenizer than the checkpoint's."""
    for key, what in (("sources", "data"), ("tokenizer", "tokenizer")):
        a, b = old.get(key), new.get(key)
        if a is None or a == b or allow_change:
            continue
        raise DataError(
            f"the checkpoint was trained with {what} {_describe(a)} but this run has "
            f"{_describe(b)}; resuming would silently switch {what}. Use the checkpoint's "
            f"{what}, or set data.allow_change=true to continue on the new one")


def _describe(x) -> str:
    if isinstance(x, list):
        return "[" + ", ".join(_describe(c) for c in x) + "]"
    if isinstance(x, dict) and "paths" in x:
        return f"{x['paths']} (sha256 {str(x.get('sha256'))[:12]})"
    if isinstance(x, dict):
        return f"{x.get('name')} (sha256 {str(x.get('sha256'))[:12]})"
    return repr(x)


def components(dcfg: dict) -> list[tuple]:
    """``[(path, weight)]`` of ``data.mixture``, or ``[(data.path, 1.0)]``."""
    mix = dcfg.get("mixture")
    if not mix:
        return [(dcfg.get("path"), 1.0)]
    if dcfg.get("path") is not None:
        raise DataError("give data.path or data.mixture, not both; a mixture lists each path "
                        "with its weight")
    out = []
    for i, c in enumerate(mix if isinstance(mix, list) else [mix]):
        w = c.get("weight", 1.0) if isinstance(c, dict) else None
        if not isinstance(c, dict) or "path" not in c or isinstance(w, bool) \
                or not isinstance(w, int | float) or w <= 0:
            raise DataError(f"data.mixture[{i}]={c!r} must be {{path: P, weight: W}} with W > "
                            "0, e.g. data.mixture=[{path: a.jsonl, weight: 0.7}, {path: "
                            "b.jsonl, weight: 0.3}]")
        out.append((c["path"], float(w)))
    return out


def job_batches(dcfg: dict, tok: tokenizers.Tokenizer, seq_len: int, vocab: int | None,
                fix: str, process_index: int = 0, process_count: int = 1,
                log: Callable[[str], None] = print) -> tuple[Stream, grain.IterDataset]:
    """(train :class:`Stream`, validation batches) of ``data:`` for this process; every id is
    checked against the model's vocabulary ``vocab`` here (``fix`` ends that error)."""
    from fiddlejax.data.builtin import check_tokens

    parts = components(dcfg)
    many = len(parts) > 1
    corpora = [corpus(p, dcfg, tok, seq_len, f"data.mixture[{i}].path" if many else "data.path",
                      log) for i, (p, _) in enumerate(parts)]
    if vocab is not None:
        for (p, _), c in zip(parts, corpora):
            check_tokens(c.train["tokens"], vocab, f"data.path={p or '<stdlib>'}", fix)
    weights = [w for _, w in parts]
    b, seed = dcfg["batch_size"], dcfg["seed"]
    shard = {"process_index": process_index, "process_count": process_count}
    train = batches([c.train for c in corpora], weights, b, seed=seed, shuffle=True, **shard)
    vals = [c.validation for c in corpora if len(c.validation["tokens"])]
    if not vals:
        raise DataError("no validation rows: set data.val_path, or a larger data.val_fraction")
    val = batches(vals, [1.0] * len(vals), b, seed=seed, shuffle=False, **shard)
    identity = {"sources": [c.fingerprint for c in corpora],
                "tokenizer": {"name": tok.describe(), "sha256": tok.fingerprint},
                "weights": weights}
    stream = Stream(train, identity, bool(dcfg.get("allow_change")), process_index == 0)
    return stream, _Drop(iter(val))


class _Drop:
    """Validation batches without their row ids."""

    def __init__(self, it):
        self.it = it

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = dict(next(self.it))
        batch.pop("example_ids", None)
        return batch


def wanted(dcfg: dict, from_pretrained: str | None = None) -> bool:
    """Whether ``data:`` asks for this pipeline (a path, a mixture or a real tokenizer) rather
    than the bundled byte corpus in fixed windows."""
    if dcfg.get("path") is not None or dcfg.get("mixture"):
        return True
    return tokenizers.load(dcfg.get("tokenizer", "auto"), from_pretrained).kind != "bytes"
