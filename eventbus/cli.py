"""The ``eventbus`` command: one subcommand per thing a user does."""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import sys
from typing import Optional, Sequence

from eventbus.errors import ConfigError, EventBusError

__all__ = ["main", "OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments: one line naming the problem (``--help`` shows the rest), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="eventbus",
        description="Composer-style training whose callbacks run in subscriber processes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=OneLineErrorParser)

    from eventbus.daemons.job import add_run_arguments

    run = commands.add_parser("run", help="train the bundled character-level model with the daemons (the main job)",
                              description="Train a small character-level Transformer on Python's bundled "
                                          "documentation text, with the logging, timing and checkpoint daemons "
                                          "as child processes. Results go to runs/<run_name>/.")
    add_run_arguments(run)

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
    worker.add_argument("--follow", action="store_true",
                        help="keep going when the run ends: follow the next run on the same address with fresh "
                             "callbacks (a restarted trainer)")

    monitor = commands.add_parser(
        "monitor", help="attach a live terminal dashboard to a run (or show a finished run's journal)",
        description="A live dashboard of a running trainer; attaching and detaching has no effect on the run.",
        add_help=False)
    monitor.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

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
    generate.add_argument("--name", help="write only this pair")

    status = commands.add_parser("status", help="ask a running trainer for its bus statistics",
                                 description="Print the publisher's counters and its live subscribers as JSON; "
                                             "exit 0 if it answered (a healthcheck), 1 if not.")
    status.add_argument("address", help="the trainer's bus address")
    status.add_argument("--subscriber", action="append", default=[],
                        help="also require that this subscriber identity sent a heartbeat recently")
    status.add_argument("--timeout", type=float, default=3.0)

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
    proxy.add_argument("--wait", type=float, default=300.0, metavar="SECONDS",
                       help="how long to wait for rank 0 to answer (default: 300)")

    replay = commands.add_parser("replay", help="run callbacks over a run's journal",
                                 description="Run callbacks over a finished or running run's events.journal.")
    replay.add_argument("journal", type=pathlib.Path, help="path to events.journal")
    replay.add_argument("--callback", action="append", required=True, metavar="SPEC",
                        help="module:Class, path/to/file.py:Class, optionally :{json kwargs}; repeatable")
    replay.add_argument("--fail-fast", action="store_true", help="stop at the first callback exception")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        if args.command == "run":
            from eventbus.daemons.job import run_job

            return run_job(args)
        if args.command == "worker":
            from eventbus.daemons.worker import load_callback, run_worker

            specs = args.callback
            make = lambda: [load_callback(spec) for spec in specs]  # noqa: E731  (fresh objects per run)
            make()  # a bad spec fails now, not at the first event
            return asyncio.run(run_worker(args.connect, make, identity=args.identity,
                                          state_dir=args.state_dir, start=args.start, events=args.events,
                                          fail_fast=args.fail_fast, journal=args.journal, follow=args.follow))
        if args.command == "monitor":
            from eventbus.monitor.dashboard import main as monitor_main

            return monitor_main(args.rest)
        if args.command == "keys":
            from eventbus.bus.security import generate_keys

            for path in generate_keys(args.directory, args.name):
                print(path)
            return 0
        if args.command == "status":
            from eventbus.daemons.worker import bus_status

            return asyncio.run(bus_status(args.address, args.subscriber, args.timeout))
        if args.command == "proxy":
            return _run_proxy(args)
        if args.command == "replay":
            from eventbus.daemons.worker import load_callback, replay_journal

            if not args.journal.is_file():
                raise ConfigError(f"journal {str(args.journal)!r} does not exist")
            callbacks = [load_callback(spec) for spec in args.callback]
            return asyncio.run(replay_journal(str(args.journal), callbacks, fail_fast=args.fail_fast))
    except EventBusError as err:
        print(f"eventbus {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eventbus {args.command}: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


def _run_proxy(args: argparse.Namespace) -> int:
    import os
    import signal

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
    print(f"eventbus proxy: stopped; {proxy.forwarded_requests} requests forwarded, {proxy.bad_requests} refused",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
