"""The checkpoint worker: writes the checkpoints the trainer staged, off the training thread.

``CheckpointSaver`` follows Composer's arguments. Out of process it asks the
trainer (over the control channel) to stage a checkpoint at each due
``*_CHECKPOINT`` event and at the end of training; the trainer copies its state
into shared memory and carries on; this worker maps that memory (or, on
another host, fetches it as one zero-copy frame), writes the file (temporary
name, fsync, rename, then the ``latest`` link), applies retention, and
acknowledges so the buffer can be reused. A failed write (disk full,
permission denied) is acknowledged with the reason: the trainer logs it and
re-publishes it as ``checkpoint/error``; earlier checkpoints are untouched, and
later ones are still tried. The daemon then exits 1 at the end of the run.

In process (``Trainer(callbacks=[CheckpointSaver(...)])``) it writes on the
training thread, as Composer does.

    python -m eventbus.workers.checkpoint --connect ipc://runs/my-run/bus --save-interval 100ba
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shutil
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

from eventbus import Callback, Event, Time
from eventbus.checkpoint.files import remove_stale_temp_files, save_atomically, save_sharded_atomically
from eventbus.checkpoint.handle import TRANSFERS
from eventbus.checkpoint.naming import FILENAME, FOLDER, LATEST_FILENAME, check_templates
from eventbus.checkpoint.remote import is_url, parse_storage_options
from eventbus.checkpoint.retention import MODES, Retention, parse_monitor
from eventbus.checkpoint.uploads import Uploader
from eventbus.core.atomic import temp_name
from eventbus.core.interval import interval_scheduler
from eventbus.core.logger import Logger
from eventbus.core.run_folder import announced_run_folder
from eventbus.errors import ConfigError
from eventbus.runtime.console import say_line
from eventbus.runtime.daemon import OneLineErrorParser, add_daemon_arguments, check_positive, run_daemon

__all__ = ["CheckpointSaver", "main"]

_FAILED_NAMED = 10  # the batches of failed writes named in the closing line (they are counted, not kept, after)

log = logging.getLogger(__name__)
# At FIT_END the worker waits this long for queued uploads (inside the trainer's 30 s drain_timeout).
UPLOADS_AT_FIT_END_SECONDS = 20.0
# Stopped mid-run (SIGTERM, Ctrl-C), the worker waits at most this long for an upload in flight.
UPLOADS_AT_STOP_SECONDS = 5.0


def _format(template: str, state: Any, rank: int, **extra: Any) -> str:
    ts = state.timestamp
    return template.format(
        run_name=state.run_name, rank=rank, epoch=int(ts.epoch), batch=int(ts.batch), sample=int(ts.sample),
        token=int(ts.token), batch_in_epoch=int(ts.batch_in_epoch), **extra)


class CheckpointSaver(Callback):
    """Composer's CheckpointSaver: periodic checkpoints, a ``latest`` link, retention, object stores.

    ``folder`` is relative to the run folder's parent (``runs/`` by default), so the
    default ``{run_name}/checkpoints`` lands in ``runs/<run_name>/checkpoints``. A URL
    (``s3://bucket/{run_name}/checkpoints``, any fsspec URL) is where checkpoints are
    uploaded after their local write into ``{run_name}/checkpoints``; retention applies there too.
    ``save_interval`` is a Time, a string like ``"1ep"`` or ``"100ba"``, or (in
    process only) a callable ``(state, event) -> bool``; a checkpoint is also
    saved at the end of training, and never twice for the same batch.
    ``num_checkpoints_to_keep`` keeps the newest N; ``keep_best`` also keeps the K best by
    ``monitor`` (``metrics/<label>/<Name>``, ``mode`` max or min). Each durable save is logged
    as ``checkpoint/saved/{path,batch,bytes,seconds}``. While uploads fail or lag behind the saves,
    at most ``upload_backlog`` checkpoints that retention let go are kept locally for their upload;
    the oldest beyond that is dropped (``checkpoint/upload_backlog_dropped``).
    """

    captures = frozenset({"checkpoint"})
    # Out of process it writes what the trainer staged, and nothing at a checkpoint event without a
    # checkpoint: its worker is sent only the checkpoint events that carry one.
    staged_checkpoints_only = True

    def __init__(
        self,
        folder: str = FOLDER,
        filename: str = FILENAME,
        latest_filename: Optional[str] = LATEST_FILENAME,
        save_interval: Union[str, int, Time, Callable[[Any, Event], bool]] = "1ep",
        num_checkpoints_to_keep: int = -1,
        overwrite: bool = False,
        weights_only: bool = False,
        runs_dir: Optional[Union[str, os.PathLike]] = None,
        transfer: str = "auto",
        keep_best: int = 0,
        monitor: Optional[str] = None,
        mode: str = "max",
        storage_options: Optional[dict[str, Any]] = None,
        upload_attempts: int = 5,
        upload_backlog: int = 4,
    ):
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}, got {transfer!r}")
        if keep_best > 0 and not monitor:
            raise ConfigError("keep-best needs a monitor: the metric to rank checkpoints by")
        # Refused now, not at the first save or upload (or never, leaving a run without checkpoints).
        check_templates(folder, filename, latest_filename)
        if num_checkpoints_to_keep != -1:  # -1 keeps all; 0 would remove each checkpoint once written
            check_positive("keep (-1 for all)", num_checkpoints_to_keep)
        check_positive("upload-attempts", upload_attempts)
        check_positive("upload-backlog", upload_backlog, zero_ok=True)
        self._monitor = parse_monitor(monitor) if monitor else None
        self.remote_folder = folder if is_url(folder) else None
        self.folder = FOLDER if self.remote_folder else folder
        self.filename = filename
        self.latest_filename = latest_filename
        self.save_interval = save_interval
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.overwrite = overwrite
        self.weights_only = weights_only
        self.runs_dir = runs_dir
        self.transfer = transfer
        self.retention = Retention(num_checkpoints_to_keep, keep_best, mode)
        self.last_batch_saved = -1
        self.failures = 0  # staged checkpoints not written...
        self.failed: list[int] = []  # ...and the batches of the first _FAILED_NAMED of them
        self._due = interval_scheduler(save_interval, name="save_interval", batch_event=Event.BATCH_CHECKPOINT,
                                       epoch_event=Event.EPOCH_CHECKPOINT)
        self._cleaned: set[pathlib.Path] = set()  # folders whose stale temporary files were removed
        self._uploads = Uploader(storage_options, attempts=upload_attempts, report=self._report,
                                 backlog=upload_backlog) \
            if self.remote_folder else None
        self._fit_ended = False
        self._logger: Optional[Logger] = None  # out of process: where upload results are reported
        self._lock = threading.Lock()  # retention state: the callback's thread and state_dict() share it
        if self._uploads is not None and self.remote_folder is not None:
            self._uploads.folder(self.remote_folder.split("{")[0]).probe()  # a bad URL, package, credentials: now

    @property
    def saved(self) -> list[str]:
        """The checkpoints retention keeps, oldest first."""
        return [save.path for save in self.retention.saves]

    @property
    def capture_options(self) -> dict[str, Any]:
        if callable(self.save_interval) and not isinstance(self.save_interval, Time):
            raise ValueError("a callable save_interval works in process only; pass a string like '100ba'")
        return {"save_interval": str(self.save_interval)}

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"saved": self.saved, "last_batch_saved": self.last_batch_saved,
                    "retention": self.retention.state_dict(),
                    "uploads": self._uploads.waiting() if self._uploads is not None else [],
                    "remote_removals": self._uploads.owed() if self._uploads is not None else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_saved = int(state.get("last_batch_saved", -1))
        if "retention" in state:
            self.retention.load_state_dict(state["retention"])
        else:  # written before retention kept batches and values
            self.retention.load_state_dict({"saves": [{"path": p, "batch": -1} for p in state.get("saved", [])]})
        if self._uploads is not None:
            self._uploads.owe(state.get("remote_removals", []))
        # Queued or failed at the stop; oldest first: the newest, uploaded last, is what ``latest`` names.
        for task in sorted(state.get("uploads", []), key=lambda task: int(task["batch"])):
            if self._uploads is not None and os.path.exists(task["local"]):
                self._uploads.upload(task["url"], task["local"], int(task["batch"]), task.get("latest"))
                if task.get("released"):  # retention let it go: removed once uploaded (or kept as the backlog)
                    self._uploads.remove(task["url"], task["local"])

    def fit_start(self, state: Any, logger: Logger) -> None:
        self._fit_ended = False  # a new fit (its worker sees no checkpoint event until one is staged)

    # Out of process the trainer decides *when* (it staged the checkpoint); in process, this does.
    def batch_checkpoint(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.EPOCH_CHECKPOINT)

    def iteration_checkpoint(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.ITERATION_CHECKPOINT)

    def fit_end(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.FIT_END)
        self._fit_ended = True  # until a later checkpoint event: fit() may be called again
        # The trainer ends the run once this event is applied (it waits for that, bounded): the uploads'
        # results must reach it first, or the last one is missing from the journal.
        if self._uploads is not None and not self._uploads.wait_idle(UPLOADS_AT_FIT_END_SECONDS):
            log.warning("uploads still running at the end of training; their results may miss the journal")

    def eval_end(self, state: Any, logger: Logger) -> None:
        """A monitored eval metric's new value, at the batch it was computed: rank the saves it decides."""
        if self._monitor is None or state.dataloader_label != self._monitor[0]:
            return
        value = (state.eval_metric_values.get(self._monitor[0]) or {}).get(self._monitor[1])
        if value is not None:
            with self._lock:
                self.retention.observe(int(state.timestamp.batch), float(value))
            self._prune(state)

    def close(self, state: Any, logger: Logger) -> None:
        """Finish the uploads. After training ended, no metric value is still to come: rank every save.
        (Stopped mid-run, a pending save stays pending: the restarted worker ranks it.)"""
        if self._fit_ended and state is not None:
            with self._lock:
                self.retention.finish()
            self._prune(state)
        if self._uploads is not None:  # stopped mid-run, what is not uploaded yet is in the state: not waited for
            self._uploads.close(None if self._fit_ended else UPLOADS_AT_STOP_SECONDS, last_chance=self._fit_ended)

    def _report(self, metrics: dict[str, Any], step: int) -> None:
        """Upload results, logged out of process only (in process the trainer's logger is not thread-safe)."""
        if self._logger is not None:
            self._logger.log_metrics(metrics, step)

    def _on_checkpoint_event(self, state: Any, logger: Logger, event: Event) -> None:
        self._fit_ended = False
        staged = getattr(state, "checkpoint", None)
        if staged is not None:
            self._write_staged(state, staged, logger)
        elif hasattr(state, "checkpoint_dict") and self._due(state, event):  # in process: the live State
            self._write(state, lambda path: save_atomically(self._chosen(state.checkpoint_dict()), path), logger)

    def _write_staged(self, state: Any, staged: Any, logger: Logger) -> None:
        started = time.perf_counter()
        self._logger = logger
        try:
            path: Optional[pathlib.Path]
            if getattr(staged, "target", None) is not None:
                path = self._write_target(staged, logger, started)
            elif staged.sharded:
                path = self._write(state, lambda folder: save_sharded_atomically(
                    self._chosen(staged.load(self.transfer)), folder), logger, sharded=True, started=started)
            else:  # from the buffer to the file, without torch
                path = self._write(state, lambda path: staged.save(path, self.transfer, self._chosen), logger,
                                   started=started)
        except Exception as err:  # reported to the trainer, which logs and re-publishes it
            log.error("checkpoint at batch %d not written: %s: %s", staged.batch, type(err).__name__, err)
            self.failures += 1
            if len(self.failed) < _FAILED_NAMED:
                self.failed.append(int(staged.batch))
            staged.ack(error=f"{type(err).__name__}: {err}")
            return
        staged.ack(path=str(path) if path else None)

    def _chosen(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What of the checkpoint dict is written: all of it, or the model's weights (``weights_only``)."""
        return {"state": {"model": checkpoint["state"]["model"]}} if self.weights_only else checkpoint

    def _write(self, state: Any, save: Callable[[pathlib.Path], None], logger: Logger, sharded: bool = False,
               started: Optional[float] = None) -> Optional[pathlib.Path]:
        """Write one checkpoint file with ``save(path)`` (a torch.distributed.checkpoint folder when the trainer's
        state is sharded, named like the file without ``-rank{rank}.pt``); None when this batch was saved."""
        started = time.perf_counter() if started is None else started
        batch = int(state.timestamp.batch)
        if batch == self.last_batch_saved:
            return None
        rank = int(getattr(state, "rank", 0))
        path, latest = self._paths(state, rank, sharded)
        if path.exists() and not self.overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        save(path)
        self.last_batch_saved = batch
        if latest is not None:
            self._link_latest(latest, path)
        log.info("saved checkpoint %s", path)
        logger.log_metrics({"checkpoint/saved/path": str(path), "checkpoint/saved/batch": batch,
                            "checkpoint/saved/bytes": _size(path),
                            "checkpoint/saved/seconds": time.perf_counter() - started})
        if self._uploads is not None:
            self._uploads.upload(self._remote_url(state, rank), str(path), batch, latest.name if latest else None)
        with self._lock:
            self.retention.add(str(path), batch)
            if self._monitor is not None and self._monitor[0] == "train":  # computed at this very batch
                value = state.train_metric_values.get(self._monitor[1])
                if value is not None:
                    self.retention.observe(batch, float(value))
        self._prune(state)
        return path

    def _write_target(self, staged: Any, logger: Logger, started: float) -> pathlib.Path:
        """A checkpoint whose trainer chose the path (Lightning's ModelCheckpoint): written there as
        asked, replacing what is there; the trainer's own checkpointing names and rotates its files."""
        path = pathlib.Path(staged.target)
        if staged.format != "torch":
            raise ConfigError(f"staged checkpoint format {staged.format!r} is not one this worker writes (torch)")
        if not path.is_absolute():
            raise ConfigError(f"staged checkpoint target {str(path)!r} is not an absolute path")
        path.parent.mkdir(parents=True, exist_ok=True)
        if staged.sharded:  # every rank's shards, merged into the one file asked for
            save_atomically(staged.load(self.transfer), path)
        else:
            staged.save(path, self.transfer)
        log.info("saved checkpoint %s", path)
        logger.log_metrics({"checkpoint/saved/path": str(path), "checkpoint/saved/batch": staged.batch,
                            "checkpoint/saved/bytes": _size(path),
                            "checkpoint/saved/seconds": time.perf_counter() - started})
        return path

    def _paths(self, state: Any, rank: int, sharded: bool) -> tuple[pathlib.Path, Optional[pathlib.Path]]:
        """The checkpoint's path and its ``latest`` link's, in a folder made (and cleaned) if need be."""
        folder = self._folder(state, rank)
        folder.mkdir(parents=True, exist_ok=True)
        if folder not in self._cleaned:
            # A worker killed mid-write (SIGKILL, OOM) left its temporary file: remove it before writing.
            for stale in remove_stale_temp_files(folder):
                log.info("removed a stale temporary file %s", stale)
            self._cleaned.add(folder)
        path = folder / _format(self.filename, state, rank)
        latest = folder / _format(self.latest_filename, state, rank) if self.latest_filename else None
        if sharded:
            path = path.with_name(path.name.removesuffix(".pt").replace(f"-rank{rank}", ""))
            latest = latest.with_name(latest.name.removesuffix(".pt")) if latest is not None else None
        return path, latest

    def _folder(self, state: Any, rank: int) -> pathlib.Path:
        # The runs dir given, else the one holding the run folder the trainer announced (./runs by default).
        base = pathlib.Path(self.runs_dir) if self.runs_dir is not None else announced_run_folder(state).parent
        return base / _format(self.folder, state, rank)

    def _remote_url(self, state: Any, rank: int) -> str:
        assert self.remote_folder is not None
        return _format(self.remote_folder, state, rank)

    @staticmethod
    def _link_latest(link: pathlib.Path, target: pathlib.Path) -> None:
        """Point ``link`` at ``target`` (relative), replacing any old link atomically."""
        tmp = temp_name(link)  # unpredictable, and os.symlink never replaces what is there
        os.symlink(os.path.relpath(target, link.parent), tmp)
        try:
            os.replace(tmp, link)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _prune(self, state: Any) -> None:
        """Remove what retention no longer keeps: at once locally; with a remote folder, in the upload
        queue (after its upload), remotely and then locally."""
        own = self._folder(state, int(getattr(state, "rank", 0))).resolve()
        with self._lock:
            # Saves of another run, restored with the checkpoint this run started from (load_path): its
            # files, never this run's to count or remove (Composer's saver leaves them too).
            self.retention.saves = [save for save in self.retention.saves
                                    if pathlib.Path(save.path).resolve().is_relative_to(own)]
            gone = self.retention.to_remove()
        for save in gone:
            if self._uploads is not None:
                self._uploads.remove(self._remote_url(state, int(getattr(state, "rank", 0))), save.path)
                log.info("retention: checkpoint %s to be removed once its upload is done", save.path)
            else:
                _remove(pathlib.Path(save.path))
                log.info("retention: removed checkpoint %s", save.path)


def _size(path: pathlib.Path) -> int:
    """Bytes in a checkpoint file, or in a sharded checkpoint's folder."""
    if path.is_dir():
        return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
    return path.stat().st_size


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m eventbus.workers.checkpoint",
        description="Write the checkpoints a trainer stages, off its training thread. Stops at the end of the "
                    "run (after the final checkpoint) or on SIGTERM.")
    add_daemon_arguments(parser, identity="checkpoint")
    parser.add_argument("--save-interval", default="1ep", help="'1ep', '100ba', ... (default: 1ep)")
    parser.add_argument("--folder", default=FOLDER,
                        help=f"folder template under --runs-dir (default: {FOLDER}), or an fsspec URL "
                             "(s3://bucket/{run_name}/checkpoints, gs://..., file://...) to upload each checkpoint "
                             "to after its local write in {run_name}/checkpoints (needs: pip install 'eventbus[s3]')")
    parser.add_argument("--filename", default=FILENAME, help=f"(default: {FILENAME})")
    parser.add_argument("--latest-filename", default=LATEST_FILENAME,
                        help=f"'' for no link (default: {LATEST_FILENAME})")
    parser.add_argument("--runs-dir", help="base folder (default: the parent of the trainer's run folder)")
    parser.add_argument("--keep", type=int, default=-1, help="checkpoints to keep (default: all)")
    parser.add_argument("--keep-best", type=int, default=0, metavar="K",
                        help="also keep the K best checkpoints by --monitor (default: 0, off)")
    parser.add_argument("--monitor", help="the metric --keep-best ranks by, as logged: metrics/<label>/<Name>, "
                                          "e.g. metrics/eval/MulticlassAccuracy")
    parser.add_argument("--mode", choices=MODES, default="max", help="whether higher (max) or lower (min) --monitor "
                                                                      "values are better (default: max)")
    parser.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="an fsspec option for a URL --folder, e.g. endpoint_url=http://127.0.0.1:9000 "
                             "(repeatable)")
    parser.add_argument("--upload-attempts", type=int, default=5,
                        help="tries per remote call, with exponential backoff (default: 5)")
    parser.add_argument("--upload-backlog", type=int, default=4, metavar="N",
                        help="while uploads fail or lag, keep at most N checkpoints that --keep let go for their "
                             "upload, dropping the oldest beyond that with an error (default: 4)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    parser.add_argument("--weights-only", action="store_true", help="save the model weights only")
    parser.add_argument("--transfer", choices=TRANSFERS, default="auto",
                        help="how staged checkpoints reach this worker: 'shm' maps the trainer's /dev/shm (same "
                             "host), 'fetch' receives them over the bus as zero-copy frames (another host); "
                             "'auto' maps when the buffer is visible here (default)")
    return parser


def build_saver(args: argparse.Namespace) -> list[Callback]:
    """The one CheckpointSaver the options describe."""
    saver = CheckpointSaver(folder=args.folder, filename=args.filename, latest_filename=args.latest_filename or None,
                            save_interval=args.save_interval, num_checkpoints_to_keep=args.keep,
                            overwrite=args.overwrite, weights_only=args.weights_only, runs_dir=args.runs_dir,
                            transfer=args.transfer, keep_best=args.keep_best, monitor=args.monitor, mode=args.mode,
                            storage_options=parse_storage_options(args.storage_option),
                            upload_attempts=args.upload_attempts, upload_backlog=args.upload_backlog)
    # No torch: files are written from the staged buffers as torch.save writes them (torch_file). A sharded
    # checkpoint, or a dtype that module does not write, imports it at that save.
    return [saver]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The daemon; exit 1 when a checkpoint was not written (training went on without it), so that
    ``eventbus run`` and a supervisor see it at the end as well as in the log."""
    savers: list[CheckpointSaver] = []

    def build(args: argparse.Namespace) -> list[Callback]:
        callbacks = build_saver(args)
        savers.extend(cb for cb in callbacks if isinstance(cb, CheckpointSaver))
        return callbacks

    code = run_daemon(build_parser(), argv, build)
    failures = sum(saver.failures for saver in savers)
    if code == 0 and failures:
        named = [batch for saver in savers for batch in saver.failed][:_FAILED_NAMED]
        more = ", ..." if failures > len(named) else ""
        say_line(f"checkpoint: {failures} checkpoint{'s' if failures > 1 else ''} not written (at batch "
                 f"{', '.join(map(str, named))}{more}; why is above); exit code 1")
        return 1
    return code


if __name__ == "__main__":
    from eventbus.runtime.program_exit import without_final_collection

    sys.exit(without_final_collection(main()))
