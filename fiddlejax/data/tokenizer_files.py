"""The tokenizer files of a Hugging Face model directory, written beside exported weights, so
``AutoTokenizer`` and ``generate`` of transformers work on a ``fiddlejax export``.

:func:`save` copies the job's tokenizer (``tokenizer.json`` or ``tokenizer.model`` with the
``tokenizer_config.json``, ``special_tokens_map.json`` and ``chat_template.jinja`` beside it;
a ``tokenizer_config.json`` naming the special tokens is written when there is none), writes
``generation_config.json`` (the source's when the tokenizer's directory has one) and fills
null ``bos_token_id`` / ``eos_token_id`` of ``config.json``. The byte tokenizer is written as
an equivalent byte-level ``tokenizer.json`` (id = byte value), built with ``tokenizers``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fiddlejax.data import tokenizer as tokenizers

# Files of a tokenizer's directory that travel with it (besides the tokenizer file itself).
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "added_tokens.json")


def save(directory: str | Path, tok: tokenizers.Tokenizer | str | None,
         max_length: int | None = None) -> dict:
    """Write ``tok`` (a tokenizer, a ``data.tokenizer`` spec, or None: nothing) into the model
    directory ``directory``; returns the token ids written to ``config.json``."""
    if tok is None:
        return {}
    if isinstance(tok, str):
        tok = tokenizers.load(tok)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer.model", *COMPANIONS, "generation_config.json"):
        (out / name).unlink(missing_ok=True)  # a previous export's must not mix in
    if tok.path is None:
        _byte_level(out)
        source = None
    else:
        source = Path(tok.path).parent
        shutil.copyfile(tok.path, out / Path(tok.path).name)
        for name in COMPANIONS:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    config = out / "tokenizer_config.json"
    if not config.is_file():
        _write_json(config, _tokenizer_config(tok, max_length))
    elif tok.chat_template and "chat_template" not in tokenizers._config(out):
        # transformers 5 keeps it in chat_template.jinja (copied too); 4.x reads it here
        _write_json(config, {**tokenizers._config(out), "chat_template": tok.chat_template})
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    written = _fill_config(out, ids)
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
    else:
        _write_json(out / "generation_config.json",
                    {k: v for k, v in written.items() if v is not None})
    return written


def _token(tok: tokenizers.Tokenizer, i: int | None) -> str | None:
    if i is None:
        return None
    if tok.path is None:
        return BYTE_CHARS[i]
    return tok.decode([i]) if tok.kind == "sentencepiece" else tok._tok.id_to_token(i)


def _tokenizer_config(tok: tokenizers.Tokenizer, max_length: int | None) -> dict:
    """A ``tokenizer_config.json`` for a tokenizer file that came without one."""
    cfg = {"tokenizer_class": "LlamaTokenizer" if tok.kind == "sentencepiece"
           else "PreTrainedTokenizerFast",
           "bos_token": _token(tok, tok.bos_id), "eos_token": _token(tok, tok.eos_id),
           "add_bos_token": tok.bos_id is not None, "add_eos_token": False,
           "clean_up_tokenization_spaces": False}
    if max_length:
        cfg["model_max_length"] = int(max_length)
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    return cfg


def _fill_config(directory: Path, ids: dict) -> dict:
    """Set ``config.json``'s null or missing token ids from the tokenizer; the ids it holds."""
    path = directory / "config.json"
    if not path.is_file():
        return ids
    cfg = json.loads(path.read_text())
    for key, value in ids.items():
        if cfg.get(key) is None and value is not None:
            cfg[key] = value
    _write_json(path, cfg)
    return {k: cfg.get(k) for k in (*ids, "pad_token_id")}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ``ByteLevel`` pre-tokenizers use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


BYTE_CHARS = _bytes_to_unicode()


def _byte_level(directory: Path) -> None:
    """``data.tokenizer=bytes`` as a ``tokenizer.json``: every UTF-8 byte is its own token,
    id = the byte's value, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in BYTE_CHARS.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
