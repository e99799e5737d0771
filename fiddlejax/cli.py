"""The ``fiddlejax`` command: ``train``, ``schedule``, ``plan``."""

from __future__ import annotations

import argparse
import sys

USAGE = """fiddlejax <command> [args]

commands:
  train [--config FILE] [key=value ...]   train a model (GPT on the stdlib corpus by default)
  schedule KIND --stages P --microbatches M [--virtual-stages V] [--json] [--png FILE]
  plan ...                                predict and search parallel layouts
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        p = argparse.ArgumentParser(prog="fiddlejax train")
        p.add_argument("--config", help="YAML file merged over the defaults")
        p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. mesh.data=2")
        args = p.parse_args(rest)
        from fiddlejax import run

        return run.main(args.config, args.overrides)
    if cmd == "schedule":
        from fiddlejax.pipeline.render import schedule_command

        return schedule_command(rest)
    if cmd == "plan":
        try:
            from fiddlejax.planner.cli import plan_command
        except ImportError:
            print("fiddlejax plan: the planner is not available yet", file=sys.stderr)
            return 2
        return plan_command(rest)
    print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
