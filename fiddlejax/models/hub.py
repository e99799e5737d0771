"""Hugging Face hub ids (``meta-llama/Llama-3.1-8B``) resolved from the local cache only.

``model.from_pretrained`` and ``models.from_pretrained`` take a directory or a hub id; an id is
looked up in the user's Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``: huggingface_hub's
own rules) with ``local_files_only``, so nothing is ever downloaded: fiddlejax jobs run where
the network may be absent, and a download belongs to ``hf download`` beforehand.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def local_dir(source: str | Path) -> Path:
    """``source`` itself when it is a directory (or does not look like a hub id), else the
    snapshot of hub id ``org/name`` (``org/name@revision``) in the local cache;
    FileNotFoundError naming the id, the cache and the download command when it is absent."""
    path = Path(source).expanduser()
    text = str(source)
    if path.exists() or not _ID.fullmatch(text):
        return path
    repo, _, revision = text.partition("@")
    from huggingface_hub import constants, snapshot_download

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # read now, not at import
    try:
        return Path(snapshot_download(repo, revision=revision or None, cache_dir=cache,
                                      local_files_only=True))
    except Exception as e:  # noqa: BLE001 - every miss means the same to the user
        raise FileNotFoundError(
            f"{text} is neither a directory nor a model in the local Hugging Face cache "
            f"({cache}; fiddlejax never downloads): fetch it first with "
            f"`hf download {repo}` (or `huggingface-cli download {repo}`), or give the "
            f"directory that holds its config.json ({type(e).__name__})") from None
