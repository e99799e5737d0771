"""How the job feeds the bundled models: :class:`Batches` and the token streams (the stdlib
corpus in byte windows, or the user's own data through :mod:`fiddlejax.data.pipeline`).

Kept apart from the registry (``models/__init__.py``) so the model modules that build their
streams (BERT, CNN) import it without importing the registry back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class Batches:
    """What a model's data looks like to the job: iterators of global-batch dicts (this
    process's rows) and how many items (tokens or examples) one step consumes."""

    train: Iterator[dict]
    validation: Iterator[dict]
    items_per_step: int
    unit: str = "tokens"  # what items_per_step counts: "tokens" or "examples"



def vocab_fix(cfg: dict, vocab: int) -> str:
    """How to give the model a vocabulary of ``{need}`` ids, naming the key that decides it: a
    pretrained model's vocabulary is its checkpoint's, which ``model.vocab_size`` cannot change."""
    source = cfg["model"].get("from_pretrained")
    if source:
        return (f"the vocabulary comes from model.from_pretrained={source} (vocab_size={vocab} "
                "in its config.json; model.vocab_size is not used). The bundled corpus is "
                "bytes: fine-tune a checkpoint whose vocabulary holds at least {need} ids, or "
                "train from scratch without model.from_pretrained (model.vocab_size={need})")
    return "set model.vocab_size={need} (or more)"


def token_batches(cfg: dict, seq_len: int, vocab: int | None, process_index: int,
                  process_count: int) -> tuple[Iterator[dict], Iterator[dict]]:
    """Windows of the stdlib corpus, ``{"tokens": int32[B, seq_len + 1]}`` (inputs and
    next-token targets); ids checked once against ``vocab`` (the model's vocabulary)."""
    from fiddlejax import data

    b, seed = cfg["data"]["batch_size"], cfg["data"]["seed"]
    shard = {"process_index": process_index, "process_count": process_count}
    corpus = data.stdlib_corpus("train")
    val_corpus = data.stdlib_corpus("validation")
    if process_index == 0:
        print(f"# data: the bundled stdlib corpus (data.path=null): {len(corpus):,} bytes train, "
              f"{len(val_corpus):,} validation, in windows of model.seq_len + 1 = {seq_len + 1};"
              " tokenizer bytes (256 ids)", flush=True)
    if vocab is not None:
        data.check_tokens(corpus, vocab, "the stdlib corpus", vocab_fix(cfg, vocab))
    train = data.token_batches(corpus, seq_len, b, seed=seed, **shard)
    val = data.token_batches(val_corpus, seq_len, b, shuffle=False,
                             **shard)
    return iter(train), iter(val)


def own_data(cfg: dict) -> bool:
    """Whether the job trains on the user's data (``data.path``, ``data.mixture`` or a
    tokenizer other than bytes) rather than the stdlib corpus in byte windows."""
    from fiddlejax.data import pipeline

    return pipeline.wanted(cfg["data"], cfg["model"].get("from_pretrained"))


def own_batches(cfg: dict, seq_len: int, vocab: int, process_index: int = 0,
                process_count: int = 1):
    """(train stream, validation batches) of the user's data, packed (``segment_ids``,
    ``positions``); the train stream's state records the sources and the tokenizer."""
    import jax

    from fiddlejax.data import pipeline, tokenizer

    tok = tokenizer.load(cfg["data"]["tokenizer"], cfg["model"].get("from_pretrained"))
    fix = vocab_fix(cfg, vocab).replace("The bundled corpus is bytes", "The tokenizer is "
                                        f"{tok.describe()}")
    return pipeline.job_batches(cfg["data"], tok, seq_len, vocab, fix, process_index,
                                process_count, log=print if process_index == 0 else _quiet,
                                build=(jax.process_index(), jax.process_count()))


def _quiet(text: str) -> None:
    pass
