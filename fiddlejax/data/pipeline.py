"""The job's language-model batches over the user's data (``data.path`` / ``data.mixture``).

Each component is a prepared store (:mod:`.prepare`, :mod:`.store`): made once, on the first
run (every process of the job tokenizing its share of the documents), then opened in constant
time and memory by every later run. Documents are split into train and validation by a hash
of each (``data.val_fraction``; or all of ``data.val_path`` is validation) and cut into rows
when read (packed with ``segment_ids``, or a document per row). grain serves the rows' ids:
each component shuffled by ``data.seed`` and repeated, components mixed by weight
(``MapDataset.mix``), batched; each process then reads only its rows of every global batch
from the memory-mapped store. The stream of global batches does not depend on the layout or
the process count, so the iterator state (the index of the next batch) resumes exactly on any
of them (:class:`Stream`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import grain
import numpy as np

from fiddlejax.data import packing, prepare, sources, store
from fiddlejax.data import tokenizer as tokenizers
from fiddlejax.data.prepare import DEFAULT_VAL_FRACTION, doc_hash  # noqa: F401 - public names
from fiddlejax.data.sources import DataError

IDS_LOG = "FIDDLEJAX_EXAMPLE_IDS"  # a file: the train stream appends each batch's row ids


@dataclasses.dataclass
class Corpus:
    """One component's rows (:class:`.store.Rows`: ``tokens``, ``segment_ids``,
    ``positions``, int32 ``[seq_len + 1]`` each, read on demand), what a checkpoint records of
    its sources, and the store's metadata."""

    train: store.Rows
    validation: store.Rows
    fingerprint: dict
    meta: dict = dataclasses.field(default_factory=dict)


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
    order; ``workers > 0`` runs the tokenizer in that many grain worker processes. (The job
    prepares a store instead: :mod:`.prepare`.)"""
    chunks = [list(docs[i:i + chunk]) for i in range(0, len(docs), chunk)]
    ds = grain.MapDataset.source(chunks).map(_Encode(tok)).to_iter_dataset()
    if workers > 0 and len(chunks) > 1:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; we define none
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return [ids for part in ds for ids in part]


def split(docs: list, fraction: float) -> tuple[list, list]:
    """(train, validation): a document is held out when its hash falls in ``fraction``."""
    cut = int(round(fraction * 2 ** 32))
    val = [doc_hash(d) < cut for d in docs]
    return ([d for d, v in zip(docs, val) if not v], [d for d, v in zip(docs, val) if v])


def read(path, opts: sources.Options, key: str) -> tuple[list, dict]:
    """(documents, fingerprint) of ``path`` in memory (small data and tests; the job streams
    them into a store); a :class:`DataError` when it holds none."""
    files = sources.resolve(path, key)
    docs = list(sources.documents(files, opts))
    if not docs:
        raise DataError(f"{key}={path} holds no documents")
    return docs, sources.fingerprint(files)


def prepared(path, dcfg: dict, tok: tokenizers.Tokenizer, key: str, *, rank: int = 0,
             count: int = 1, log: Callable[[str], None] = print,
             progress: Callable[[dict], None] | None = None,
             start: Callable[[int, int], None] | None = None) -> store.Store:
    """The store of one component, prepared on a cache miss (this process, ``rank`` of
    ``count``, doing its share) and opened."""
    sp = prepare.spec(path, dcfg, tok, key)
    root = prepare.cache_dir(dcfg)
    t = time.perf_counter()
    where, hit = prepare.ensure(sp, root, workers=int(dcfg.get("workers", 0)), rank=rank,
                                count=count, progress=progress, start=start)
    st = store.Store(where)
    m = st.meta
    if not m["splits"]["train"]["docs"] + m["splits"]["validation"]["docs"]:
        raise DataError(f"{key}={path} holds no documents")
    tokens, dt = m["splits"]["train"]["tokens"] + m["splits"]["validation"]["tokens"], \
        time.perf_counter() - t
    log(f"data: {key}={path if path is not None else '<stdlib>'}: "
        + (f"prepared store {where} (cache hit)" if hit else
           f"prepared {tokens:,} tokens in {dt:.1f} s ({tokens / max(dt, 1e-9):,.0f} tokens/s)"
           f" into {where}"))
    return st


def corpus(path, dcfg: dict, tok: tokenizers.Tokenizer, seq_len: int, key: str,
           log: Callable[[str], None] = print, rank: int = 0, count: int = 1) -> Corpus:
    """One component of ``data.path`` / ``data.mixture``: its prepared store's rows."""
    st = prepared(path, dcfg, tok, key, rank=rank, count=count, log=log)
    log(summary(f"{key}={path or '<stdlib>'}", st.meta, tok))
    pack = bool(dcfg.get("pack", True))
    train = st.rows("train", seq_len + 1, pack)
    val = st.rows("validation", seq_len + 1, pack)
    fraction = st.meta["fraction"]
    if len(val) == 0 and fraction > 0 and len(train) > 1:
        # Too few documents for a hash split (one file, say): hold out the last rows instead.
        n = max(1, int(len(train) * fraction))
        train, val = train.view(0, len(train) - n), train.view(len(train) - n, len(train))
        log(f"data: {key}={path} has too few documents for a split by hash; its last {n} "
            "rows are the validation set")
    if len(train) == 0:
        raise DataError(f"{key}={path} gives no training row of model.seq_len + 1 = "
                        f"{seq_len + 1} tokens; add data or lower model.seq_len")
    return Corpus(train, val, st.meta["fingerprint"], st.meta)


def summary(what: str, meta: dict, tok: tokenizers.Tokenizer) -> str:
    """The job's data line: documents, tokens, the split and the tokenizer (the store's
    counts)."""
    t, v = meta["splits"]["train"], meta["splits"]["validation"]
    chat = (f"; chat: {t.get('targets', 0):,} of the {t['tokens']:,} train tokens are the "
            "assistant's (the loss's targets)") if meta.get("loss_mask") else ""
    if meta.get("preference"):
        chat = (f"; preference (DPO): {t.get('targets', 0):,} of the {t['tokens']:,} train "
                "tokens are the chosen and rejected completions' (scored)")
    return (f"# data: {what}: {t['docs'] + v['docs']:,} documents ({t['docs']:,} train, "
            f"{v['docs']:,} validation), {t['tokens']:,} + {v['tokens']:,} tokens; tokenizer "
            f"{tok.describe()} ({tok.vocab_size:,} ids){chat}")


class _Ids(grain.sources.RandomAccessDataSource):
    """Row ``i`` of a component as its id (component * 2**32 + row): batches are made of
    ids, and each process then reads only its rows' data (:class:`ReadRows`)."""

    def __init__(self, n: int, component: int):
        self.n, self.component = n, component

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.int64:
        return np.int64(self.component * 2 ** 32 + int(i))


class ReadRows:
    """A batch of row ids into this process's rows: ``{tokens, segment_ids, positions,
    example_ids}``, read from the components' stores."""

    def __init__(self, parts: list, lo: int, hi: int):
        self.parts, self.lo, self.hi = parts, lo, hi

    def __call__(self, ids: np.ndarray) -> dict:
        ids = np.asarray(ids)[self.lo:self.hi]
        rows = [self.parts[int(i) >> 32][int(i) & 0xFFFFFFFF] for i in ids]
        return {**{k: np.stack([r[k] for r in rows]) for k in rows[0]}, "example_ids": ids}


def batches(parts: list, weights: list[float], batch_size: int, *, seed: int,
            shuffle: bool, process_index: int, process_count: int) -> grain.IterDataset:
    """Global batches of the mixed components (row sources: :class:`.store.Rows` or anything
    indexable giving row dicts); this process reads only its rows of each."""
    ds = []
    for i, rows in enumerate(parts):
        d = grain.MapDataset.source(_Ids(len(rows), i))
        ds.append((d.shuffle(seed=seed + i) if shuffle else d).repeat())
    mixed = ds[0] if len(ds) == 1 else grain.MapDataset.mix(ds, weights)
    local = batch_size // process_count
    lo = process_index * local
    out = mixed.batch(batch_size, drop_remainder=True)
    # a few batches read ahead (grain's default holds 500 of them)
    ahead = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    return out.map(ReadRows(parts, lo, lo + local)).to_iter_dataset(ahead)


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
    """Refuse to resume on other data or another tokenizer than the checkpoint's, or read
    otherwise (:data:`READING`). The most specific change is named: another ``data.field``,
    tokenizer or EOS also changes the prepared data's hash."""
    if allow_change:
        return
    _check_reading(old.get("reading"), new.get("reading"), ("field", "val_fraction"))
    _check_same(old, new, "tokenizer", "tokenizer")
    _check_reading(old.get("reading"), new.get("reading"), ("eos_id", "bos_id"))
    _check_same(old, new, "sources", "data")


def _check_same(old: dict, new: dict, key: str, what: str) -> None:
    a, b = old.get(key), new.get(key)
    if a is not None and a != b:
        raise DataError(
            f"the checkpoint was trained with {what} {_describe(a)} but this run has "
            f"{_describe(b)}; resuming would silently switch {what}. Use the checkpoint's "
            f"{what}, or set data.allow_change=true to continue on the new one")


# What else decides the tokens and rows a resumed stream gives (checked as data and tokenizer are)
READING = {"field": "data.field", "val_fraction": "data.val_fraction",
           "eos_id": "the tokenizer's EOS id (tokenizer_config.json's eos_token)",
           "bos_id": "the tokenizer's BOS id (tokenizer_config.json's bos_token)"}


def reading(dcfg: dict, tok: tokenizers.Tokenizer) -> dict:
    """The keys of :data:`READING` for this job (recorded with the stream's position)."""
    fraction = None if dcfg.get("val_path") is not None else dcfg.get("val_fraction")
    return {"field": dcfg.get("field"), "val_fraction": fraction,  # val_path: not used
            "eos_id": tok.eos_id, "bos_id": tok.bos_id}


def _check_reading(old: dict | None, new: dict | None, keys: tuple[str, ...]) -> None:
    def value(d: dict, key: str):  # data.val_fraction null means the default
        v = d.get(key)
        return DEFAULT_VAL_FRACTION if key == "val_fraction" and v is None else v

    for key in keys:
        if old and new and key in old and value(old, key) != value(new, key):
            raise DataError(
                f"the checkpoint was trained with {READING[key]}={value(old, key)!r} but this "
                f"run has {value(new, key)!r}; resuming would silently continue on other "
                "tokens or rows. Use the checkpoint's, or set data.allow_change=true to "
                "continue on the new one")


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
    if mix is None:
        return [(dcfg.get("path"), 1.0)]
    if not mix:
        raise DataError(f"data.mixture={mix!r} lists no data; give [{{path: P, weight: W}}, "
                        "...], or data.mixture=null to train on data.path")
    if dcfg.get("path") is not None:
        raise DataError("give data.path or data.mixture, not both; a mixture lists each path "
                        "with its weight")
    out = []
    for i, c in enumerate(mix if isinstance(mix, list) else [mix]):
        w = c.get("weight", 1.0) if isinstance(c, dict) else None
        if not isinstance(c, dict) or "path" not in c or isinstance(w, bool) \
                or not isinstance(w, int | float) or not 0 < w < math.inf:  # NaN, inf
            raise DataError(f"data.mixture[{i}]={c!r} must be {{path: P, weight: W}} with W > "
                            "0, e.g. data.mixture=[{path: a.jsonl, weight: 0.7}, {path: "
                            "b.jsonl, weight: 0.3}]")
        out.append((c["path"], float(w)))
    return out


def job_batches(dcfg: dict, tok: tokenizers.Tokenizer, seq_len: int, vocab: int | None,
                fix: str, process_index: int = 0, process_count: int = 1,
                log: Callable[[str], None] = print,
                build: tuple[int, int] | None = None) -> tuple[Stream, grain.IterDataset]:
    """(train :class:`Stream`, validation batches) of ``data:`` for this process; every id is
    checked against the model's vocabulary ``vocab`` here (``fix`` ends that error).
    ``build``: this process's (rank, count) among the job's processes, which share the
    preparation of a store not yet in ``data.cache_dir`` (default: the data shard's)."""
    from fiddlejax.data.builtin import check_tokens

    rank, count = build or (process_index, process_count)
    parts = components(dcfg)
    many = len(parts) > 1
    corpora = [corpus(p, dcfg, tok, seq_len, f"data.mixture[{i}].path" if many else "data.path",
                      log, rank, count) for i, (p, _) in enumerate(parts)]
    if vocab is not None:
        for (p, _), c in zip(parts, corpora):
            ids = np.array([c.meta["min_id"], c.meta["max_id"]], np.int64)
            check_tokens(ids, vocab, f"data.path={p or '<stdlib>'}", fix)
    weights = [w for _, w in parts]
    b, seed = dcfg["batch_size"], dcfg["seed"]
    shard = {"process_index": process_index, "process_count": process_count}
    train = batches([c.train for c in corpora], weights, b, seed=seed, shuffle=True, **shard)
    vals = [c.validation for c in corpora if len(c.validation)]
    if not vals:
        raise DataError("no validation rows: set data.val_path, or a larger data.val_fraction")
    val = batches(vals, [1.0] * len(vals), b, seed=seed, shuffle=False, **shard)
    identity = {"sources": [c.fingerprint for c in corpora],
                "tokenizer": {"name": tok.describe(), "sha256": tok.fingerprint},
                "weights": weights, "reading": reading(dcfg, tok)}
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
    if dcfg.get("path") is not None or dcfg.get("mixture") is not None:
        return True
    return tokenizers.load(dcfg.get("tokenizer", "auto"), from_pretrained).kind != "bytes"
