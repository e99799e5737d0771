"""Which files a ``data.path`` entry names: a glob's matches (``**`` never entering a link to
a directory) and a Hugging Face ``save_to_disk`` directory's Arrow files (its JSON checked)."""

from __future__ import annotations

import json
from pathlib import Path


class DataError(ValueError):
    """A data source that cannot be read: the message names the file, the line and the fix
    (defined here, the package's lowest module; :mod:`.sources` gives it to the others)."""


def hf_files(d: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory (a DatasetDict: its ``train`` split)."""
    if (d / "dataset_dict.json").is_file():
        splits = read_list(d / "dataset_dict.json", "splits")
        if "train" not in splits:
            raise DataError(f"{d} is a Hugging Face DatasetDict with splits {splits} but no "
                         "'train'; point data.path at one split's directory")
        return hf_files(d / "train")
    state = d / "state.json"
    if state.is_file():
        files = [d / f["filename"] for f in read_list(state, "_data_files")]
    else:
        files = sorted(d.glob("*.arrow"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"{d} looks like a Hugging Face save_to_disk directory but its Arrow "
                     f"files are missing ({missing or 'no *.arrow'}); save it again")
    return files


def read_list(path: Path, key: str) -> list:
    """``key`` of a ``save_to_disk`` JSON file: a list (of names, or of ``{"filename": F}``)."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8")).get(key, [])
        if isinstance(value, list) and all(isinstance(x, str) or (
                isinstance(x, dict) and isinstance(x.get("filename"), str)) for x in value):
            return value
        raise ValueError(f'"{key}" is not a list of file names')
    except (ValueError, UnicodeDecodeError, AttributeError) as e:  # AttributeError: not an object
        why = "not a JSON object" if isinstance(e, AttributeError) else str(e).split(":")[0]
        raise DataError(f"{path} is damaged ({why}); save the dataset again with "
                     "save_to_disk") from None


def glob(p: Path) -> list[Path]:
    """A glob's matches (hidden names only where the pattern names them, as ``glob.glob``);
    ``**`` never enters a link to a directory (through a link to its parent, ``glob.glob``
    read one file 41 times; through two, it never ends)."""
    parts = p.parts
    i = next(i for i, x in enumerate(parts) if any(c in x for c in "*?["))
    base = Path(*parts[:i]) if i else Path()
    hidden = any(x.startswith(".") for x in parts[i:])
    return sorted(m for m in base.glob(str(Path(*parts[i:])))
                  if hidden or not any(x.startswith(".") for x in m.relative_to(base).parts))
