"""The ``fiddlejax`` command: ``train``, ``schedule``, ``plan``, ``export``, ``eval``,
``generate``.

A dispatcher only: each command lives with what it runs (``fiddlejax.app`` for train, export,
eval and generate, ``fiddlejax.pipeline.render`` for schedule, ``fiddlejax.planner.command`` for
plan).
"""

from __future__ import annotations

import argparse
import os
import sys

USAGE = """fiddlejax [--debug] <command> [args]

commands:
  train [--config FILE] [key=value ...]   train a model (GPT on the stdlib corpus by default)
  schedule KIND --stages P --microbatches M [--virtual-stages V] [--json] [--png FILE]
  plan ...                                predict and search parallel layouts
  data prepare data.path=... data.tokenizer=...
                                          tokenize a corpus once into data.cache_dir
  export RUN_DIR OUT_DIR [--step N]       a Llama (or GPT: gpt2) run as a Hugging Face directory
  eval run.dir=DIR [data.path=...] [resume=N] [batches=N]
                                          validation loss and perplexity of a run's checkpoint
  generate run.dir=DIR prompt="..." [max_new_tokens=N temperature=T top_p=P seed=S]
                                          continue a prompt (or model.from_pretrained=DIR)

Errors are one line and exit status 2 (bad input) or 1 (a failure while training);
--debug (anywhere before the overrides, or FIDDLEJAX_DEBUG=1) shows the traceback instead.
"""


TRAIN_HELP = """sections (every key, its default and meaning: docs/config.md):
  model.*       name, sizes, seq_len; from_pretrained=DIR fine-tunes a Hugging Face directory
  mesh.*        data, pipe, tensor, context, expert: the device mesh
  plan.*        schedule, microbatches, virtual_stages, remat, zero, compute_dtype, ...
  optimizer.*   name, lr, warmup_steps, weight_decay, clip, ...
  data.*        path, tokenizer, batch_size, val_fraction, ...
  train.*       steps, log_every, eval_every, eval_batches
  run.*         dir, cpu_devices, progress;   checkpoint.*, resume, init_from

examples:
  fiddlejax train train.steps=50
  fiddlejax train model.from_pretrained=DIR data.path=corpus.jsonl optimizer.lr=1e-5
  fiddlejax train --config my.yaml mesh.data=4 mesh.pipe=1 plan.schedule=null
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("FIDDLEJAX_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        p = argparse.ArgumentParser(
            prog="fiddlejax train", formatter_class=argparse.RawDescriptionHelpFormatter,
            description="Train a model: the packaged defaults (fiddlejax/configs/default.yaml), "
                        "then --config FILE, then key=value overrides.",
            epilog=TRAIN_HELP)
        p.add_argument("--config", help="YAML file merged over the defaults")
        p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. mesh.data=2")
        args = p.parse_args(rest)
        from fiddlejax.app import train

        code = train.main(args.config, args.overrides, debug=debug)
        if code != 0:
            # Saves and logs are closed by now. After a failed restore, tensorstore's callbacks
            # would print "Event loop is closed" tracebacks during interpreter teardown, under
            # the one line that matters: skip the teardown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    if cmd == "schedule":
        from fiddlejax.pipeline.render import schedule_command

        return schedule_command(rest)
    if cmd == "export":
        from fiddlejax.app.export import export_command

        return export_command(rest)
    if cmd in ("eval", "generate"):
        from fiddlejax.app.inference import main as inference_main

        return inference_main(cmd, rest, debug=debug)
    if cmd == "data":
        from fiddlejax.app.prepare import prepare_command

        return prepare_command(rest)
    if cmd == "plan":
        from fiddlejax.planner.command import plan_command

        return plan_command(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
