"""``fiddlejax data prepare``: tokenize a corpus once into its store in ``data.cache_dir``,
with a progress bar and the tokens per second; ``fiddlejax train`` then opens it on start."""

from __future__ import annotations

import time

USAGE = ("usage: fiddlejax data prepare [--config FILE] data.path=... data.tokenizer=... "
         "[data.workers=N] [data.cache_dir=DIR]")


def prepare_command(argv: list[str]) -> int:
    """Prepare every component of ``data:`` (``data.path`` or ``data.mixture``)."""
    import argparse

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fiddlejax.app import config as config_lib
    from fiddlejax.data import pipeline
    from fiddlejax.data import tokenizer as tokenizers

    if not argv or argv[0] != "prepare":
        print(USAGE)
        return 2
    p = argparse.ArgumentParser(prog="fiddlejax data prepare")
    p.add_argument("--config", help="YAML file merged over the defaults")
    p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. data.path=corpus.jsonl")
    args = p.parse_args(argv[1:])
    try:
        cfg = config_lib.load(args.config, args.overrides)
        d = cfg["data"]
        tok = tokenizers.load(d.get("tokenizer", "auto"), cfg["model"].get("from_pretrained"))
        parts = pipeline.components(d)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn()) as bar:
            for i, (path, _) in enumerate(parts):
                key = f"data.mixture[{i}].path" if len(parts) > 1 else "data.path"
                task = bar.add_task(f"{key} pieces", total=None, rate="")
                t0, done = time.perf_counter(), [0]

                def start(n: int, total: int, task=task) -> None:
                    bar.update(task, total=n)

                def progress(info: dict, task=task, t0=t0, done=done) -> None:
                    done[0] += sum(s["tokens"] for s in info["splits"].values())
                    rate = done[0] / max(time.perf_counter() - t0, 1e-9)
                    bar.update(task, advance=1, rate=f"{rate:,.0f} tokens/s")

                pipeline.prepared(path, d, tok, key, log=print, progress=progress, start=start)
    except (config_lib.ConfigError, ValueError) as e:
        print(f"fiddlejax data prepare: {e}")
        return 2
    return 0
