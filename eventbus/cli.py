"""The ``eventbus`` command: one subcommand per thing a user does.

Only what a subcommand needs is imported, when it runs: ``eventbus monitor`` and
``eventbus proxy`` (and every ``--help``) never import torch or the training side.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import re
import signal
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence

from eventbus.errors import ConfigError, EventBusError
from eventbus.runtime.daemon import (
    OneLineErrorParser,
    add_verbose_argument,
    ended_run_hint,
    serve,
    server_problem,
    setup_logging,
    timeout_seconds,
)
from eventbus.version import __version__

if TYPE_CHECKING:
    from eventbus.core.callback import Callback

__all__ = ["main", "OneLineErrorParser"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="eventbus",
        description="Composer-style training whose callbacks run in subscriber processes.",
    )
    parser.add_argument("--version", action="version", version=f"eventbus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=OneLineErrorParser)

    from eventbus.run.config import add_run_arguments

    run = commands.add_parser("run", help="train the bundled character-level model with the daemons (the main job)",
                              description="Train a small character-level Transformer on Python's bundled "
                                          "documentation text, with four daemons as child processes: logger "
                                          "(progress, metrics files, optionally TensorBoard, MLflow, W&B), timing "
                                          "(throughput, remaining time), checkpoint and health. Results go to "
                                          "runs/<run_name>/.")
    add_run_arguments(run)

    from eventbus.run.daemons import add_daemons_arguments

    daemons = commands.add_parser("daemons", help="eventbus run's daemons for a run started elsewhere (a script, "
                                                  "an adapter, a hand-written loop)",
                                  description="Start the daemons eventbus run starts (logger, timing, checkpoint, "
                                              "health) following a run; they exit when it ends. Results go to "
                                              "the run's folder.")
    add_daemons_arguments(daemons)

    # Listed here for `eventbus --help` only: main() hands everything after "monitor" to the
    # monitor's own parser, which owns its arguments (options before the address, --help).
    commands.add_parser(
        "monitor", help="attach a live terminal dashboard to a run (or show a finished run's journal)",
        add_help=False)

    _add_worker_command(commands)
    _add_bus_commands(commands)
    _add_replay_command(commands)
    _add_export_command(commands)
    return parser


def _add_worker_command(commands: Any) -> None:
    worker = commands.add_parser(
        "worker", help="host callbacks in a daemon that follows a training run",
        description="Connect to a trainer's bus and run callbacks out of process. Stops at the end of the "
                    "run, or cleanly on SIGTERM/SIGINT (queued events are applied, callbacks closed).")
    worker.add_argument("--connect", required=True, metavar="ADDR",
                        help="the trainer's bus address, as printed by the trainer (ipc://... or tcp://...)")
    worker.add_argument("--callback", action="append", required=True, metavar="SPEC",
                        help="module:Class, path/to/file.py:Class, optionally :{json kwargs}; repeatable")
    worker.add_argument("--identity", help="a name for this worker; with it, a restarted worker resumes "
                                           "where it stopped")
    worker.add_argument("--state-dir", type=pathlib.Path,
                        help="where --identity keeps its cursor (default: ~/.cache/eventbus/subscribers)")
    worker.add_argument("--from", dest="start", choices=["beginning", "latest"], default="beginning",
                        help="replay the run from its beginning (default) or join at the latest event")
    worker.add_argument("--events", nargs="+", metavar="EVENT", help="only these events (default: all)")
    worker.add_argument("--journal", help="journal to recover from if the trainer's replay service is gone")
    worker.add_argument("--fail-fast", action="store_true", help="stop at the first callback exception")
    worker.add_argument("--timeout", type=timeout_seconds, metavar="SECONDS",
                        help="give up (exit code 2) when no trainer serves ADDR within SECONDS (default: wait; "
                             "a local address nobody serves is reported at once)")
    worker.add_argument("--follow", action="store_true",
                        help="keep going when the run ends: follow the next run on the same address with fresh "
                             "callbacks (a restarted trainer)")
    add_verbose_argument(worker)


def _key_name(text: str) -> str:
    """A key pair's file name: no path, so the pair lands in DIR."""
    if not text or "/" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"must be a plain file name (no '/', not starting with '.'), got {text!r}")
    return text


def _add_bus_commands(commands: Any) -> None:
    """keys, status and proxy: the bus itself, without a run's callbacks."""
    keys = commands.add_parser("keys", help="CURVE keys for a bus reachable over the network",
                               description="Generate ZeroMQ CURVE key pairs (secret files are mode 0600).")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION",
                                        parser_class=OneLineErrorParser)
    generate = keys_commands.add_parser(
        "generate", help="write key pairs into DIR",
        description="Without --name: a server pair, a client pair, and DIR/authorized/client.key (the "
                    "allow-list the trainer reads). With --name: one more pair to hand to another client "
                    "(copy its .key into the allow-list).")
    generate.add_argument("directory", type=pathlib.Path)
    generate.add_argument("--name", type=_key_name, help="write only this pair")

    status = commands.add_parser("status", help="ask a running trainer for its bus statistics",
                                 description="Print the publisher's counters and its live subscribers as JSON; "
                                             "exit 0 if it answered (a healthcheck), 1 if not.")
    status.add_argument("address", help="the trainer's bus address")
    status.add_argument("--subscriber", action="append", default=[],
                        help="also require that this subscriber identity sent a heartbeat recently")
    status.add_argument("--timeout", type=timeout_seconds, default=3.0,
                        help="seconds to wait for an answer (default: 3)")

    proxy = commands.add_parser(
        "proxy", help="one address for all ranks of a torchrun job",
        description="Forward every rank's events (ZeroMQ's own proxy) and route requests to the rank they name, "
                    "so subscribers, workers and monitors connect to one address. Ranks are read from rank 0's "
                    "run header. Stops on SIGTERM/SIGINT. CURVE: EVENTBUS_CLIENT_SECRET_KEY and "
                    "EVENTBUS_SERVER_PUBLIC_KEY towards the ranks, EVENTBUS_SERVER_SECRET_KEY and "
                    "EVENTBUS_AUTHORIZED_KEYS towards subscribers.")
    proxy.add_argument("--connect", required=True, metavar="ADDR", help="rank 0's bus address")
    proxy.add_argument("--bind", required=True, metavar="ADDR",
                       help="the address subscribers connect to (its request service is the next port, or .ctl)")
    proxy.add_argument("--wait", type=timeout_seconds, default=300.0, metavar="SECONDS",
                       help="how long to wait for rank 0 to answer (default: 300)")


def _add_replay_command(commands: Any) -> None:
    replay = commands.add_parser("replay", help="run callbacks over a run's journal",
                                 description="Run callbacks over a finished or running run's events.journal.")
    replay.add_argument("journal", type=pathlib.Path, help="the run folder or its events.journal")
    replay.add_argument("--callback", action="append", required=True, metavar="SPEC",
                        help="module:Class, path/to/file.py:Class, optionally :{json kwargs}; repeatable")
    replay.add_argument("--fail-fast", action="store_true", help="stop at the first callback exception")


def _add_export_command(commands: Any) -> None:
    from eventbus.export import TARGETS  # no tracker package: each is imported when exported to

    export = commands.add_parser(
        "export", help="write a run's journal into a tracker (resumable, nothing doubled)",
        description="Write a finished run (or, with --follow, a live one) from its journal into TensorBoard, "
                    "MLflow, W&B, CSV or JSONL. Points the tracker already holds are skipped, so running it "
                    "again doubles nothing; --resume continues an interrupted export after its last "
                    "committed message. Exit codes: 0 done, 1 tracker failure, 2 bad usage, 3 damaged journal, "
                    "4 --follow: the trainer is gone (no record, no answer for 30 s), "
                    "130 interrupted (continue with --resume).")
    export.add_argument("journal", type=pathlib.Path, help="the run folder or its events.journal")
    export.add_argument("--to", required=True, choices=TARGETS, metavar="TARGET",
                        help=f"where to: {', '.join(TARGETS)}")
    export.add_argument("--output", type=pathlib.Path, metavar="DIR",
                        help="where files go (default: the run folder; TensorBoard: <run folder>/tensorboard; "
                             "MLflow: <DIR>/mlruns unless --mlflow-uri)")
    export.add_argument("--mlflow-uri", metavar="URI", help="an MLflow tracking URI (default: a local store)")
    export.add_argument("--resume", action="store_true",
                        help="continue after the last message an earlier export committed")
    export.add_argument("--follow", action="store_true",
                        help="a live run: keep reading the journal as it grows, until the run's end "
                             "(or SIGINT/SIGTERM)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; the exit code (2 with one line on stderr for bad arguments or input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["monitor"]:
        from eventbus.monitor.app import main as monitor_main

        return monitor_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(_attach_dash_values(argv))
    if unknown:  # said by the subcommand's parser: "eventbus run: error: ..."
        _subcommand_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "worker":
        setup_logging(logging.INFO if args.verbose else logging.WARNING, "eventbus worker")
        return serve("eventbus worker", args, _worker_callbacks)
    setup_logging(logging.INFO)
    # SIGTERM (a plain `kill`, a process manager) stops a command as Ctrl-C does: `eventbus run` ends its run
    # cleanly (the journal's end, the daemons' last work, no socket files left) instead of dying mid-step.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _dispatch(args)
    except EventBusError as err:
        print(f"eventbus {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eventbus {args.command}: interrupted", file=sys.stderr)
        return 130


def _subcommand_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand ``args`` were parsed for: its name goes on the error line."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            return _subcommand_parser(chosen, args) if chosen is not None else parser
    return parser


_DASH_VALUE = re.compile(r"-\.?\d")  # "-1ep", "-1", "-.5": a value, though argparse would take it for an option


def _attach_dash_values(argv: list[str]) -> list[str]:
    """``--opt -1ep`` as ``--opt=-1ep``: argparse reads a dash-led value as a missing one; this way the
    value reaches the option's own check, which names what is wrong with it."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _DASH_VALUE.match(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from eventbus.run.job import run_job

        return run_job(args)
    if args.command == "daemons":
        from eventbus.run.daemons import run_daemons

        return run_daemons(args)
    if args.command == "keys":
        return _generate_keys(args)
    if args.command == "status":
        from eventbus.runtime.worker import bus_status

        problem = server_problem(args.address)  # a local address nobody serves: said at once, not after --timeout
        if problem is not None:
            print(f"eventbus status: no trainer serves {args.address}: {problem}{ended_run_hint(args.address)}",
                  file=sys.stderr)
            return 1
        return asyncio.run(bus_status(args.address, args.subscriber, args.timeout))
    if args.command == "proxy":
        return _run_proxy(args)
    if args.command == "replay":
        return _run_replay(args)
    if args.command == "export":
        from eventbus.export import ExportOptions, export

        return export(ExportOptions(args.journal, args.to, args.output, args.mlflow_uri, args.resume, args.follow))
    raise ConfigError(f"unknown command {args.command!r}")


def _generate_keys(args: argparse.Namespace) -> int:
    from eventbus.bus.security import generate_keys

    folder: pathlib.Path = args.directory
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{str(folder)!r} exists and is not a directory")
    try:
        paths = generate_keys(folder, args.name)
    except OSError as err:  # an unwritable place (/proc/x, a read-only disk): say where, not a traceback
        raise ConfigError(f"cannot write keys into {str(folder)!r}: {err.strerror or err}") from None
    for path in paths:
        print(path)
    return 0


def _worker_callbacks(args: argparse.Namespace) -> list[Callback]:
    """``--callback`` specs as callback objects (fresh ones per call: ``--follow`` builds them per run)."""
    from eventbus.runtime.loading import load_callback

    return [load_callback(spec) for spec in args.callback]


def _run_replay(args: argparse.Namespace) -> int:
    from eventbus.bus.journal import JOURNAL_NAME
    from eventbus.runtime.loading import load_callback
    from eventbus.runtime.worker import replay_journal

    if args.journal.is_dir():  # a run folder: its journal
        if not (args.journal / JOURNAL_NAME).is_file():
            raise ConfigError(f"{str(args.journal)!r} is a folder without a journal ({JOURNAL_NAME})")
        args.journal = args.journal / JOURNAL_NAME
    if not args.journal.is_file():
        raise ConfigError(f"journal {str(args.journal)!r} does not exist")
    callbacks = [load_callback(spec) for spec in args.callback]
    print(f"eventbus replay: {asyncio.run(_which_run(args.journal))} from {args.journal}", file=sys.stderr,
          flush=True)
    return asyncio.run(replay_journal(str(args.journal), callbacks, fail_fast=args.fail_fast))


async def _which_run(journal: pathlib.Path) -> str:
    """The run a journal replay shows (the first one the journal holds), by name and id."""
    from eventbus.bus.subscribe.journal_stream import journal_messages

    async for message in journal_messages(journal):
        return f"replaying run {message.state.run_name} (id {message.run_id})"
    return "replaying an empty journal"


def _run_proxy(args: argparse.Namespace) -> int:
    import os

    from eventbus.bus.proxy import RankProxy, discover_ranks
    from eventbus.bus.security import ClientKeys, ServerKeys

    client_keys = ClientKeys.from_environment()
    secret, allowed = os.environ.get("EVENTBUS_SERVER_SECRET_KEY"), os.environ.get("EVENTBUS_AUTHORIZED_KEYS")
    server_keys = ServerKeys(secret, allowed) if secret and allowed else None
    ranks = discover_ranks(args.connect, client_keys, args.wait)
    proxy = RankProxy(ranks, args.bind, server_keys=server_keys, client_keys=client_keys)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proxy.stop())
    print(f"eventbus proxy: {len(ranks)} ranks on {args.bind} (requests on {proxy.service_address})",
          file=sys.stderr, flush=True)
    proxy.run()
    refused = proxy.bad_requests + proxy.refused_requests
    print(f"eventbus proxy: stopped; {proxy.forwarded_requests} requests forwarded, {refused} refused "
          f"({proxy.refused_requests} needed an authenticated client)", file=sys.stderr, flush=True)
    return 0


def command() -> int:
    """The ``eventbus`` console script: :func:`main` on this process's arguments, then a quick exit."""
    from eventbus.runtime.program_exit import without_final_collection

    return without_final_collection(main())


if __name__ == "__main__":
    sys.exit(command())
