"""Weights & Biases runs (the ``wandb`` extra): one W&B run per eventbus run, resumed by a restarted worker."""

from __future__ import annotations

import glob
import logging
import os
import pathlib
import struct
import time
from typing import Any, Iterator, Optional

from eventbus.core.logger import Logger, LoggerDestination, to_number
from eventbus.core.run_folder import announced_run_folder
from eventbus.errors import ConfigError
from eventbus.trackers.outbox import Outbox

__all__ = ["WandBLogger", "persisted_steps"]

log = logging.getLogger(__name__)

FLUSH_INTERVAL = 2.0  # seconds between W&B's writes of its transaction log (W&B's default: 15)


class WandBLogger(LoggerDestination):
    """Hyperparameters to the W&B run's config, every metric at its step (needs the ``wandb`` extra).

    Composer's ``WandBLogger`` arguments. ``log_artifacts`` is accepted but ignored: checkpoints are
    the checkpoint worker's business, and this destination never sees their bytes. With
    ``rank_zero_only`` a worker following another rank logs nothing; without it each rank gets its own
    W&B run (``<run id>-rank<N>``, named ``<name>-rank<N>``), as in Composer.

    **One W&B run per eventbus run.** Its id is the eventbus ``run_id`` (unique per run, the same for
    every message of it), so a restarted worker reopens the same W&B run (``resume="allow"``). The run's
    files go to ``init_kwargs["dir"]``, else ``$WANDB_DIR``, else the run folder.

    **Steps and late metrics.** W&B keeps one row per step and drops a ``log`` for a step lower than
    the one it is on, while other workers' metrics (throughput, ETA) come back over the bus a little
    after the trainer's own metrics for the same step. So, like ``MetricsFileLogger``, a step is held
    here until no metric for it has arrived over the last ``hold_steps`` steps (or the run ends), then
    logged once, whole, with ``commit=True``. A metric for a step already logged is dropped and counted
    (``late``); the journal has it all the same.

    **Restarts: nothing lost, nothing twice.** Every W&B call goes through an :class:`Outbox` (retried,
    queued while W&B is down). ``state_dict()`` holds the steps still held, the Outbox's queue, the last
    step handed to W&B, and the steps sent to W&B in the last ``keep_sent`` seconds: a SIGKILL loses what
    W&B's own process had not written yet (it writes its log every ``FLUSH_INTERVAL`` seconds, set here
    unless ``init_kwargs["settings"]`` is given; ``keep_sent`` follows that setting). When the restarted
    worker reopens the W&B run, it reads back the last step W&B really has (offline: the run's
    transaction logs, ``.wandb``, in the W&B folder; online: the resumed run's ``starting_step``), logs
    again the recently sent steps above it, and skips every step at or below it, whether it comes from
    the saved queue or from the messages the worker applies again after its last commit. W&B steps
    only go up, and this order keeps them so: the steps sent before the crash are older than anything
    queued or still held.
    """

    def __init__(self, project: Optional[str] = None, group: Optional[str] = None, name: Optional[str] = None,
                 entity: Optional[str] = None, tags: Optional[list[str]] = None, log_artifacts: bool = False,
                 rank_zero_only: bool = True, init_kwargs: Optional[dict[str, Any]] = None,
                 hold_steps: int = 20, keep_sent: float = 5 * FLUSH_INTERVAL):
        self.project, self.group, self.name, self.entity = project, group, name, entity
        self.tags = list(tags) if tags else None
        self.log_artifacts = log_artifacts  # accepted for Composer compatibility; see the class docstring
        self.rank_zero_only = rank_zero_only
        self.init_kwargs = dict(init_kwargs or {})
        self.hold_steps = hold_steps
        self.keep_sent = keep_sent
        self.outbox = Outbox("W&B", self._send)
        self.run: Any = None
        self.late = 0  # metrics for a step already logged
        self._run_args: Optional[dict[str, Any]] = None  # wandb.init's arguments; None before INIT
        self._config: dict[str, Any] = {}
        self._pending: dict[int, dict[str, Any]] = {}
        self._sent: list[list[Any]] = []  # [step, metrics, wall time sent], oldest first
        self._last_step = -1  # the highest step handed to the Outbox (or W&B has)
        self._persisted = -1  # steps at or below it are in W&B already: never logged again
        self._disabled = False
        self._restored = False
        self._check_credentials()

    def _check_credentials(self) -> None:
        """Online W&B with no API key anywhere W&B looks cannot work: a one-line ConfigError now, rather
        than an outage retried all run long (or a login prompt in a daemon)."""
        if "settings" in self.init_kwargs:
            return  # the caller's own W&B settings (a key, a mode): wandb.init decides
        try:
            from wandb.errors import AuthenticationError
            from wandb.sdk import wandb_setup
            from wandb.sdk.lib.wbauth import authenticate
        except ImportError:
            return  # no wandb (_open says so), or one too old to ask: wandb.init decides
        try:
            settings = wandb_setup.singleton().settings
            if (self.init_kwargs.get("mode") or settings.mode) in ("offline", "dryrun", "disabled"):
                return
            found = authenticate.authenticate_session(host=settings.base_url, source="eventbus", prompt=False,
                                                      update_session=False)
        except AuthenticationError as err:  # a key in a wrong format
            raise ConfigError(f"W&B: {err}") from None
        except Exception:  # W&B's own (private) lookup changed in another version: wandb.init decides
            return
        if found is None:
            raise ConfigError(f"W&B: no API key for {settings.base_url}: set WANDB_API_KEY or run `wandb login`, "
                              "or log offline (WANDB_MODE=offline)")

    def init(self, state: Any, logger: Logger) -> None:
        rank = int(getattr(state, "rank", 0) or 0)
        suffix = f"-rank{rank}" if rank else ""
        if self._run_args is not None and self._run_args.get("id") == f"{state.run_id}{suffix}":
            return  # restored by a cursor of this very run (a resumed export): its queue is still to send
        if self._run_args is not None:  # restored by a cursor of an earlier run: this run starts afresh
            if self.outbox.items or self._pending:
                log.error("W&B: %d items of the previous run %s were never sent; `eventbus export` sends them "
                          "from its journal", len(self.outbox.items) + len(self._pending), self._run_args.get("id"))
            self.outbox.items.clear()
            self._config, self._pending, self._sent = {}, {}, []
            self._last_step = self._persisted = -1
            self._restored = self._disabled = False
        if self.rank_zero_only and rank != 0:
            self._disabled = True
            return
        folder = self.init_kwargs.get("dir") or os.environ.get("WANDB_DIR") or announced_run_folder(state)
        self._run_args = {"id": f"{state.run_id}{suffix}", "name": f"{self.name or state.run_name}{suffix}",
                          "dir": str(pathlib.Path(folder).resolve())}
        self.outbox.put(("open",))  # at INIT, as Composer does: the run shows up as training starts

    def state_dict(self) -> dict[str, Any]:
        """What a restarted worker needs, since INIT is not applied again: the run's identity and
        config, the held steps, the queue, and the recently sent steps (see the class docstring)."""
        if self._disabled:
            return {"disabled": True}
        if self._run_args is None:
            return {}
        return {"run": self._run_args, "config": self._config, "last_step": self._last_step,
                "pending": {str(k): v for k, v in self._pending.items()}, "sent": self._sent,
                "outbox": self.outbox.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._disabled = bool(state.get("disabled", False))
        if not state.get("run"):
            return
        self._run_args, self._config = dict(state["run"]), dict(state.get("config", {}))
        self._last_step = int(state.get("last_step", -1))
        self._pending = {int(k): dict(v) for k, v in state.get("pending", {}).items()}
        self._sent = [list(item) for item in state.get("sent", [])]
        # A saved "open" or "finish" (an export's cursor, committed after close) is said again by
        # this process, when it reopens the run (_reopen) and when it closes it.
        self.outbox.load_state_dict([item for item in state.get("outbox", []) if item[0] not in ("open", "finish")])
        self._restored = True

    def unsent(self) -> tuple[int, int]:
        """What W&B has not taken yet (held steps and queued items), and how many metric values they
        hold: ``eventbus export`` fails while there are any, and ``--resume`` sends them."""
        values = sum(len(item[2]) for item in self.outbox.items if item[0] == "log")
        values += sum(len(metrics) for metrics in self._pending.values())
        return len(self.outbox.items) + len(self._pending), values

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self._run_args is None or not hyperparameters:
            return
        self._config.update(hyperparameters)
        self.outbox.put(("config", dict(hyperparameters)))

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if self._run_args is None:
            return  # disabled (another rank), or metrics before INIT with nothing restored
        self._reopen()
        step = int(step or 0)
        if step <= self._last_step:
            self.late += 1
            if self.late == 1:
                log.info("W&B: metrics for step %d came after the step was logged; dropped (the journal has "
                         "them)", step)
            return
        self._pending.setdefault(step, {}).update({k: to_number(v) for k, v in metrics.items()})
        newest = max(self._pending)
        for old in sorted(s for s in self._pending if s < newest - self.hold_steps):
            self._hand_over(old)

    def _reopen(self) -> None:
        """After a restart, reopen the W&B run first thing: it says which steps it already has."""
        if self._restored:
            self._restored = False
            self.outbox.put(("open",))

    def _hand_over(self, step: int) -> None:
        metrics = self._pending.pop(step)
        self._last_step = max(self._last_step, step)
        self.outbox.put(("log", step, metrics))

    def close(self, state: Any, logger: Logger) -> None:
        if self._run_args is None:
            return
        self._reopen()
        for step in sorted(self._pending):
            self._hand_over(step)
        self.outbox.put(("finish",))
        if not self.outbox.flush(force=True):
            log.error("W&B: closing with %d items not sent (W&B is down); `eventbus export` from the "
                      "journal can fill them in", len(self.outbox.items))

    # -- what the Outbox calls: one item at a time, in order; raising keeps the item queued --

    def _send(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "finish":
            if self.run is not None:
                self.run.finish()
                self.run = None
            return
        run = self.run or self._open()
        if kind == "config":
            run.config.update(item[1], allow_val_change=True)
        elif kind == "log" and item[1] > self._persisted:
            self._log(run, item[1], item[2])

    def _log(self, run: Any, step: int, metrics: dict[str, Any]) -> None:
        """One whole step, committed at once; remembered for ``keep_sent`` seconds (see the docstring)."""
        run.log(_jsonable(metrics), step=step, commit=True)
        now = time.time()
        self._sent.append([step, metrics, now])
        while self._sent and self._sent[0][2] < now - self.keep_sent:
            self._sent.pop(0)

    def _open(self) -> Any:
        """``wandb.init`` for this eventbus run (a new W&B run, or the same one reopened)."""
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("WandBLogger needs wandb: pip install 'eventbus[wandb]'") from err
        assert self._run_args is not None
        kwargs: dict[str, Any] = {"project": self.project, "group": self.group, "entity": self.entity,
                                  "tags": self.tags, **self.init_kwargs, **self._run_args,
                                  "config": self._config, "resume": "allow"}
        if "settings" not in self.init_kwargs:
            kwargs["settings"] = wandb.Settings(x_transaction_log_flush_interval=FLUSH_INTERVAL)
        self.run = wandb.init(**kwargs)
        # Keep sent steps for longer than W&B may hold them unwritten (0: until a buffer fills).
        interval = float(getattr(self.run.settings, "x_transaction_log_flush_interval", FLUSH_INTERVAL) or 0)
        self.keep_sent = max(self.keep_sent, 5 * interval) if interval > 0 else float("inf")
        self._reconcile(self.run)
        return self.run

    def _reconcile(self, run: Any) -> None:
        """After (re)opening: learn the last step W&B has, and log again the steps sent before a
        crash that it lost. They are older than anything queued (steps are handed over in order)."""
        assert self._run_args is not None
        has = persisted_steps(pathlib.Path(self._run_args["dir"]) / "wandb", self._run_args["id"])
        if run.resumed and run.starting_step:
            has = max(has, int(run.starting_step) - 1)
        self._persisted = has
        lost = sorted((int(step), metrics) for step, metrics, _ in self._sent if step > has)
        self._sent = []
        for step, metrics in lost:
            self._log(run, step, metrics)
        self._last_step = max(self._last_step, has)
        if lost:
            log.warning("W&B: logged again steps %d..%d, sent before a restart but not kept by W&B",
                        lost[0][0], lost[-1][0])


def _jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    """What W&B stores as is (numbers, text, lists); anything else as its text."""
    return {key: value if isinstance(value, (int, float, str, bool, list, type(None))) else str(value)
            for key, value in metrics.items()}


def persisted_steps(wandb_dir: pathlib.Path, run_id: str) -> int:
    """The highest history step in the transaction logs (``run-<id>.wandb``) of every local copy of
    W&B run ``run_id`` under ``wandb_dir``; -1 when there is none.

    These files are what W&B syncs from; a SIGKILLed run's last records may be torn, so reading stops
    at the first record that does not parse. The format (LevelDB's log format behind a ``:W&B``
    header, protobuf ``Record``s) is W&B's, not a public API: if a release changes it, this returns
    what it could read and the saved ``last_step`` still rules out most doubles.
    """
    from wandb.proto import wandb_internal_pb2

    highest = -1
    for path in glob.glob(str(wandb_dir / f"*-{glob.escape(run_id)}" / f"run-{glob.escape(run_id)}.wandb")):
        for data in _log_records(pathlib.Path(path)):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            try:
                record.ParseFromString(data)
            except Exception:  # a torn record from a crash: nothing after it was written either
                break
            if record.WhichOneof("record_type") == "history":
                highest = max(highest, int(record.history.step.num))
    return highest


_BLOCK, _HEADER = 32768, 7  # LevelDB log: 32 KiB blocks, records with a 7-byte header


def _log_records(path: pathlib.Path) -> Iterator[bytes]:
    """The whole records of a LevelDB-format log (chunks joined), after W&B's 7-byte file header."""
    data = path.read_bytes()
    if not data.startswith(b":W&B"):
        return
    pos, parts = _HEADER, []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's zero-filled trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0:  # zero padding: the rest of this block is empty
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        if len(chunk) < length:
            return  # torn at the end
        pos += _HEADER + length
        parts.append(chunk)
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE.../LAST
            yield b"".join(parts)
            parts = []
