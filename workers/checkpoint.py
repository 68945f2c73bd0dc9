"""The checkpoint worker: writes the checkpoints the trainer staged, off the training thread.

``CheckpointSaver`` follows Composer's arguments. Out of process it asks the
trainer (over the control channel) to stage a checkpoint at each due
``*_CHECKPOINT`` event and at the end of training; the trainer copies its state
into shared memory and carries on; this worker maps that memory (or, on
another host, fetches it as one zero-copy frame), writes the file (temporary
name, fsync, rename, then the ``latest`` link), applies retention, and
acknowledges so the buffer can be reused. A failed write (disk full,
permission denied) is acknowledged with the reason: the trainer logs it and
re-publishes it as ``checkpoint/error``; earlier checkpoints are untouched.

In process (``Trainer(callbacks=[CheckpointSaver(...)])``) it writes on the
training thread, as Composer does.

    python -m workers.checkpoint --connect ipc://runs/my-run/bus --save-interval 100ba
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shutil
import sys
from typing import Any, Callable, Optional, Sequence, Union

from eventbus import Callback, Event, Time
from eventbus.checkpoint.files import remove_stale_temp_files, save_atomically, save_sharded_atomically, temp_name
from eventbus.checkpoint.handle import TRANSFERS
from eventbus.core.interval import interval_scheduler
from eventbus.core.logger import Logger
from eventbus.daemons.runtime import OneLineErrorParser, add_daemon_arguments, run_daemon

__all__ = ["CheckpointSaver", "main"]

log = logging.getLogger(__name__)


def _format(template: str, state: Any, rank: int, **extra: Any) -> str:
    ts = state.timestamp
    return template.format(
        run_name=state.run_name, rank=rank, epoch=int(ts.epoch), batch=int(ts.batch), sample=int(ts.sample),
        token=int(ts.token), batch_in_epoch=int(ts.batch_in_epoch), **extra)


class CheckpointSaver(Callback):
    """Composer's CheckpointSaver: periodic checkpoints, a ``latest`` link, retention.

    ``folder`` is relative to the run folder's parent (``runs/`` by default), so the
    default ``{run_name}/checkpoints`` lands in ``runs/<run_name>/checkpoints``.
    ``save_interval`` is a Time, a string like ``"1ep"`` or ``"100ba"``, or (in
    process only) a callable ``(state, event) -> bool``; a checkpoint is also
    saved at the end of training, and never twice for the same batch.
    """

    captures = frozenset({"checkpoint"})

    def __init__(
        self,
        folder: str = "{run_name}/checkpoints",
        filename: str = "ep{epoch}-ba{batch}-rank{rank}.pt",
        latest_filename: Optional[str] = "latest-rank{rank}.pt",
        save_interval: Union[str, int, Time, Callable[[Any, Event], bool]] = "1ep",
        num_checkpoints_to_keep: int = -1,
        overwrite: bool = False,
        weights_only: bool = False,
        runs_dir: Optional[Union[str, os.PathLike]] = None,
        transfer: str = "auto",
    ):
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}, got {transfer!r}")
        self.folder = folder
        self.filename = filename
        self.latest_filename = latest_filename
        self.save_interval = save_interval
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.overwrite = overwrite
        self.weights_only = weights_only
        self.runs_dir = runs_dir
        self.transfer = transfer
        self.saved: list[str] = []
        self.last_batch_saved = -1
        self._due = interval_scheduler(save_interval, name="save_interval", batch_event=Event.BATCH_CHECKPOINT,
                                       epoch_event=Event.EPOCH_CHECKPOINT)
        self._trainer_state_dict: Optional[Callable[[], dict[str, Any]]] = None
        self._cleaned: set[pathlib.Path] = set()  # folders whose stale temporary files were removed

    @property
    def capture_options(self) -> dict[str, Any]:
        if callable(self.save_interval) and not isinstance(self.save_interval, Time):
            raise ValueError("a callable save_interval works in process only; pass a string like '100ba'")
        return {"save_interval": str(self.save_interval)}

    def state_dict(self) -> dict[str, Any]:
        return {"saved": list(self.saved), "last_batch_saved": self.last_batch_saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = list(state.get("saved", []))
        self.last_batch_saved = int(state.get("last_batch_saved", -1))

    # Out of process the trainer decides *when* (it staged the checkpoint); in process, this does.
    def batch_checkpoint(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.EPOCH_CHECKPOINT)

    def iteration_checkpoint(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.ITERATION_CHECKPOINT)

    def fit_end(self, state: Any, logger: Logger) -> None:
        self._on_checkpoint_event(state, logger, Event.FIT_END)

    def _on_checkpoint_event(self, state: Any, logger: Logger, event: Event) -> None:
        staged = getattr(state, "checkpoint", None)
        if staged is not None:
            self._write_staged(state, staged, logger)
        elif hasattr(state, "state_dict") and self._due(state, event):
            self._write(state, state.state_dict(), logger)  # in process: the live State

    def _write_staged(self, state: Any, staged: Any, logger: Logger) -> None:
        try:
            path = self._write(state, staged.load(self.transfer), logger, sharded=staged.sharded)
        except Exception as err:  # reported to the trainer, which logs and re-publishes it
            log.error("checkpoint at batch %d not written: %s: %s", staged.batch, type(err).__name__, err)
            staged.ack(error=f"{type(err).__name__}: {err}")
            return
        staged.ack(path=str(path) if path else None)

    def _write(self, state: Any, checkpoint: dict[str, Any], logger: Logger,
               sharded: bool = False) -> Optional[pathlib.Path]:
        """Write one checkpoint file (a torch.distributed.checkpoint folder when the trainer's state
        is sharded, named like the file without ``-rank{rank}.pt``); None when this batch was saved."""
        batch = int(state.timestamp.batch)
        if batch == self.last_batch_saved:
            return None
        rank = int(getattr(state, "rank", 0))
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
        if path.exists() and not self.overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        if self.weights_only:
            checkpoint = {"state": {"model": checkpoint["state"]["model"]}}
        (save_sharded_atomically if sharded else save_atomically)(checkpoint, path)
        self.last_batch_saved = batch
        if latest is not None:
            self._link_latest(latest, path)
        self.saved.append(str(path))
        self._apply_retention()
        log.info("saved checkpoint %s", path)
        return path

    def _folder(self, state: Any, rank: int) -> pathlib.Path:
        base = pathlib.Path(self.runs_dir) if self.runs_dir is not None else None
        if base is None:
            header = getattr(state, "header", None) or {}
            run_folder = header.get("run_folder")
            base = pathlib.Path(run_folder).parent if run_folder else pathlib.Path("runs")
        return base / _format(self.folder, state, rank)

    @staticmethod
    def _link_latest(link: pathlib.Path, target: pathlib.Path) -> None:
        """Point ``link`` at ``target`` (relative), replacing any old link atomically."""
        tmp = temp_name(link)  # unpredictable, and os.symlink never replaces what is there
        os.symlink(os.path.relpath(target, link.parent), tmp)
        os.replace(tmp, link)

    def _apply_retention(self) -> None:
        if self.num_checkpoints_to_keep < 0:
            return
        while len(self.saved) > self.num_checkpoints_to_keep:
            oldest = pathlib.Path(self.saved.pop(0))
            if oldest.is_dir():
                shutil.rmtree(oldest, ignore_errors=True)
            else:
                oldest.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m workers.checkpoint",
        description="Write the checkpoints a trainer stages, off its training thread. Stops at the end of the "
                    "run (after the final checkpoint) or on SIGTERM.")
    add_daemon_arguments(parser, identity="checkpoint")
    parser.add_argument("--save-interval", default="1ep", help="'1ep', '100ba', ... (default: 1ep)")
    parser.add_argument("--folder", default="{run_name}/checkpoints",
                        help="folder template under --runs-dir (default: {run_name}/checkpoints)")
    parser.add_argument("--filename", default="ep{epoch}-ba{batch}-rank{rank}.pt")
    parser.add_argument("--latest-filename", default="latest-rank{rank}.pt", help="'' for no link")
    parser.add_argument("--runs-dir", help="base folder (default: the parent of the trainer's run folder)")
    parser.add_argument("--keep", type=int, default=-1, help="checkpoints to keep (default: all)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    parser.add_argument("--weights-only", action="store_true", help="save the model weights only")
    parser.add_argument("--transfer", choices=TRANSFERS, default="auto",
                        help="how staged checkpoints reach this worker: 'shm' maps the trainer's /dev/shm (same "
                             "host), 'fetch' receives them over the bus as zero-copy frames (another host); "
                             "'auto' maps when the buffer is visible here (default)")
    return parser


def build_saver(args: argparse.Namespace) -> list[Callback]:
    """The one CheckpointSaver the options describe."""
    return [CheckpointSaver(folder=args.folder, filename=args.filename, latest_filename=args.latest_filename or None,
                            save_interval=args.save_interval, num_checkpoints_to_keep=args.keep,
                            overwrite=args.overwrite, weights_only=args.weights_only, runs_dir=args.runs_dir,
                            transfer=args.transfer)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_daemon(build_parser(), argv, build_saver)


if __name__ == "__main__":
    sys.exit(main())
