"""``eventbus export``: write a run's journal into a tracker, resumable and idempotent.

Every message is written to the journal before it is sent, so the journal holds all
that any subscriber saw: a tracker that was down during training, or never attached,
catches up afterwards from it::

    eventbus export runs/my-run --to tensorboard
    eventbus export runs/my-run --to mlflow --mlflow-uri http://mlflow:5000
    eventbus export runs/my-run/events.journal --to jsonl --follow   # a live run, until its end

How: the destination is the same LoggerDestination the logger daemon hosts
(``eventbus.trackers``), run by the same :class:`~eventbus.runtime.host.CallbackHost`
over the journal's messages; nothing here talks to the trainer.

Nothing lost, nothing doubled, on two levels:

* **Cursor** (``.eventbus-export-<target>.json`` beside the output): the host
  commits the last applied seq and the destination's ``state_dict()`` together;
  just before each commit the destination is flushed (``flush()``), so everything up to the
  committed seq is on disk (or at the server). ``--resume`` continues after it.
* **Read-back**: the export asks the destination what it already holds
  (:meth:`~eventbus.core.logger.LoggerDestination.held_steps`,
  ``holds_hyperparameters``) and skips those points: (tag, step) pairs in the
  TensorBoard event files, each key's metric history in the MLflow run, each key's
  steps in ``metrics.jsonl``. This covers what the cursor cannot: points written after
  the last commit by an export that was killed, and points a live logger already
  delivered. So a plain rerun (without ``--resume``) re-reads the journal but
  sends nothing new, and a ``--resume`` after a SIGKILL sends each point exactly
  once. W&B cannot tell per key; :class:`~eventbus.trackers.wandb.WandBLogger`
  reads itself back (the W&B run's id is the eventbus run id; it skips every step
  at or below the last one W&B has).

Exit codes: 0 done; 1 the tracker failed, or did not take everything (down: its backlog
is kept in the cursor, and ``--resume`` sends it first); 2 bad usage (unknown target,
no journal); 3 the journal is damaged or of another version, or holds records or values that cannot be exported
(not valid messages, metrics that are not a map, a step that is not an integer, a metric whose value is a map, a
list or anything else that is not a number, a bool, text or null:
:func:`~eventbus.trackers.points.metric_value_problem`, the same check for every
target): every other record and value was exported, and one line counts and
names what was lost or skipped. A skipped record or value is never handed to
the tracker, so ``--resume`` goes past it too.
``--follow`` polls the journal for new records (a live run) until the run's end
message, or SIGINT/SIGTERM: both stop cleanly with the cursor committed (exit 130: continue with
``--resume``); or until the trainer is gone (exit 4, after one line: no new record and no answer to a
ping for :data:`~eventbus.export.trainer.TRAINER_SILENT` seconds; a killed trainer writes no end message).
An output folder holds one run's points (read back by step), so another run's export there is refused (exit 2).

Said, not failed (exit 0, one line each): values the tracker cannot hold (text in TensorBoard, a name
MLflow rejects, a metric named ``step`` in metrics.jsonl), counted and named by the tracker; a journal
read to its end whose run has no end message (cut short, the trainer died, or still running): where it
ends. Neither is damage to the journal: it still holds the values, and what it holds was exported whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import pathlib
import signal
import sys
import time
from typing import Any, Callable, Optional

from eventbus.bus.journal import JOURNAL_NAME, segment_paths
from eventbus.bus.schema import Kind
from eventbus.bus.subscribe.journal_stream import JournalStream, damage_summary, journal_messages
from eventbus.bus.subscribe.messages import Message
from eventbus.core.events import Event
from eventbus.core.logger import Logger, LoggerDestination, to_number
from eventbus.errors import ConfigError
from eventbus.export.progress import Progress
from eventbus.export.trainer import TrainerWatch
from eventbus.runtime.cursor import Cursor
from eventbus.runtime.host import CallbackHost, ReportedFailure
from eventbus.trackers.outbox import unsent
from eventbus.trackers.points import Refused, metric_value_problem

__all__ = ["TARGETS", "ExportOptions", "export", "resolve_journal"]

TARGETS = ("tensorboard", "mlflow", "wandb", "csv", "jsonl")
POLL_SECONDS = 0.2  # --follow: how often a live journal is looked at for new records
_NAME = "_Exporting"  # the wrapper's name in the cursor file


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    journal: pathlib.Path
    target: str
    output: Optional[pathlib.Path] = None
    mlflow_uri: Optional[str] = None
    resume: bool = False
    follow: bool = False


def resolve_journal(path: pathlib.Path) -> pathlib.Path:
    """The journal itself, given it or its run folder; ConfigError (exit 2) when there is none."""
    journal = path / JOURNAL_NAME if path.is_dir() else path
    if not segment_paths(journal):
        raise ConfigError(f"no journal at {str(path)!r} (expected a run folder or its {JOURNAL_NAME})")
    return journal


# ---------------------------------------------------------------------------------------- destinations


@dataclasses.dataclass
class _Target:
    """What one export writes into: the destination, and where it is."""

    destination: LoggerDestination
    where: str  # for the summary line
    cursor_dir: pathlib.Path
    cursor_key: str = ""  # distinguishes two destinations of one target kind sharing cursor_dir
    # The targets whose cursors in cursor_dir speak for the files this one writes, which hold one run
    # (their points are read back by step alone); empty: the tracker keeps each run apart (MLflow, W&B).
    one_run: tuple[str, ...] = ()


def build_target(options: ExportOptions, run_folder: pathlib.Path, state: Any) -> _Target:
    """The destination for ``options.target`` (its package imported only now)."""
    builder = _BUILDERS.get(options.target)
    if builder is None:
        raise ConfigError(f"unknown export target {options.target!r} (choose from {', '.join(TARGETS)})")
    return builder(options, run_folder, state)


def _files(options: ExportOptions, run_folder: pathlib.Path, state: Any) -> _Target:
    from eventbus.trackers.files import MetricsFileLogger

    folder = options.output or run_folder
    return _Target(MetricsFileLogger(folder), str(folder / f"metrics.{options.target}"), folder,
                   one_run=("jsonl", "csv"))


def _tensorboard(options: ExportOptions, run_folder: pathlib.Path, state: Any) -> _Target:
    _require("torch.utils.tensorboard", "tensorboard")
    from eventbus.trackers.tensorboard import TensorBoardLogger

    folder = options.output or run_folder / "tensorboard"
    return _Target(TensorBoardLogger(folder), str(folder), folder, one_run=("tensorboard",))


def _mlflow(options: ExportOptions, run_folder: pathlib.Path, state: Any) -> _Target:
    _require("mlflow.tracking", "mlflow")
    from eventbus.trackers.mlflow import MLflowLogger

    folder = options.output or run_folder
    uri = options.mlflow_uri or (folder / "mlruns").resolve().as_uri()
    return _Target(MLflowLogger(uri), uri, folder, _digest(uri))


def _wandb(options: ExportOptions, run_folder: pathlib.Path, state: Any) -> _Target:
    module = _require("eventbus.trackers.wandb", "wandb")
    _require("wandb", "wandb")
    folder = options.output or run_folder
    logger = module.WandBLogger(init_kwargs={"dir": str(options.output)} if options.output else None)
    return _Target(logger, f"W&B run {getattr(state, 'run_id', '?')}", folder)  # the eventbus run's id


_BUILDERS: dict[str, Callable[[ExportOptions, pathlib.Path, Any], _Target]] = {
    "csv": _files, "jsonl": _files, "tensorboard": _tensorboard, "mlflow": _mlflow, "wandb": _wandb}


def _require(module: str, extra: str) -> Any:
    """Import a tracker's module now; missing: a one-line ConfigError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"exporting to {extra} needs {err.name or module}: "
                          f"pip install 'eventbus[{extra}]'") from None


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:10]


@dataclasses.dataclass
class _Counts:
    """What the export did, for the progress bar and the summary line."""

    messages: int = 0  # read from the journal
    points: int = 0  # metric values handed to the tracker
    present: int = 0  # metric values skipped: already in the tracker
    steps: set[int] = dataclasses.field(default_factory=set)
    # Metric values no target takes (metric_value_problem): skipped, counted, named in the last line.
    unexportable: Refused = dataclasses.field(default_factory=lambda: Refused("export", quiet=True))


class _Exporting(LoggerDestination):
    """Wraps the tracker's destination: skips what it already holds (:meth:`LoggerDestination.held_steps`),
    flushes it before each commit, and initialises it on a resumed export whose INIT lies before the
    cursor (the host skips it)."""

    def __init__(self, inner: LoggerDestination, first_state: Any, counts: _Counts):
        self.inner = inner
        self._state = first_state
        self._counts = counts
        self._ready = False
        self._backlog = False  # the cursor restored items the tracker has not taken yet
        self.interrupted = False  # set on SIGINT/SIGTERM

    def _ensure_ready(self, logger: Any = None) -> None:
        if not self._ready:
            self._ready = True
            self.inner.init(self._state, logger)

    def run_event(self, event: Event, state: Any, logger: Logger) -> None:
        self._state = state
        if event is Event.INIT:
            self._ready = True  # the inner init runs just below, with the INIT snapshot
        else:
            self._ensure_ready(logger)
        self.inner.run_event(event, state, logger)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._ensure_ready()
        if not self.inner.holds_hyperparameters():
            self.inner.log_hyperparameters(hyperparameters)

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._ensure_ready()
        at = int(step or 0)
        problems = {key: problem for key, value in metrics.items() if (problem := metric_value_problem(value))}
        for key, problem in problems.items():
            self._counts.unexportable.note(key, at, problem)
        try:
            fresh = {k: v for k, v in metrics.items()
                     if k not in problems and at not in (self.inner.held_steps(k) or ())}
        except Exception as err:  # its server, asked what it holds, is down: the failure line says so
            raise ReportedFailure(str(err)) from err
        self._counts.present += _numbers(metrics) - _numbers(fresh)
        metrics = fresh
        if metrics:
            self.inner.log_metrics(metrics, step)
            self._counts.points += _numbers(metrics)
            self._counts.steps.add(at)

    def flush(self) -> None:
        """Called by the host right before it commits the cursor, so the commit holds."""
        if self._ready:
            self.inner.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))
        self._backlog = unsent(self.inner)[0] > 0

    def close(self, state: Any, logger: Logger) -> None:
        """Close the tracker at the end of the run; after a signal only flush it: what it holds back
        (MetricsFileLogger's pending steps) stays in the committed cursor for ``--resume``. A backlog
        the cursor restored (a tracker that was down) is sent now even when no message is left to apply."""
        if not self._ready and not self._backlog:
            return
        self._ensure_ready(logger)
        if self.interrupted:
            self.flush()
            return
        self.inner.close(state if state is not None else self._state, logger)

    def post_close(self) -> None:
        self.inner.post_close()


def _numbers(metrics: dict[str, Any]) -> int:
    """How many values a tracker stores from ``metrics`` (numbers; not booleans)."""
    return sum(1 for v in metrics.values()
               if isinstance(to_number(v), (int, float)) and not isinstance(to_number(v), bool))


# ---------------------------------------------------------------------------------------- the command


def export(options: ExportOptions) -> int:
    """Run one export; the exit code (see the module docstring). ConfigError: bad usage (exit 2)."""
    journal = resolve_journal(options.journal)
    first = asyncio.run(_first_message(journal, options.follow))
    if first is None:  # nothing readable: an empty journal, or one whose every record is lost or unread
        lost = damage_summary(journal)
        said = f"holds no message it can read: {lost}" if lost else "holds no message yet"
        print(f"eventbus export: {journal} {said}; nothing to export", file=sys.stderr)
        return 3 if lost else 0
    target = build_target(options, journal.parent, first.state)
    if (refusals := getattr(target.destination, "refused", None)) is not None:
        refusals.quiet = True  # said once in the closing lines, not as a log line per key meanwhile
    cursor, start = _open_cursor(target, options, journal, first)
    counts = _Counts()
    progress = Progress(journal, counts)
    stream = JournalStream(journal, follow=options.follow, through_restarts=True, on_message=progress.message,
                           on_caught_up=_following)
    watch = TrainerWatch(stream) if options.follow else None  # a trainer killed writes no end: not waited for ever
    wrapper = _Exporting(target.destination, start.state, counts)
    done_before = [0]  # messages the cursor counts as exported
    started = time.perf_counter()
    try:
        messages = _after_cursor(stream, cursor, start.run_id, done_before, watch)
        failure = asyncio.run(_run(wrapper, cursor, stream, messages, watch))
    finally:
        progress.close()
    if failure is None and _NAME in cursor.seqs:  # what closing the tracker left (a backlog) is kept too
        cursor.record(str(cursor.run_id), _NAME, cursor.seqs[_NAME], wrapper.state_dict(), ended=_NAME in cursor.ended)
    seconds = time.perf_counter() - started
    before = f" ({done_before[0]} exported before)" if done_before[0] else ""
    held = f" ({counts.present} skipped: their key already held a value at that step)" if counts.present else ""
    summary = (f"{counts.messages} messages{before}, {counts.points} metric points over {len(counts.steps)} steps"
               f"{held} in {seconds:.1f}s to {options.target} {target.where}")
    if isinstance(failure, ReportedFailure) and failure.__cause__ is not None:
        failure = failure.__cause__  # the tracker's own error, named in the line
    if failure is not None:
        print(f"eventbus export: {options.target} failed: {type(failure).__name__}: {str(failure)[:300]}; "
              f"{summary} before that (continue with --resume)", file=sys.stderr)
        return 1
    if wrapper.interrupted:
        print(f"eventbus export: interrupted; {summary}; committed up to seq {cursor.seqs.get(_NAME, 0)} "
              f"(continue with --resume)", file=sys.stderr, flush=True)
        return 130  # not "done": ``export ... && upload`` must not take a part for the whole
    items, values = unsent(target.destination)
    if items:
        print(f"eventbus export: {options.target} did not take {values} metric points ({items} items); {summary}; "
              f"they are kept in {cursor.path} (send them with --resume)", file=sys.stderr, flush=True)
        return 1
    print(f"eventbus export: {summary}", file=sys.stderr, flush=True)
    refused = getattr(target.destination, "refused", None)
    if refused is not None and refused.summary() is not None:
        print(f"eventbus export: {refused.summary()}", file=sys.stderr, flush=True)
    if watch is not None and watch.lost is not None:
        print(f"eventbus export: {watch.lost}; every record it wrote was exported (if the run is resumed, "
              "continue with --follow --resume)", file=sys.stderr, flush=True)
        return _check(journal, stream, counts.unexportable) or 4
    unfinished = stream.unfinished()
    if unfinished is not None:
        print(f"eventbus export: {unfinished}", file=sys.stderr, flush=True)
    return _check(journal, stream, counts.unexportable)


def _following(seq: int) -> None:
    print(f"eventbus export: caught up with the live run at seq {seq}; following it until its end",
          file=sys.stderr, flush=True)


def _check(journal: pathlib.Path, stream: JournalStream, unexportable: Refused) -> int:
    """3 with one line naming what the journal lost or what could not be exported (as
    ``eventbus replay`` says it), else 0."""
    values = None
    if unexportable.count:
        more = ", ..." if unexportable.count > len(unexportable.named) else ""
        values = (f"{unexportable.count} metric value(s) that no tracker takes skipped "
                  f"({'; '.join(unexportable.named)}{more})")
    lost = [line for line in (damage_summary(journal), stream.skipped.summary(), values) if line is not None]
    if lost:
        print(f"eventbus export: {journal}: {'; '.join(lost)} (every other record was exported)", file=sys.stderr)
        return 3
    return 0


async def _first_message(journal: pathlib.Path, follow: bool, run_id: Optional[str] = None) -> Optional[Message]:
    """The journal's first message (its run's header: run id, run name, folder), or run ``run_id``'s
    (None: the journal holds no such run); with ``follow``, waited for until the trainer has written it."""
    while True:
        async for message in journal_messages(journal):
            if run_id in (None, message.run_id):
                return message
        if not follow or run_id is not None:
            return None
        await asyncio.sleep(POLL_SECONDS)


def _open_cursor(target: _Target, options: ExportOptions, journal: pathlib.Path,
                 first: Message) -> tuple[Cursor, Message]:
    """The export's cursor, and the first message of its run: kept with ``--resume`` when its run is
    one of the journal's (a run resumed into its folder adds one), else started afresh at ``first``."""
    name = f".eventbus-export-{options.target}{'-' + target.cursor_key if target.cursor_key else ''}.json"
    path = target.cursor_dir / name
    try:
        target.cursor_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot write into {str(target.cursor_dir)!r}: {err.strerror or err}") from None
    _refuse_another_run(target, journal, first)
    if path.exists() and options.resume:
        cursor = Cursor(path)
        if cursor.run_id in (None, first.run_id):
            return cursor, first
        start = asyncio.run(_first_message(journal, False, cursor.run_id))
        if start is not None:
            return cursor, start
        print(f"eventbus export: {path} is about another run ({cursor.run_id}); starting from the beginning",
              file=sys.stderr)
    elif options.resume:
        print(f"eventbus export: no earlier export to resume ({path} is absent); starting from the beginning",
              file=sys.stderr)
    path.unlink(missing_ok=True)
    return Cursor(path), first


def _refuse_another_run(target: _Target, journal: pathlib.Path, first: Message) -> None:
    """ConfigError when the output holds an export of a run that is not one of the journal's: the
    read-back knows steps, not runs, so this run's points at those steps would be dropped as held."""
    for kind in target.one_run:
        other = Cursor(target.cursor_dir / f".eventbus-export-{kind}.json").run_id
        if other not in (None, first.run_id) and asyncio.run(_first_message(journal, False, other)) is None:
            raise ConfigError(f"{str(target.cursor_dir)!r} holds an export of another run (id {other}), not of "
                              f"{first.state.run_name} (id {first.run_id}, {journal}): exporting it there would mix "
                              "the two runs; give it another --output")


async def _after_cursor(stream: JournalStream, cursor: Cursor, run_id: str, done: list[int],
                        watch: Optional[TrainerWatch]) -> Any:
    """The stream from the cursor's run on: the runs before it in the journal were exported whole
    (the host skips the cursor's run up to its seq). ``done[0]`` counts the messages exported before;
    ``watch`` learns each run header's trainer."""
    seq, reached = (cursor.seqs.get(_NAME, 0) if cursor.run_id == run_id else 0), False
    async for message in stream.messages():
        if watch is not None and message.kind == Kind.HEADER:
            watch.header(message.fields)
        reached = reached or message.run_id == run_id
        if not reached or (message.run_id == run_id and message.seq <= seq):
            done[0] += 1
        if reached:
            yield message


async def _run(wrapper: _Exporting, cursor: Cursor, stream: JournalStream, messages: Any,
               watch: Optional[TrainerWatch] = None) -> Optional[BaseException]:
    """Host the destination over the stream (``watch``: the trainer asked while it is quiet); the tracker's
    exception if it failed (committed up to it)."""
    host = CallbackHost([wrapper], fail_fast=True, cursor=cursor)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        wrapper.interrupted = True
        stream.stopping.set()
        host.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    watching = asyncio.create_task(watch.run()) if watch is not None else None
    try:
        await host.run(messages)
    except ConfigError:
        raise
    except Exception as err:  # the tracker's own error (its client, its server, its disk)
        return err
    finally:
        if watching is not None:
            watching.cancel()
    return None
