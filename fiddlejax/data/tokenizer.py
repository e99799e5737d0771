"""Tokenizers for ``data.tokenizer``: ``bytes``, a Hugging Face ``tokenizer.json`` or a
sentencepiece ``tokenizer.model`` (a file, or a directory holding one).

``auto`` (the default) is the tokenizer of ``model.from_pretrained`` when that directory holds
one, else ``bytes`` (:func:`check_bytes` refuses bytes for a checkpoint whose vocabulary is
larger, unless asked for by name). BOS and EOS come from the tokenizer
(``tokenizer_config.json`` next to the file names them, as does its chat template; else its
usual special tokens). The wrappers pickle by path, so
grain worker processes load their own copy. ``tokenizers`` and ``sentencepiece`` are imported
only when such a tokenizer is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

from fiddlejax.data.sources import DataError

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]")


class Tokenizer:
    """``encode(text) -> int32 ids`` (no BOS/EOS added), ``decode(ids) -> text``, its
    ``vocab_size``, ``bos_id`` (or None), ``eos_id`` and ``fingerprint`` (a hash of its file)."""

    kind = "bytes"
    vocab_size = 256
    bos_id: int | None = None
    eos_id = 0  # NUL separates the files of the bundled byte corpus
    path: str | None = None

    @property
    def config(self) -> dict:
        """The ``tokenizer_config.json`` beside the file ({} when there is none)."""
        return {} if self.path is None else _config(Path(self.path).parent)

    @property
    def chat_template(self) -> str | None:
        """The chat template (jinja) of ``tokenizer_config.json`` or ``chat_template.jinja``."""
        if self.path is None:
            return None
        jinja = Path(self.path).parent / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        t = self.config.get("chat_template")
        return t if isinstance(t, str) else None

    @property
    def fingerprint(self) -> str:
        if self.path is None:
            return "bytes"
        return hashlib.sha256(Path(self.path).read_bytes()).hexdigest()

    def describe(self) -> str:
        return self.kind if self.path is None else f"{self.kind} {self.path}"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` ``tokenizer.json`` (fast, Rust)."""

    kind = "tokenizer.json"

    def __init__(self, path: str):
        self.path = str(path)
        tok = self._tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        names = _config_tokens(Path(path).parent)
        self.eos_id = _token_id(tok, names.get("eos_token"), EOS_NAMES)
        self.bos_id = _token_id(tok, names.get("bos_token"), BOS_NAMES)
        if self.eos_id is None:
            raise DataError(f"data.tokenizer={path} has no end-of-document token (none of "
                            f"{list(EOS_NAMES)}, no eos_token in tokenizer_config.json); add "
                            "one when training the tokenizer, e.g. special_tokens=['<|endoftext"
                            "|>']")

    @functools.cached_property
    def _tok(self):
        from tokenizers import Tokenizer as HF

        try:
            return HF.from_file(self.path)
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exceptions
            raise DataError(f"data.tokenizer={self.path} is not a valid tokenizer.json ({e})") \
                from None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tok"}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in out]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``tokenizer.model`` (Llama 1/2, Mistral, T5...)."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        self.path = str(path)
        sp = self._sp
        self.vocab_size = sp.get_piece_size()
        self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        if self.eos_id is None:
            raise DataError(f"data.tokenizer={path}: the sentencepiece model has no EOS piece; "
                            "train it with eos_id set")

    @functools.cached_property
    def _sp(self):
        import sentencepiece as spm

        try:
            return spm.SentencePieceProcessor(model_file=self.path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"data.tokenizer={self.path} is not a sentencepiece model ({e})") \
                from None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_sp"}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


def _config(directory: Path) -> dict:
    f = directory / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{f} is not valid JSON ({e}); restore or remove it") from None
    if not isinstance(cfg, dict):
        raise DataError(f"{f} is not a JSON object (a {type(cfg).__name__}); restore or "
                        "remove it")
    return cfg


def _config_tokens(directory: Path) -> dict:
    cfg = _config(directory)
    out = {}
    for key in ("eos_token", "bos_token"):
        v = cfg.get(key)
        out[key] = v.get("content") if isinstance(v, dict) else v
        if out[key] is not None and not isinstance(out[key], str):
            raise DataError(f"{directory / 'tokenizer_config.json'} has {key}={v!r}, not a "
                            "token's text; fix it (e.g. \"</s>\") or remove it")
    return out


def _token_id(tok, named: str | None, candidates: tuple[str, ...]) -> int | None:
    for name in ([named] if named else []) + list(candidates):
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    return None


def find(directory: str | Path) -> Path | None:
    """The tokenizer file of a directory: ``tokenizer.json``, else ``tokenizer.model``."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


@functools.lru_cache(maxsize=8)
def load(spec: str = "auto", from_pretrained: str | None = None) -> Tokenizer:
    """The tokenizer ``data.tokenizer=spec`` names (``auto``: ``from_pretrained``'s, else
    bytes); a :class:`DataError` says what is missing."""
    if spec in (None, "auto"):
        found = find(from_pretrained) if from_pretrained else None
        return load(str(found)) if found else Tokenizer()
    if spec == "bytes":
        return Tokenizer()
    p = Path(spec).expanduser()
    if p.is_dir():
        found = find(p)
        if found is None:
            raise DataError(f"data.tokenizer={spec} is a directory without tokenizer.json or "
                            "tokenizer.model")
        p = found
    if not p.is_file():
        raise DataError(f"data.tokenizer={spec} does not exist; give bytes, a tokenizer.json, "
                        "a sentencepiece tokenizer.model, or a directory holding one")
    if p.suffix == ".json":
        return HFTokenizer(str(p))
    if p.suffix == ".model":
        return SentencePieceTokenizer(str(p))
    raise DataError(f"data.tokenizer={spec}: unknown kind; give a tokenizer.json (Hugging Face "
                    "tokenizers) or a tokenizer.model (sentencepiece)")


def check_bytes(spec: str | None, from_pretrained: str | None, vocab: int | None) -> None:
    """Refuse ``data.tokenizer=auto`` falling back to bytes for a ``model.from_pretrained``
    directory without a tokenizer whose vocabulary holds more than 256 ids (every id the bytes
    do not reach is text the model learned and would never see): the fix names the tokenizer
    to give, or ``data.tokenizer=bytes`` to insist."""
    if not from_pretrained or spec not in (None, "auto") or find(from_pretrained) is not None:
        return
    if vocab is None or vocab <= Tokenizer.vocab_size:
        return
    raise DataError(
        f"model.from_pretrained={from_pretrained} has no tokenizer (no tokenizer.json or "
        f"tokenizer.model there) and its vocabulary holds {vocab} ids, so data.tokenizer=auto "
        "would fall back to the 256-id byte tokenizer and the model would read and write "
        "garbage; give the tokenizer it was trained with, data.tokenizer=PATH (a tokenizer.json,"
        " a tokenizer.model or the original download's directory), or data.tokenizer=bytes to "
        "use bytes anyway")


def vocab_size(tok: Tokenizer, multiple: int = 1) -> int:
    """``model.vocab_size=auto``: the tokenizer's size rounded up to ``multiple``."""
    return -(-tok.vocab_size // multiple) * multiple
