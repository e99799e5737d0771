"""Preference data for DPO: records of a prompt, a chosen and a rejected completion.

A record is ``{"prompt", "chosen", "rejected"}``, in one of TRL's two shapes:

- plain strings: each sequence is ``[BOS] prompt completion EOS``, the prompt and the
  completion tokenized apart (so the completion's tokens do not depend on a merge across the
  boundary), the completion and its EOS scored;
- conversational (the prompt a list of messages, each completion an assistant message or a
  list of them; a string completion is one assistant message): each sequence is the
  conversation rendered with the tokenizer's chat template (:mod:`fiddlejax.data.chat`), the
  completion's assistant turns scored (their content and end of turn).

The store keeps an example as one document, its two sequences back to back, with a code per
token (the mask file): bit 0, the token is scored; bit 1, it belongs to the rejected sequence.
:func:`row` serves it as one row: the two sequences as segments 1 and 2, ``loss_mask``
:data:`fiddlejax.finetune.dpo.CHOSEN` / ``REJECTED`` on their scored tokens
(:mod:`fiddlejax.finetune.dpo`).
"""

from __future__ import annotations

import numpy as np

from fiddlejax.data import chat, packing
from fiddlejax.data.sources import DataError

FIELDS = ("prompt", "chosen", "rejected")
SCORED, SECOND = 1, 2  # the stored code's bits


def is_preference(names) -> bool:
    """Whether records with these field names are preference records."""
    return set(FIELDS) <= set(names)


def _conversational(record: dict) -> bool:
    return any(isinstance(record[f], list) for f in FIELDS)


def encode(record, tok, template: chat.Template | None, where: str = "a record"
           ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, codes), int32: the example's chosen then rejected sequence, and per id its code
    (:data:`SCORED` | :data:`SECOND`)."""
    if not isinstance(record, dict) or not is_preference(record):
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: a preference record needs 'prompt', 'chosen' and "
                        f"'rejected'; it has {have}")
    halves = []
    for part in ("chosen", "rejected"):
        if _conversational(record):
            if template is None:
                raise DataError(f"{where}: conversational preference records are rendered "
                                "with the tokenizer's chat template, and it has none; give one "
                                "with data.chat_template=PATH.jinja, or plain-string records")
            ids, mask = _chat(record["prompt"], record[part], tok, template, where)
        else:
            ids, mask = _plain(record["prompt"], record[part], tok, where, part)
        if not mask.any():
            raise DataError(f"{where}: the {part} completion has no tokens to score")
        halves.append((ids, mask))
    (ic, mc), (ir, mr) = halves
    codes = np.concatenate([mc * SCORED, mr * SCORED + SECOND]).astype(np.int32)
    return np.concatenate([ic, ir]).astype(np.int32), codes


def _plain(prompt, completion, tok, where: str, part: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(f"{where}: 'prompt' and {part!r} must both be strings, or messages")
    p, c = tok.encode_batch([prompt, completion])
    ids = packing.with_specials(np.concatenate([p, c]), tok.eos_id, tok.bos_id)
    mask = np.zeros(len(ids), np.int32)
    mask[len(ids) - len(c) - 1:] = 1  # the completion and its EOS
    return ids, mask


def _chat(prompt, completion, tok, template: chat.Template, where: str
          ) -> tuple[np.ndarray, np.ndarray]:
    before = chat.messages({"prompt": prompt, "completion": []}, where) if prompt else []
    after = completion if isinstance(completion, list) else [
        {"role": chat.ASSISTANT, "content": completion}]
    msgs = chat.messages({"messages": before + after}, where)
    text, spans = template.assistant_spans(msgs)
    k = sum(m["role"] == chat.ASSISTANT for m in after)  # the completion's turns: the last k
    return chat.tokens_and_mask(text, spans[len(spans) - k:] if k else [], tok)


def row(ids: np.ndarray, codes: np.ndarray, length: int) -> dict:
    """One example as a row of ``length`` (int32 ``tokens``, ``segment_ids``, ``positions``,
    ``loss_mask``), padded; an example longer is refused."""
    n = len(ids)
    if n > length:
        raise DataError(f"a preference example holds {n} tokens (prompt + chosen + prompt + "
                        f"rejected), more than a row's {length}; raise model.seq_len to at "
                        f"least {n - 1}, or shorten the example")
    out = {k: np.zeros(length, np.int32) for k in ("tokens", "segment_ids", "loss_mask")}
    out["tokens"][:n] = ids
    second = (codes & SECOND) > 0
    out["segment_ids"][:n] = 1 + second
    out["loss_mask"][:n] = np.where(codes & SCORED, 1 + second, 0)  # dpo.CHOSEN / REJECTED
    out["positions"] = packing._positions(out["segment_ids"][None])[0]
    out["positions"][n:] = 0
    return out


def rows(examples: list[tuple[np.ndarray, np.ndarray]], length: int) -> dict:
    """:func:`row` of each example, stacked: ``[examples, length]`` arrays."""
    rs = [row(i, c, length) for i, c in examples]
    return {k: np.stack([r[k] for r in rs]) for k in rs[0]}
