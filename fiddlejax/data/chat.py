"""Chat data: conversations rendered with the tokenizer's chat template, the assistant's
tokens marked as the only targets.

A record is ``{"messages": [{"role", "content"}, ...]}`` (the Hugging Face chat-dataset
shape) or ``{"prompt", "completion"}`` (strings: a user turn and the assistant's answer; or
lists of messages). :func:`render` runs the template as transformers' ``apply_chat_template``
does (the same sandboxed jinja2 environment: ``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``, its ``tojson``, the special tokens of
``tokenizer_config.json`` as variables) and :func:`encode` tokenizes the text without adding
special tokens, so the ids are ``apply_chat_template``'s.

Which characters are the assistant's: a template's ``{% generation %}`` blocks when it has
them (as ``return_assistant_tokens_mask``); otherwise each assistant turn is found by
rendering the conversation's prefixes, as TRL and axolotl do: the turn starts where the
rendering up to it with ``add_generation_prompt`` ends (the header, ``<|im_start|>assistant``,
is the prompt's), and runs through its content and the turn's closing text (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``: what the template writes after the content, whitespace
aside), so the model learns to stop. A token counts when its characters overlap those.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
from datetime import datetime
from pathlib import Path

import numpy as np

from fiddlejax.data import sources
from fiddlejax.data.sources import DataError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
ASSISTANT = "assistant"


def messages(record, where: str = "a record") -> list[dict]:
    """The conversation of a chat record (``messages``, or ``prompt`` + ``completion``)."""
    if isinstance(record, dict) and "messages" in record:
        msgs = record["messages"]
    elif isinstance(record, dict) and "prompt" in record and "completion" in record:
        p, c = record["prompt"], record["completion"]
        msgs = (p if isinstance(p, list) else [{"role": "user", "content": p}]) + \
            (c if isinstance(c, list) else [{"role": ASSISTANT, "content": c}])
    else:
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: a chat record needs 'messages' (a list of {{role, content}}) "
                        f"or 'prompt' and 'completion'; it has {have}")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., "
                        f"'content': ...}} objects, got {str(msgs)[:120]}")
    return [{k: v for k, v in m.items() if v is not None} for m in msgs]


def detect(files: list[sources.SourceFile], field: str) -> str:
    """``data.format=auto``: ``chat`` when the first record of the first file has no
    ``field`` but ``messages`` (or ``prompt`` and ``completion``), ``preference`` when it has
    ``prompt``, ``chosen`` and ``rejected``, else ``text``."""
    f = files[0] if files else None
    names: list[str] = []
    if f is not None and f.kind == "jsonl":
        opener = gzip.open if f.path.lower().endswith(".gz") else open
        with opener(f.path, "rb") as fh:
            for line in fh:
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        return "text"  # the reader names the bad line
                    names = list(rec) if isinstance(rec, dict) else []
                    break
    elif f is not None and f.kind == "parquet":
        names = sources._parquet(Path(f.path)).schema_arrow.names
    if field in names:
        return "text"
    if {"prompt", "chosen", "rejected"} <= set(names):
        return "preference"
    return "chat" if "messages" in names or {"prompt", "completion"} <= set(names) else "text"


# -- the template ----------------------------------------------------------------------------
TRACKER = "fiddlejax_generation_spans"  # the variable a tracked render passes its _Tracker in


@dataclasses.dataclass
class _Tracker:
    """What a render has written so far and the ``{% generation %}`` spans found in it."""

    blocks: list
    spans: list


# -- compiling -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """``source`` compiled in transformers' chat-template environment."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the block's character span is recorded
        in the :class:`_Tracker` the render was given (as transformers' tracker does)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark", [jinja2.nodes.Name(TRACKER, "load")])
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, tracker, caller):
            text = caller()
            if isinstance(tracker, _Tracker):
                start = len("".join(tracker.blocks))
                tracker.spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"the tokenizer's chat template is not valid jinja ({e})") from None


class Template:
    """A tokenizer's chat template with its special-token variables."""

    def __init__(self, source: str, variables: dict):
        self.source, self.variables = source, variables
        self.compiled = compile_template(source)
        self.generation = "generation" in source and "endgeneration" in source

    def render(self, msgs: list[dict], add_generation_prompt: bool = False,
               spans: list | None = None) -> str:
        """The conversation as text (``spans``: filled with ``{% generation %}`` spans)."""
        import jinja2

        kw = dict(messages=msgs, tools=None, documents=None,
                  add_generation_prompt=add_generation_prompt, **self.variables)
        try:
            if spans is None:
                return self.compiled.render(**kw)
            tracker = _Tracker([], spans)
            for block in self.compiled.generate(**kw, **{TRACKER: tracker}):
                tracker.blocks.append(block)
            return "".join(tracker.blocks)
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template refuses the conversation {_short(msgs)}: {e}") \
                from None

    def assistant_spans(self, msgs: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the assistant's character spans in it)."""
        if self.generation:
            spans: list = []
            return self.render(msgs, spans=spans), spans
        text = self.render(msgs)
        out = []
        for i, m in enumerate(msgs):
            if m["role"] != ASSISTANT:
                continue
            start = _prefix_end(text, self._safe_render(msgs[:i], True))
            body = _content_text(m.get("content")).strip()
            at = text.find(body, start) if body else start
            if at < 0:
                raise DataError(
                    f"the chat template does not write assistant message {i}'s content as "
                    f"given ({body[:60]!r}), so its tokens cannot be found; give a template "
                    "with {% generation %} blocks around the assistant's text "
                    "(data.chat_template=PATH)")
            end = at + len(body)
            alone = self.render(msgs[:i + 1])
            k = alone.rfind(body) if body else len(_common(alone, text))
            closing = alone[k + len(body):].rstrip() if k >= 0 else ""
            if closing and text.startswith(closing, end):
                end += len(closing)
            out.append((start, end))
        return text, out

    def _safe_render(self, msgs: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.render(msgs, add_generation_prompt)
        except DataError:  # e.g. a template that reads messages[0] of an empty list
            return ""


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content blocks: [{"type": "text", "text": ...}]
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return "" if content is None else str(content)


def _common(a: str, b: str) -> str:
    return os.path.commonprefix([a, b])


def _prefix_end(text: str, prefix: str) -> int:
    """Where ``prefix`` (the rendering up to a turn) ends in ``text``: all of it when it is
    a prefix, else as far as they agree."""
    return len(prefix) if text.startswith(prefix) else len(_common(text, prefix))


def _short(msgs: list[dict]) -> str:
    return json.dumps(msgs, ensure_ascii=False)[:160]


# -- the tokenizer's side --------------------------------------------------------------------
def template_of(tok, override: str | None = None) -> Template:
    """The :class:`Template` of tokenizer ``tok`` (``override``: a jinja file or text)."""
    source = tok.chat_template
    if override:
        source = open(override).read() if os.path.isfile(override) else override  # noqa: SIM115
    if not source:
        raise DataError(f"chat data needs a chat template, and the tokenizer {tok.describe()} "
                        "has none (no chat_template in tokenizer_config.json, no "
                        "chat_template.jinja); use the model's own tokenizer, or give one with "
                        "data.chat_template=PATH.jinja")
    if getattr(tok, "kind", None) != "tokenizer.json":
        raise DataError(f"chat data is rendered and tokenized with a Hugging Face tokenizer."
                        f"json (for the assistant tokens' offsets); data.tokenizer is "
                        f"{tok.describe()}. Give the model's tokenizer.json")
    cfg = tok.config
    variables = {}
    for key in SPECIAL_KEYS:
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            variables[key] = v
    return Template(source, variables)


def encode(record, tok, template: Template, where: str = "a record") -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """(ids, mask): ``apply_chat_template``'s ids of the record's conversation and, per id,
    1 where it is the assistant's (a target), both int32."""
    return tokens_and_mask(*template.assistant_spans(messages(record, where)), tok)


def tokens_and_mask(text: str, spans: list[tuple[int, int]], tok) -> tuple[np.ndarray,
                                                                           np.ndarray]:
    """(ids, mask) of rendered ``text``: 1 on the ids whose characters overlap ``spans``."""
    enc = tok._tok.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    mask = np.zeros(len(ids), np.int32)
    if spans and len(ids):
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        for a, b in spans:
            mask |= ((offsets[:, 0] < b) & (offsets[:, 1] > a)).astype(np.int32)
    return ids, mask
