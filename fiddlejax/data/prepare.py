"""Preparing a corpus once: tokenized, split and written as a :mod:`.store`, shared by every run.

A component's sources are cut into pieces (:func:`.sources.pieces`); the job's processes take
contiguous shares of the pieces, and each process tokenizes its share in ``data.workers``
worker processes (0: in this process, on the tokenizer's own threads). Each piece is written
to a temporary directory and renamed into place when whole, so a crashed or interrupted
preparation keeps its finished pieces and never leaves a half-written one. Process 0 waits for
every piece, writes the index and ``meta.json``, and publishes the store with one rename; the
others wait for that. A store is found again by a key made of the sources' paths, sizes and
modification times, the tokenizer's hash and the settings that change the tokens: a second run
opens it without reading the corpus.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fiddlejax.data import chat, packing, preference, sources, store
from fiddlejax.data import tokenizer as tokenizers
from fiddlejax.data.sources import DataError

CACHE_ENV = "FIDDLEJAX_DATA_CACHE"  # the default data.cache_dir, when set
WAIT_S = 6 * 3600.0  # how long a process waits for the job's other processes' pieces
BATCH_BYTES = 1 << 20  # text tokenized per encode_batch call
DEFAULT_VAL_FRACTION = 0.05  # held out when neither data.val_path nor data.val_fraction is set
FORMATS = ("auto", "text", "chat", "preference")


def cache_dir(dcfg: dict) -> Path:
    """``data.cache_dir``; null: ``$FIDDLEJAX_DATA_CACHE``, else ``~/.cache/fiddlejax/data``."""
    d = dcfg.get("cache_dir") or os.environ.get(CACHE_ENV)
    if not d:
        d = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "fiddlejax" / "data"
    return Path(d).expanduser()


def doc_bytes(doc) -> bytes:
    """A document's content as bytes: text, ids, or a chat record (its JSON)."""
    if isinstance(doc, dict):
        return json.dumps(doc, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return doc.encode("utf-8") if isinstance(doc, str) else np.asarray(doc, "<i8").tobytes()


def doc_hash(doc) -> int:
    """A stable hash of a document's content (text or ids): the validation split's key."""
    if isinstance(doc, str | dict):
        return zlib.crc32(doc_bytes(doc))
    return zlib.crc32(np.asarray(doc, np.int64).tobytes())


@dataclasses.dataclass
class Spec:
    """What one component's store is made of: its files (documents split by hash, or all
    training when ``val_files`` are given), how they are read, the tokenizer."""

    files: list[sources.SourceFile]
    val_files: list[sources.SourceFile] | None
    fraction: float
    opts: sources.Options
    tok: tokenizers.Tokenizer
    label: list[str]  # the paths a checkpoint names
    template: str | None = None  # data.chat_template (chat data; None: the tokenizer's)

    @property
    def chat(self) -> bool:
        return self.opts.format == "chat"

    @property
    def preference(self) -> bool:
        return self.opts.format == "preference"

    def template_or_none(self) -> chat.Template | None:
        """The chat template (chat data: required; preference data: if the tokenizer has
        one, for conversational records)."""
        if self.chat:
            return chat.template_of(self.tok, self.template)
        if self.preference:
            try:
                return chat.template_of(self.tok, self.template)
            except DataError:
                return None
        return None

    def work(self) -> list[tuple[sources.Piece, str]]:
        """Every piece with what its documents become: ``hash`` (split by ``fraction``),
        ``train`` or ``validation``."""
        mode = "hash" if self.val_files is None else "train"
        out = [(p, mode) for p in sources.pieces(self.files, self.opts)]
        return out + [(p, "validation") for p in sources.pieces(self.val_files or [], self.opts)]

    def dtype(self) -> str:
        text = all(f.kind in sources.TEXT_KINDS.values() or f.kind == "hf"
                   for f in self.files + (self.val_files or []))
        return "uint16" if text and self.tok.vocab_size <= 1 << 16 else "uint32"

    def key(self) -> str:
        """A hash of everything the tokens depend on, from file metadata only."""
        stat = [[f.path, f.size, os.stat(f.path).st_mtime_ns] for f in self.files]
        val = [[f.path, f.size, os.stat(f.path).st_mtime_ns] for f in self.val_files or []]
        blob = json.dumps([store.VERSION, sources.PIECE_BYTES, stat, val, self.fraction,
                           dataclasses.asdict(self.opts), self.tok.describe(),
                           self.tok.fingerprint, self.tok.bos_id, self.tok.eos_id]
                          + ([t.source] if (t := self.template_or_none()) else []))
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def name(self) -> str:
        stem = Path(self.label[0]).name.split(".")[0] or "corpus"
        return "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)[:40] + "-" + \
            self.key()


def data_format(path, dcfg: dict, key: str = "data.path") -> str:
    """``data.format`` of ``path`` with ``auto`` resolved (from its first record)."""
    fmt = dcfg.get("format") or "auto"
    if fmt != "auto" or path is None:
        return "text" if fmt == "auto" else fmt
    return chat.detect(sources.resolve(path, key), dcfg.get("field", "text"))


def spec(path, dcfg: dict, tok: tokenizers.Tokenizer, key: str) -> Spec:
    """The :class:`Spec` of ``path`` (None: the bundled stdlib corpus) under ``data:``."""
    opts = sources.Options(dcfg.get("field", "text"), dcfg.get("eos_id"),
                           dcfg.get("token_dtype", "uint16"), dcfg.get("format") or "auto")
    if path is None:
        from fiddlejax.data.builtin import stdlib_files

        files = [sources.SourceFile(str(p), "txt", n) for p in stdlib_files()  # empty: none
                 if (n := p.stat().st_size)]
        label = ["<stdlib>"]
    else:
        files = sources.resolve(path, key)
        label = [f.path for f in files]
    val_path, fraction = dcfg.get("val_path"), dcfg.get("val_fraction")
    val_files = sources.resolve(val_path, "data.val_path") if val_path is not None else None
    if val_files is not None:
        fraction = 0.0
    elif fraction is None:
        fraction = DEFAULT_VAL_FRACTION
    if opts.format not in FORMATS:
        raise DataError(f"data.format={opts.format} is none of {', '.join(FORMATS)}")
    if opts.format == "auto":
        opts = dataclasses.replace(opts, format=chat.detect(files, opts.field))
    if opts.format in ("chat", "preference"):
        bad = [f.path for f in files + (val_files or []) if f.kind in ("txt", "bin", "npy")]
        if bad:
            raise DataError(f"data.format={opts.format} reads records (.jsonl, .parquet, Arrow, "
                            f"ArrayRecord), not {bad[0]}; convert it, or use data.format=text")
    if opts.format == "chat":
        chat.template_of(tok, dcfg.get("chat_template"))  # refuse a tokenizer without one now
    return Spec(files, val_files, float(fraction), opts, tok, label, dcfg.get("chat_template"))


# -- one piece -------------------------------------------------------------------------------
def build_piece(piece: sources.Piece, mode: str, spec: Spec, out: Path) -> dict:
    """Tokenize one piece into ``out`` (``train.bin`` / ``validation.bin`` and their
    documents' lengths), atomically; returns its counts (also in ``out/info.json``)."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cut = int(round(spec.fraction * 2 ** 32))
    tok, dtype = spec.tok, np.dtype(spec.dtype())
    files = {s: open(tmp / f"{s}.bin", "wb") for s in store.SPLITS}  # noqa: SIM115
    template = spec.template_or_none()
    masks = {s: open(tmp / f"{s}.mask.bin", "wb") for s in store.SPLITS} \
        if spec.chat or spec.preference else {}  # noqa: SIM115
    targets = dict.fromkeys(store.SPLITS, 0)
    lens: dict[str, list[int]] = {s: [] for s in store.SPLITS}
    h, lo, hi = hashlib.sha256(), None, None

    def flush(docs: list) -> None:
        nonlocal lo, hi
        texts = [d for d in docs if isinstance(d, str)]
        encoded = iter(tok.encode_batch(texts) if texts else [])
        for d in docs:
            mask = None
            if spec.preference:  # both sequences of an example, their specials added
                ids, mask = preference.encode(d, tok, template, f"{piece.file.path}")
            elif template is not None:  # the template writes the specials itself
                ids, mask = chat.encode(d, tok, template, f"{piece.file.path}")
            else:
                ids = next(encoded) if isinstance(d, str) else np.asarray(d, np.int64)
            if len(ids):
                lo = min(int(ids.min()), lo if lo is not None else 1 << 62)
                hi = max(int(ids.max()), hi if hi is not None else -1)
            if mask is None:
                ids = packing.with_specials(ids, tok.eos_id, tok.bos_id)
            split = mode if mode != "hash" else (
                "validation" if doc_hash(d) < cut else "train")
            h.update(doc_bytes(d))
            h.update(b"\0")
            files[split].write(ids.astype(dtype).tobytes())
            lens[split].append(len(ids))
            if mask is not None:
                masks[split].write(mask.astype(np.uint8).tobytes())
                targets[split] += int((mask & preference.SCORED).sum())

    try:
        batch, size = [], 0
        for doc in sources.read_piece(piece, spec.opts):
            batch.append(doc)
            size += len(doc)
            if size >= BATCH_BYTES:
                flush(batch)
                batch, size = [], 0
        flush(batch)
    finally:
        for f in (*files.values(), *masks.values()):
            f.close()
    specials = [i for i in (tok.eos_id, tok.bos_id) if i is not None]
    lo = min([lo] + specials if lo is not None else specials)
    hi = max([hi] + specials if hi is not None else specials)
    info = {"splits": {s: {"docs": len(lens[s]), "tokens": int(sum(lens[s])),
                           "targets": targets[s]} for s in store.SPLITS},
            "sha256": h.hexdigest(), "mode": mode, "min_id": lo, "max_id": hi}
    for s in store.SPLITS:
        np.save(tmp / f"{s}.len.npy", np.asarray(lens[s], np.int64))
    (tmp / "info.json").write_text(json.dumps(info))
    try:
        os.rename(tmp, out)
    except OSError:  # another process of the job finished the same piece first
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _one_thread() -> None:
    """A worker process tokenizes on one core (the workers are the parallelism)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run(jobs: list[tuple[int, sources.Piece, str]], spec: Spec, pieces: Path, workers: int,
         progress: Callable[[dict], None]) -> None:
    if workers <= 0 or len(jobs) <= 1:
        for k, piece, mode in jobs:
            progress(build_piece(piece, mode, spec, pieces / f"{k:05d}"))
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx,
                                                initializer=_one_thread) as pool:
        futures = [pool.submit(build_piece, piece, mode, spec, pieces / f"{k:05d}")
                   for k, piece, mode in jobs]
        for f in concurrent.futures.as_completed(futures):
            progress(f.result())


# -- the store -------------------------------------------------------------------------------
def ensure(spec: Spec, root: Path, *, workers: int = 0, rank: int = 0, count: int = 1,
           progress: Callable[[dict], None] | None = None,
           start: Callable[[int, int], None] | None = None) -> tuple[Path, bool]:
    """(the store's directory, whether it was already there): opened when ``root`` holds it,
    else prepared, this process (``rank`` of ``count``) doing its share of the pieces.
    ``start(pieces, total)`` is told this process's share before it begins."""
    final = root / spec.name()
    if store.complete(final):
        return final, True
    partial = root / f"{spec.name()}.partial"
    pieces = partial / "pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    work = spec.work()
    share = np.array_split(np.arange(len(work)), max(count, 1))[rank].tolist()
    jobs = [(k, *work[k]) for k in share if not (pieces / f"{k:05d}").is_dir()]
    if start is not None:
        start(len(jobs), len(work))
    began = time.perf_counter()
    _run(jobs, spec, pieces, workers, progress or (lambda info: None))
    if rank != 0:
        _wait(lambda: store.complete(final), f"process 0 to publish the data store {final}")
        return final, False
    _wait(lambda: all((pieces / f"{k:05d}").is_dir() for k in range(len(work))),
          f"the other processes' pieces in {pieces}")
    infos = [json.loads((pieces / f"{k:05d}" / "info.json").read_text())
             for k in range(len(work))]
    store.finalize(partial, final, infos, _meta(spec, infos, time.perf_counter() - began))
    return final, False


def _meta(spec: Spec, infos: list[dict], seconds: float) -> dict:
    def content(modes: set[str]) -> str:
        return hashlib.sha256("".join(i["sha256"] for i in infos if i["mode"] in modes)
                              .encode()).hexdigest()

    fp = {"paths": spec.label, "sizes": [f.size for f in spec.files],
          "sha256": content({"hash", "train"})}
    if spec.val_files is not None:
        fp["validation"] = {"paths": [f.path for f in spec.val_files],
                            "sizes": [f.size for f in spec.val_files],
                            "sha256": content({"validation"})}
    if spec.label == ["<stdlib>"]:
        fp = {"paths": ["<stdlib>"], "sizes": [sum(fp["sizes"])], "sha256": "stdlib"}
    return {"version": store.VERSION, "key": spec.key(), "dtype": spec.dtype(),
            "fingerprint": fp, "tokenizer": {"name": spec.tok.describe(),
                                             "sha256": spec.tok.fingerprint},
            "fraction": spec.fraction, "pieces": len(infos),
            "splits": {s: {k: sum(i["splits"][s].get(k, 0) for i in infos)
                           for k in ("docs", "tokens", "targets")} for s in store.SPLITS},
            "format": spec.opts.format, "loss_mask": spec.chat or spec.preference,
            "preference": spec.preference,
            "min_id": min(i["min_id"] for i in infos), "max_id": max(i["max_id"] for i in infos),
            "prepare_seconds_process0": round(seconds, 3)}


def _wait(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise DataError(f"waited {WAIT_S:.0f} s for {what}; is data.cache_dir on a "
                            "filesystem every process of the job sees, and did a process fail?")
        time.sleep(0.2)
