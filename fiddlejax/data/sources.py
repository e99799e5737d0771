"""Documents from the user's files: ``data.path`` resolved, read and fingerprinted.

``data.path`` is a file, a directory or a glob (or a list of them). By suffix a file is
``.txt`` (the whole file is one document), ``.jsonl`` / ``.jsonl.gz`` (one JSON object a line,
the text in ``data.field``), ``.parquet`` (the column ``data.field``), ``.arrayrecord`` /
``.array_record`` (one record a document: UTF-8 text, or a JSON object with ``data.field``),
``.bin`` / ``.npy`` (pre-tokenized ids, documents separated by ``data.eos_id``). A directory
written by Hugging Face datasets' ``save_to_disk`` (``state.json`` / ``dataset_info.json`` next
to ``*.arrow`` files) is read with pyarrow; any other directory contributes its files of those
kinds. Every problem (no such path, an empty file, a bad JSON line, a missing field) is a
:class:`DataError` naming the file and the line, raised while reading, before anything compiles.

Nothing holds a whole file: a file is cut into :class:`Piece` s (a JSONL byte range, Parquet row
groups, ArrayRecord record ranges; other kinds whole) that :func:`read_piece` streams (JSONL by
line, Parquet and Arrow by record batch, token files memory-mapped), so the corpus store
(:mod:`.prepare`) tokenizes pieces in parallel, in any process, in constant memory.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fiddlejax.data import listing
from fiddlejax.data.listing import DataError

TEXT_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet",
              ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord"}
TOKEN_KINDS = {".bin": "bin", ".npy": "npy"}
HF_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file of a source and how it is read (``kind``: txt, jsonl, parquet, hf, ...)."""

    path: str
    kind: str
    size: int


def _kind(p: Path) -> str | None:
    name = p.name.lower()
    for table in (TEXT_KINDS, TOKEN_KINDS):
        for suffix, kind in sorted(table.items(), key=lambda kv: -len(kv[0])):
            if name.endswith(suffix):
                return kind
    return None


def resolve(spec, key: str = "data.path") -> list[SourceFile]:
    """The files of ``spec`` (a path, a directory, a glob, or a list of them), in a stable
    order; a :class:`DataError` names the entry that matches nothing."""
    entries = spec if isinstance(spec, list | tuple) else [spec]
    if not entries or any(not isinstance(e, str | Path) or not str(e) for e in entries):
        raise DataError(f"{key}={spec!r} must be a path, a directory or a glob (or a list of "
                        "them), e.g. data.path=corpus.jsonl")
    out: list[SourceFile] = []
    for entry in entries:
        out += _resolve_one(str(entry), key)
    seen: set[str] = set()  # one file through links (or two entries) is read once
    return [f for f in out if not (os.path.realpath(f.path) in seen
                                   or seen.add(os.path.realpath(f.path)))]


def _resolve_one(entry: str, key: str) -> list[SourceFile]:
    p = Path(entry).expanduser()
    if any(c in entry for c in "*?["):
        paths = listing.glob(p)
        if not paths:
            raise DataError(f"{key}={entry} matches no file; check the pattern")
    elif p.is_dir():
        if any((p / m).is_file() for m in HF_MARKERS):
            return [SourceFile(str(f), "hf", f.stat().st_size) for f in listing.hf_files(p)]
        paths = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f))
        if not paths:
            raise DataError(f"{key}={entry} is a directory without data files (.txt, .jsonl, "
                            ".jsonl.gz, .parquet, .arrayrecord, .bin, .npy, or a save_to_disk "
                            "directory)")
    elif p.exists():
        paths = [p]
    else:
        raise DataError(f"{key}={entry} does not exist (nothing is downloaded); give a local "
                        "file, directory or glob")
    out = []
    for f in paths:
        if f.is_dir():
            out += _resolve_one(str(f), key)
            continue
        kind = _kind(f)
        if kind is None:
            raise DataError(f"{key}: {f} has an unknown kind; use .txt, .jsonl, .jsonl.gz, "
                            ".parquet, .arrayrecord, .bin or .npy")
        out.append(SourceFile(str(f), kind, f.stat().st_size))
    return out


def fingerprint(files: list[SourceFile]) -> dict:
    """Paths, sizes and a hash of every byte (the prepared store records a content hash made
    while tokenizing instead: :mod:`.prepare`)."""
    h = hashlib.sha256()
    for f in files:
        with open(f.path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        h.update(f"\0{Path(f.path).name}\0{f.size}\0".encode())
    return {"paths": [f.path for f in files], "sizes": [f.size for f in files],
            "sha256": h.hexdigest()}


# -- reading ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Options:
    """How documents are read: the text field and, for token files, the EOS id and dtype;
    ``format="chat"`` (or ``"preference"``): each record whole, a dict (:mod:`.chat` renders it)."""

    field: str = "text"
    eos_id: int | None = None
    token_dtype: str = "uint16"
    format: str = "text"


def documents(files: list[SourceFile], opts: Options) -> Iterator[str | np.ndarray]:
    """Every document of ``files`` in order: text (``str``) or, from token files, int arrays."""
    for piece in pieces(files, opts):
        yield from read_piece(piece, opts)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A part of a file read on its own: JSONL bytes ``[lo, hi)`` (the lines that start
    there), Parquet row groups or ArrayRecord records ``[lo, hi)``; ``hi=-1``: the whole file."""

    file: SourceFile
    lo: int = 0
    hi: int = -1


PIECE_BYTES = 4 << 20  # a JSONL piece; Parquet pieces are row groups


def pieces(files: list[SourceFile], opts: Options,
           piece_bytes: int | None = None) -> list[Piece]:
    """``files`` cut into pieces, in document order (reads metadata, never the documents)."""
    piece_bytes = piece_bytes or PIECE_BYTES
    out: list[Piece] = []
    for f in files:
        if f.size == 0:
            raise DataError(f"{f.path} is empty; remove it from data.path")
        if f.kind == "jsonl" and not f.path.lower().endswith(".gz"):
            n = max(1, -(-f.size // piece_bytes))
            cuts = [f.size * i // n for i in range(n + 1)]
            out += [Piece(f, a, b) for a, b in zip(cuts, cuts[1:])]
        elif f.kind == "parquet":
            groups = _parquet(Path(f.path)).metadata.num_row_groups
            out += [Piece(f, g, g + 1) for g in range(groups)] or [Piece(f, 0, 0)]
        elif f.kind == "arrayrecord":
            n = _array_record(Path(f.path)).num_records()
            step = 1 << 16
            out += [Piece(f, a, min(a + step, n)) for a in range(0, n, step)] or [Piece(f, 0, 0)]
        else:
            out.append(Piece(f))
    return out


def read_piece(piece: Piece, opts: Options) -> Iterator[str | np.ndarray]:
    """The documents of one piece, streamed."""
    return _READERS[piece.file.kind](Path(piece.file.path), opts, piece.lo, piece.hi)


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text; set "
                        "data.field to a text field")
    return value


def _read_txt(p: Path, opts: Options, lo: int = 0, hi: int = -1) -> Iterator[str]:
    try:
        yield p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}:{_line_number(p, e.start)}: not UTF-8 text (byte {e.start}); "
                        "convert the file to UTF-8") from None


def _lines(p: Path, lo: int, hi: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of the lines that start in ``[lo, hi)`` (``hi=-1``: to the end)."""
    if p.name.lower().endswith(".gz"):
        with gzip.open(p, "rb") as fh:
            pos = 0
            for line in fh:
                yield pos, line
                pos += len(line)
        return
    with open(p, "rb") as fh:
        if lo > 0:
            fh.seek(lo - 1)
            fh.readline()  # the line that started before lo belongs to the previous piece
        pos = fh.tell()
        while hi < 0 or pos < hi:
            line = fh.readline()
            if not line:
                return
            yield pos, line
            pos += len(line)


def _line_number(p: Path, pos: int) -> int:
    """The 1-based number of the line at byte ``pos`` (counted only to name an error)."""
    if p.name.lower().endswith(".gz"):
        with gzip.open(p, "rb") as fh:
            return fh.read(pos).count(b"\n") + 1
    with open(p, "rb") as fh:
        return sum(fh.read(min(1 << 24, pos - i)).count(b"\n")
                   for i in range(0, pos, 1 << 24)) + 1


def _read_jsonl(p: Path, opts: Options, lo: int = 0, hi: int = -1) -> Iterator[str]:
    try:
        for pos, line in _lines(p, lo, hi):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{_line_number(p, pos)}: not valid JSON ({e.msg} at column "
                                f"{e.colno}); each line must be one JSON object") from None
            except UnicodeDecodeError:
                raise DataError(f"{p}:{_line_number(p, pos)}: not UTF-8 text; convert the "
                                "file to UTF-8") from None
            if opts.format in ("chat", "preference") and isinstance(rec, dict):
                yield rec
                continue
            if not isinstance(rec, dict) or opts.field not in rec:
                have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise DataError(f"{p}:{_line_number(p, pos)}: no field {opts.field!r} (has "
                                f"{have}); set data.field to the field holding the text")
            value = rec[opts.field]  # the line number costs a read: counted only for errors
            yield value if isinstance(value, str) else _text(
                value, f"{p}:{_line_number(p, pos)}", opts.field)
    except (OSError, EOFError) as e:
        raise DataError(f"{p}: cannot be read ({e}); is it a valid (gzipped) JSONL file?") \
            from None


def _check_column(names: list[str], p: Path, field: str | None) -> None:
    if field is None and "messages" not in names and not {"prompt", "completion"} <= {*names}:
        raise DataError(f"{p}: chat data needs a 'messages' column, or 'prompt' and "
                        f"'completion' (columns: {names})")
    if field is not None and field not in names:
        raise DataError(f"{p}: no column {field!r} (columns: {names}); set "
                        "data.field to the column holding the text")


def _batches_text(batches, p: Path, field: str | None) -> Iterator[str]:
    if field is None:  # chat: each row as a dict
        yield from (row for batch in batches for row in batch.to_pylist())
        return
    n = 0
    for batch in batches:
        for v in batch.column(field).to_pylist():
            yield _text(v, f"{p}: row {n}", field)
            n += 1


def _parquet(p: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(p)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DataError(f"{p}: not a readable Parquet file ({e})") from None


def _read_parquet(p: Path, opts: Options, lo: int = 0, hi: int = -1) -> Iterator[str]:
    f, field = _parquet(p), None if opts.format in ("chat", "preference") else opts.field
    _check_column(f.schema_arrow.names, p, field)
    groups = list(range(lo, f.metadata.num_row_groups if hi < 0 else hi))
    if groups:  # one record batch at a time: never the whole file
        yield from _batches_text(f.iter_batches(batch_size=4096, row_groups=groups, columns=(
            None if field is None else [field])), p, field)


def _read_arrow(p: Path, opts: Options, lo: int = 0, hi: int = -1) -> Iterator[str]:
    import pyarrow as pa

    with pa.memory_map(str(p)) as src:  # record batches are views of the mapped file
        try:  # datasets writes Arrow IPC streams; accept the file format too
            reader = pa.ipc.open_stream(src)
            batches = iter(reader)
        except pa.ArrowInvalid:
            try:
                src.seek(0)
                reader = pa.ipc.open_file(src)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid as e:
                raise DataError(f"{p}: not an Arrow file ({e})") from None
        field = None if opts.format in ("chat", "preference") else opts.field
        _check_column(reader.schema.names, p, field)
        yield from _batches_text(batches, p, field)


def _array_record(p: Path):
    try:
        from array_record.python.array_record_module import ArrayRecordReader
    except ImportError:
        raise DataError(f"{p}: reading ArrayRecord needs the array_record package (pip "
                        "install array_record); or convert the data to .jsonl") from None
    return ArrayRecordReader(str(p))


def _read_arrayrecord(p: Path, opts: Options, lo: int = 0, hi: int = -1) -> Iterator[str]:
    reader = _array_record(p)
    try:
        hi = reader.num_records() if hi < 0 else hi
        for start in range(lo, hi, 1024):
            for n, rec in enumerate(reader.read(start, min(start + 1024, hi)), start):
                yield _record_text(rec, p, n, opts)
    finally:
        reader.close()


def _record_text(rec: bytes, p: Path, n: int, opts: Options) -> str:
    try:
        text = rec.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{p}: record {n} is not UTF-8 text") from None
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and opts.format in ("chat", "preference"):
            return obj
        if isinstance(obj, dict):
            if opts.field not in obj:
                raise DataError(f"{p}: record {n} has no field {opts.field!r} (has "
                                f"{sorted(obj)}); set data.field")
            text = _text(obj[opts.field], f"{p}: record {n}", opts.field)
    return text


def _read_tokens(p: Path, opts: Options, lo: int = 0, hi: int = -1) -> Iterator[np.ndarray]:
    """Documents as views of the memory-mapped file (no copy), found a chunk at a time."""
    if opts.eos_id is None:
        raise DataError(f"{p} holds token ids: set data.eos_id to the id that separates its "
                        "documents (e.g. data.eos_id=50256 for GPT-2's <|endoftext|>)")
    if p.suffix.lower() == ".npy":
        try:
            ids = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:  # garbage, objects (a pickle: refused)
            raise DataError(f"{p} is not a .npy array of token ids ({' '.join(str(e).split())}"
                            "); save a 1-D integer array with numpy.save") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(f"{p}: a token file must hold a 1-D integer array, got "
                            f"{ids.dtype}{list(ids.shape)}")
    else:
        dtype = np.dtype(opts.token_dtype)
        if p.stat().st_size % dtype.itemsize:
            raise DataError(f"{p}: {p.stat().st_size} bytes is not a whole number of "
                            f"{dtype.name} ids; set data.token_dtype (uint16 or uint32)")
        ids = np.memmap(p, dtype=dtype, mode="r")
    start, chunk = 0, 1 << 24
    for c in range(0, len(ids), chunk):
        ends = np.flatnonzero(ids[c:c + chunk] == opts.eos_id) + c
        for e in ends.tolist():
            if e > start:
                yield ids[start:e]
            start = e + 1
    if len(ids) > start:
        yield ids[start:]


_READERS = {"txt": _read_txt, "jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_arrow,
            "arrayrecord": _read_arrayrecord, "bin": _read_tokens, "npy": _read_tokens}
