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
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TEXT_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet",
              ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord"}
TOKEN_KINDS = {".bin": "bin", ".npy": "npy"}
HF_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")


class DataError(ValueError):
    """A data source that cannot be read: the message names the file, the line and the fix."""


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


def _hf_files(d: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory (a DatasetDict: its ``train`` split)."""
    if (d / "dataset_dict.json").is_file():
        splits = json.loads((d / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{d} is a Hugging Face DatasetDict with splits {splits} but no "
                            "'train'; point data.path at one split's directory")
        return _hf_files(d / "train")
    state = d / "state.json"
    if state.is_file():
        names = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
        files = [d / n for n in names]
    else:
        files = sorted(d.glob("*.arrow"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"{d} looks like a Hugging Face save_to_disk directory but its Arrow "
                        f"files are missing ({missing or 'no *.arrow'}); save it again")
    return files


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
    return out


def _resolve_one(entry: str, key: str) -> list[SourceFile]:
    p = Path(entry).expanduser()
    if any(c in entry for c in "*?["):
        paths = [Path(m) for m in sorted(glob.glob(str(p), recursive=True))]
        if not paths:
            raise DataError(f"{key}={entry} matches no file; check the pattern")
    elif p.is_dir():
        if any((p / m).is_file() for m in HF_MARKERS):
            return [SourceFile(str(f), "hf", f.stat().st_size) for f in _hf_files(p)]
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
    """What a checkpoint records of the sources: paths, sizes and a content hash."""
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
    """How documents are read: the text field and, for token files, the EOS id and dtype."""

    field: str = "text"
    eos_id: int | None = None
    token_dtype: str = "uint16"


def documents(files: list[SourceFile], opts: Options) -> Iterator[str | np.ndarray]:
    """Every document of ``files`` in order: text (``str``) or, from token files, int arrays."""
    for f in files:
        if f.size == 0:
            raise DataError(f"{f.path} is empty; remove it from data.path")
        yield from _READERS[f.kind](Path(f.path), opts)


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text; set "
                        "data.field to a text field")
    return value


def _read_txt(p: Path, opts: Options) -> Iterator[str]:
    try:
        yield p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text at byte {e.start}; convert it to UTF-8") from None


def _read_jsonl(p: Path, opts: Options) -> Iterator[str]:
    opener = gzip.open if p.name.lower().endswith(".gz") else open
    try:
        with opener(p, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno}); "
                                    "each line must be one JSON object") from None
                if not isinstance(rec, dict) or opts.field not in rec:
                    have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                    raise DataError(f"{p}:{n}: no field {opts.field!r} (has {have}); set "
                                    "data.field to the field holding the text")
                yield _text(rec[opts.field], f"{p}:{n}", opts.field)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{p}: cannot be read ({e}); is it a valid (gzipped) JSONL file?") \
            from None


def _column(table, p: Path, field: str) -> Iterator[str]:
    if field not in table.column_names:
        raise DataError(f"{p}: no column {field!r} (columns: {table.column_names}); set "
                        "data.field to the column holding the text")
    for n, v in enumerate(table.column(field).to_pylist()):
        yield _text(v, f"{p}: row {n}", field)


def _read_parquet(p: Path, opts: Options) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p, columns=None)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DataError(f"{p}: not a readable Parquet file ({e})") from None
    yield from _column(table, p, opts.field)


def _read_arrow(p: Path, opts: Options) -> Iterator[str]:
    import pyarrow as pa

    try:  # datasets writes Arrow IPC streams; accept the file format too
        with pa.memory_map(str(p)) as src:
            table = pa.ipc.open_stream(src).read_all()
    except pa.ArrowInvalid:
        try:
            with pa.memory_map(str(p)) as src:
                table = pa.ipc.open_file(src).read_all()
        except pa.ArrowInvalid as e:
            raise DataError(f"{p}: not an Arrow file ({e})") from None
    yield from _column(table, p, opts.field)


def _read_arrayrecord(p: Path, opts: Options) -> Iterator[str]:
    try:
        from array_record.python.array_record_module import ArrayRecordReader
    except ImportError:
        raise DataError(f"{p}: reading ArrayRecord needs the array_record package (pip "
                        "install array_record); or convert the data to .jsonl") from None
    reader = ArrayRecordReader(str(p))
    try:
        records = reader.read_all()
    finally:
        reader.close()
    for n, rec in enumerate(records):
        try:
            text = rec.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{p}: record {n} is not UTF-8 text") from None
        if text.lstrip().startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                if opts.field not in obj:
                    raise DataError(f"{p}: record {n} has no field {opts.field!r} (has "
                                    f"{sorted(obj)}); set data.field")
                text = _text(obj[opts.field], f"{p}: record {n}", opts.field)
        yield text


def _read_tokens(p: Path, opts: Options) -> Iterator[np.ndarray]:
    if opts.eos_id is None:
        raise DataError(f"{p} holds token ids: set data.eos_id to the id that separates its "
                        "documents (e.g. data.eos_id=50256 for GPT-2's <|endoftext|>)")
    if p.suffix.lower() == ".npy":
        ids = np.load(p, mmap_mode="r")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(f"{p}: a token file must hold a 1-D integer array, got "
                            f"{ids.dtype}{list(ids.shape)}")
    else:
        dtype = np.dtype(opts.token_dtype)
        if p.stat().st_size % dtype.itemsize:
            raise DataError(f"{p}: {p.stat().st_size} bytes is not a whole number of "
                            f"{dtype.name} ids; set data.token_dtype (uint16 or uint32)")
        ids = np.fromfile(p, dtype=dtype)
    ends = np.flatnonzero(np.asarray(ids) == opts.eos_id)
    start = 0
    for e in [*ends.tolist(), len(ids)]:
        if e > start:
            yield np.asarray(ids[start:e], dtype=np.int64)
        start = e + 1


_READERS = {"txt": _read_txt, "jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_arrow,
            "arrayrecord": _read_arrayrecord, "bin": _read_tokens, "npy": _read_tokens}
