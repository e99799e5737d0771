"""The input pipeline's tokens/s (by tokenizer worker count) against the step's tokens/s.

Makes a JSONL corpus from the Python standard library's source (``--docs`` documents, a few
MB) and trains a byte-level BPE ``tokenizer.json`` of vocab 512 on it with ``tokenizers``
(nothing downloads). Then measures, on this machine:

- **tokenize + pack**: ``fiddlejax.data.pipeline.tokenize`` then ``packing.pack_rows`` over the
  whole corpus, with ``data.workers`` = 0 (this process; the tokenizer's own Rust threads) and
  1, 2, ... grain worker processes: tokens produced per second;
- **serve**: batches from the job's train stream (grain: shuffle, mix, batch, slice) per second,
  times the tokens in a batch;
- **step**: the default ``fiddlejax train`` model (``fiddlejax/configs/default.yaml``: GPT,
  seq_len 128, batch 32, layout data=2 pipe=2 tensor=2 on 8 simulated CPU devices) on this
  corpus, median step time after compilation: the tokens/s training consumes.

The pipeline never starves the step when its tokens/s exceed the step's. Writes
``benchmarks/results/input_pipeline.md`` and ``.json``.

    python benchmarks/input_pipeline.py               # ~2 minutes on 2 CPU cores
    python benchmarks/input_pipeline.py --workers 0 1 2 4 --steps 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import reporting

ROOT = Path(__file__).resolve().parent.parent


def make_corpus(d: Path, n_docs: int) -> tuple[Path, Path, list[str]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fiddlejax.data import stdlib_files

    docs = []
    for p in stdlib_files():
        docs += [c for c in p.read_text(errors="replace").split("\n\n\n") if len(c) > 200]
        if len(docs) >= n_docs:
            break
    docs = docs[:n_docs]
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    return corpus, d / "tokenizer.json", docs


def pipeline_rates(docs: list[str], tok_path: Path, workers: list[int], seq_len: int) -> dict:
    from fiddlejax.data import packing, pipeline, tokenizer

    tok = tokenizer.load(str(tok_path))
    out = {}
    for w in workers:
        t = time.perf_counter()
        ids = pipeline.tokenize(docs, tok, workers=w)
        rows = packing.pack_rows(ids, seq_len + 1)
        dt = time.perf_counter() - t
        out[w] = rows["tokens"].size / dt
        print(f"tokenize+pack, workers={w}: {out[w]:,.0f} tokens/s ({dt:.2f} s)", flush=True)
    return out


def step_rate(corpus: Path, tok_path: Path, steps: int) -> tuple[float, float, dict]:
    import jax

    from fiddlejax.app import build, config

    cfg = config.load(None, [f"data.path={corpus}", f"data.tokenizer={tok_path}"])
    build.setup_devices(cfg)
    build.resolve_data(cfg)
    import fiddlejax as fj

    model = build.build_model(cfg["model"], 0)
    plan = build.make_plan(cfg)
    trainer = fj.parallelize(model, build.make_optimizer(cfg), plan)
    data = build.build_data(cfg, model)
    tokens = cfg["data"]["batch_size"] * cfg["model"]["seq_len"]
    t = time.perf_counter()
    n = 200
    for _ in range(n):
        next(data.train)
    serve = n * tokens / (time.perf_counter() - t)
    print(f"serve (grain batches): {serve:,.0f} tokens/s", flush=True)
    state = trainer.init()
    times = []
    for i in range(steps + 1):
        batch = next(data.train)
        t = time.perf_counter()
        state, m = trainer.step(state, batch)
        jax.block_until_ready(m["loss"])
        if i:
            times.append(time.perf_counter() - t)
    step = tokens / statistics.median(times)
    print(f"step ({dict(plan.mesh.shape)}): {step:,.0f} tokens/s", flush=True)
    return serve, step, {"layout": dict(plan.mesh.shape), "model": cfg["model"]["name"],
                         "seq_len": cfg["model"]["seq_len"], "batch": cfg["data"]["batch_size"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=1500)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "input_pipeline"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        corpus, tok, docs = make_corpus(Path(d), args.docs)
        size = corpus.stat().st_size
        rates = pipeline_rates(docs, tok, args.workers, 128)
        serve, step, setup = step_rate(corpus, tok, args.steps)
    res = {"corpus_bytes": size, "documents": len(docs), "tokenize_pack_tokens_per_s": rates,
           "serve_tokens_per_s": serve, "step_tokens_per_s": step, **setup}
    Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    lines = ["# Input pipeline vs step (tokens/s)", "",
             f"Corpus: {len(docs)} documents of the stdlib's source, {size / 1e6:.1f} MB JSONL; "
             "BPE tokenizer.json of vocab 512 (`tokenizers`). Step: the default model "
             f"({setup['model']}, seq_len {setup['seq_len']}, batch {setup['batch']}, layout "
             f"{setup['layout']}, 8 simulated CPU devices). `python benchmarks/input_pipeline.py`"
             ".", "", "| stage | tokens/s | x the step |", "|---|---:|---:|"]
    for w, r in rates.items():
        lines.append(f"| tokenize + pack, data.workers={w} | {r:,.0f} | {r / step:,.1f} |")
    lines.append(f"| serve batches (grain) | {serve:,.0f} | {serve / step:,.1f} |")
    lines.append(f"| training step | {step:,.0f} | 1.0 |")
    reporting.write(Path(args.out + ".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
