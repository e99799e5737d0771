"""Where ``fiddlejax export`` writes: a temporary sibling of the target, swapped into place
only once complete, so a failed export (a full disk, ``ulimit -f``, a kill) leaves the
previous export, and everything else in the target, as it was.

What is whose: an export records the files it wrote in ``.fiddlejax-export.json``. A
re-export replaces exactly those (an earlier export's shards that the new one does not write
go with it); every other file in the target (a README, the user's own weights) is kept byte
for byte. A file the export would write that no earlier export recorded (a ``config.json`` of
the user's, another model's weights) is refused before anything is read, unless
``overwrite``: then it is replaced, and the directory's other files are still kept.

The swap: a target holding nothing but an earlier export is renamed aside, the finished
temporary directory renamed in its place and the earlier export's files removed (all or
nothing). Into a target that also holds the user's files (or that cannot be renamed: a mount
point) each finished file is renamed on its own (each rename atomic), then the earlier
export's files that the new one did not write are removed: the user's files are never
touched, and the write itself, where disks fill up, happens entirely before.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from fiddlejax.checkpoint.manifest import io_cause

RECORD = ".fiddlejax-export.json"
# Every name an export may write (the tokenizer file copied from data.tokenizer aside):
# refused early when the target holds one that no earlier export wrote.
_OURS = re.compile(r"config\.json|generation_config\.json|model\.safetensors(\.index\.json)?|"
                   r"model-\d{5}-of-\d{5}\.safetensors|tokenizer(\.json|\.model|_config\.json)|"
                   r"special_tokens_map\.json|chat_template\.jinja|added_tokens\.json")


class ExportFailed(RuntimeError):
    """Writing the export failed (an I/O error); the target is as it was before."""


class ExportRefused(ValueError):
    """The target is not a directory, or holds files the export would replace that no earlier
    export wrote."""


def recorded(out: str | Path) -> list[str]:
    """The files the export in ``out`` wrote (its record), [] when there is none."""
    try:
        files = json.loads((Path(out) / RECORD).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [f for f in files if isinstance(f, str) and f and "/" not in f and f != RECORD]


def check_target(out: str | Path, overwrite: bool = False) -> None:
    """Refuse, before anything is read, a target that is not a directory or that holds files
    this export would replace and no earlier export wrote (unless ``overwrite``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportRefused(f"{out} is not a directory; give a new or empty directory (or an "
                            "earlier export's) to write the export into")
    if out.is_dir() and not overwrite:
        _refuse(out, sorted(p.name for p in out.iterdir() if _OURS.fullmatch(p.name)))


def _refuse(out: Path, names: list[str]) -> None:
    theirs = [n for n in names if n not in set(recorded(out))]
    if theirs:
        raise ExportRefused(
            f"{out} holds {', '.join(theirs[:5])}{' ...' if len(theirs) > 5 else ''}, which "
            f"this export would replace and no earlier fiddlejax export wrote (no {RECORD} "
            "records them); export into a new or empty directory, or pass --overwrite to "
            "replace them (the directory's other files are kept)")


@contextlib.contextmanager
def staged(out: str | Path, overwrite: bool = False, **record) -> Iterator[Path]:
    """A fresh directory to write the export into; on leaving the block its files replace the
    export in ``out`` (``record``: what else the record notes, e.g. the run and step). An
    ``OSError`` inside or during the swap becomes :class:`ExportFailed`, the target intact."""
    out = Path(out).resolve()
    check_target(out, overwrite)
    beside = os.access(_existing(out.parent), os.W_OK)  # else inside the target
    tmp = (out.parent if beside else out) / f".{out.name}.fiddlejax-export-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        yield tmp
        written = sorted(p.name for p in tmp.iterdir())
        if out.is_dir() and not overwrite:
            _refuse(out, [n for n in written if (out / n).exists()])  # a name not foreseen
        (tmp / RECORD).write_text(json.dumps({"written_by": "fiddlejax export", **record,
                                              "files": written}, indent=2) + "\n")
        if not (beside and _swap(tmp, out)):
            _replace_files(tmp, out, written)
    except OSError as e:
        raise ExportFailed(f"writing the export to {out} failed ({io_cause(e)}); "
                           + ("the earlier export there is intact" if recorded(out) else
                              "nothing in it was changed")) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _existing(p: Path) -> Path:
    while not p.exists():
        p = p.parent
    return p


def _swap(tmp: Path, out: Path) -> bool:
    """Rename ``tmp`` over a missing or empty ``out``, or over one holding nothing but an
    earlier export (whose files are then removed); False when ``out`` holds other files or
    cannot be renamed (nothing was changed)."""
    ours = set(recorded(out)) | {RECORD}
    if out.exists() and (any(p.name not in ours for p in out.iterdir())
                         or out == Path(os.getcwd())):  # a shell's directory stays put
        return False
    old = out.parent / f".{out.name}.fiddlejax-old-{os.getpid()}"
    try:
        if out.exists():
            os.rename(out, old)
    except OSError:
        return False
    try:
        os.rename(tmp, out)
    except OSError:
        if old.exists():
            os.rename(old, out)
        raise
    if old.exists():  # only what the earlier export wrote: a file added since stays there
        for name in ours:
            (old / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            old.rmdir()
    return True


def _replace_files(tmp: Path, out: Path, written: list[str]) -> None:
    """Each written file renamed into ``out`` (each rename atomic), then the earlier export's
    files that this one did not write removed, the record last."""
    stale = [n for n in recorded(out) if n not in written]
    out.mkdir(parents=True, exist_ok=True)
    for name in written:
        os.replace(tmp / name, out / name)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    os.replace(tmp / RECORD, out / RECORD)
