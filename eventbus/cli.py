"""The ``eventbus`` command: one subcommand per thing a user does."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from eventbus.errors import EventBusError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eventbus",
        description="Composer-style training whose callbacks run in subscriber processes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from eventbus.job import add_run_arguments

    run = commands.add_parser("run", help="train the bundled character-level model (the main job)",
                              description="Train a small character-level Transformer on Python's bundled "
                                          "documentation text, printing progress.")
    add_run_arguments(run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            from eventbus.job import run_job

            return run_job(args)
    except EventBusError as err:
        print(f"eventbus {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eventbus {args.command}: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
