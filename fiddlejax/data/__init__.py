"""Data pipelines, served through grain: the bundled corpora and the user's own data.

- :mod:`.builtin`: data that ships with every machine (the standard library's source as a byte
  corpus, digit images, random tokens) and the windowed token batches of the default job;
- :mod:`.sources`: documents from the user's files (txt, jsonl, parquet, a Hugging Face
  ``save_to_disk`` directory, ArrayRecord, pre-tokenized ``.bin``/``.npy``);
- :mod:`.tokenizer`: ``bytes``, a Hugging Face ``tokenizer.json`` or a sentencepiece model;
- :mod:`.packing`: documents packed into rows with ``segment_ids`` and ``positions``;
- :mod:`.prepare` and :mod:`.store`: a corpus tokenized once, by the job's processes together,
  into a memory-mapped token store that later runs open in constant time and memory;
- :mod:`.pipeline`: the job's language-model batches over all of that (mixtures, validation
  split, checkpointable state that refuses a changed corpus or tokenizer).

Every name of the former single module ``fiddlejax.data`` is importable from here. The heavy
readers (pyarrow, tokenizers, sentencepiece) are imported only when a source needs them.
"""

from fiddlejax.data.builtin import (
    Windows,
    _batched,
    _is_validation,
    check_tokens,
    digits,
    generated_digits,
    image_batches,
    random_tokens,
    stdlib_corpus,
    stdlib_files,
    token_batches,
)

__all__ = [
    "Windows", "_batched", "_is_validation", "check_tokens", "digits", "generated_digits",
    "image_batches", "random_tokens", "stdlib_corpus", "stdlib_files", "token_batches",
]
