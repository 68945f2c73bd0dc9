"""9. Trainer adapters: PyTorch Lightning, Hugging Face Trainer and Composer (a) alone, (b) with the
eventbus adapter (bus, no subscriber), (c) with the adapter and ``eventbus run``'s daemons writing
TensorBoard, (d) with the trainer's own in-process logging every step; and the Lightning checkpoint
plugin's stall against Lightning's own save and a plain copy of the state.

Steps/s are over the steady part of ``fit``: from the end of the first tenth of the steps to the last
step's end, read by a callback every setup has (bus opening and closing, daemon start and the
trainers' setup are left out). Medians over repeats that alternate the setups (the machine is noisy).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Iterator

import torch

from bench.common import emit, median, python_env, table
from bench.daemons import STEP_SIZES
from bench.models import loader, mlp

SETUPS = ("alone", "bus", "daemons", "own")  # (a) (b) (c) (d)
TRAINERS = ("lightning", "transformers", "composer")
DAEMONS = ("logger", "timing", "checkpoint", "health")  # eventbus run's default daemons, in its order
TARGETS = {"~1 ms": 0.90, "~30 ms": 0.98}  # (c)/(a) at least this; and (c) ahead of (d)


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _steps_per_sec(times: list[float]) -> float:
    """Steps/s from the step-end clock readings, without the first tenth (warm-up)."""
    warm = max(2, len(times) // 10)
    return (len(times) - 1 - warm) / (times[-1] - times[warm])


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench adapters: gave up waiting for {what}")
        time.sleep(0.02)


def _stat(pid: int) -> tuple[str, float]:
    """(scheduler state, user + system CPU seconds) of a process; ("X", 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return "X", 0.0
    return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Warmup:
    """The daemons' start, as it falls on a run: they connect, then import their libraries (torch,
    TensorBoard) as the first messages arrive. Measured apart, from the first step's end until every
    daemon is connected and asleep for 1 s in a row: on a loaded machine a daemon waiting for a CPU
    is runnable, not asleep, so a starved start is not taken for an idle one."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.started: list[float] = []
        self.seconds = 0.0
        self.cpu = 0.0

    def wait(self, bus_callback: Any) -> None:
        if not self.pids:
            return
        publisher = bus_callback.adapter.capture.publisher
        start, cpu = time.perf_counter(), sum(_stat(pid)[1] for pid in self.pids)
        _wait(lambda: len(publisher.subscribers()) >= len(self.pids), f"{len(self.pids)} daemons to connect")
        time.sleep(0.2)  # the first messages reach them
        asleep, deadline = 0, time.monotonic() + 180
        while asleep < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
            asleep = asleep + 1 if all(_stat(pid)[0] in "SX" for pid in self.pids) else 0
        self.seconds = time.perf_counter() - start
        self.started = [_stat(pid)[1] for pid in self.pids]
        self.cpu = sum(self.started) - cpu

    def cpu_since(self) -> list[float]:
        """Each daemon's CPU seconds since the warm-up ended (read once the run has ended and the
        bus's close has let them apply all of it)."""
        return [_stat(pid)[1] - before for pid, before in zip(self.pids, self.started)]


@contextlib.contextmanager
def _daemons(address: str, run_folder: pathlib.Path) -> Iterator[list[subprocess.Popen]]:
    """``eventbus run``'s daemons, with its command lines, the logger writing TensorBoard too; started
    before the trainer binds, waited for (they exit at the end of the run) after it closes."""
    from eventbus.run.config import JobConfig
    from eventbus.run.supervise import daemon_command

    config = JobConfig()
    run_folder.mkdir(parents=True, exist_ok=True)
    children = []
    assert tuple(config.daemons) == DAEMONS, config.daemons
    for name in config.daemons:
        command = daemon_command(name, address, run_folder, config) + (["--tensorboard"] if name == "logger" else [])
        log = open(run_folder / f"{name}.log", "w")
        children.append(subprocess.Popen(command, cwd=run_folder, env=python_env(), stdout=log, stderr=log))
        log.close()
    try:
        yield children
    finally:
        deadline = time.monotonic() + 60
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---------------------------------------------------------------------- one fit per trainer

def _lightning(shape: tuple[int, int, int], steps: int, folder: pathlib.Path, setup: str,
               warmup: _Warmup) -> list[float]:
    import lightning.pytorch as pl

    from eventbus.integrations.lightning import EventBusCallback

    width, depth, batch_size = shape

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(width, depth)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if not self.times:
                warmup.wait(callbacks[0])
            self.times.append(time.perf_counter())

    clock = Clock()
    callbacks: list[Any] = [clock]
    if setup in ("bus", "daemons"):
        callbacks.insert(0, EventBusCallback(bus=f"ipc://{folder}/bus", run_name=folder.name, run_folder=folder))
    logger: Any = False
    if setup == "own":
        logger = pl.loggers.TensorBoardLogger(save_dir=str(folder), name="tensorboard")
    trainer = pl.Trainer(max_steps=steps, max_epochs=1, logger=logger, log_every_n_steps=1, callbacks=callbacks,
                         accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(folder))
    trainer.fit(Net(), loader(steps, batch_size))
    return clock.times


def _transformers(shape: tuple[int, int, int], steps: int, folder: pathlib.Path, setup: str,
                  warmup: _Warmup) -> list[float]:
    import transformers

    from eventbus.integrations.transformers import EventBusCallback

    width, depth, batch_size = shape

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(width, depth)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Clock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.times:
                warmup.wait(bus)
            self.times.append(time.perf_counter())

    data = loader(steps, batch_size).dataset
    dataset = [{"x": x, "labels": y} for x, y in zip(*data.tensors)]
    report_to = {"own": ["tensorboard"], "own-wandb": ["wandb"]}.get(setup, [])
    logged = {"logging_strategy": "steps", "logging_steps": 1} if report_to else {"logging_strategy": "no"}
    args = transformers.TrainingArguments(
        output_dir=str(folder), use_cpu=True, report_to=report_to, save_strategy="no", disable_tqdm=True,
        per_device_train_batch_size=batch_size, max_steps=steps, optim="sgd", learning_rate=0.01,
        dataloader_num_workers=0, seed=0, **logged)
    clock = Clock()
    callbacks: list[Any] = [clock]
    bus = None
    if setup in ("bus", "daemons"):
        bus = EventBusCallback(bus=f"ipc://{folder}/bus", run_name=folder.name, run_folder=folder)
        callbacks.insert(0, bus)
    with warnings.catch_warnings(), _environment(WANDB_MODE="offline", WANDB_DIR=str(folder), WANDB_SILENT="true",
                                                 WANDB_PROJECT="bench", TOKENIZERS_PARALLELISM="false"):
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=Net(), args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # logs to TB/W&B, not stdout
        if bus is not None:
            EventBusCallback.attach(trainer)  # the step's loss tensor, as the README recommends
        trainer.train()
    return clock.times


def _composer(shape: tuple[int, int, int], steps: int, folder: pathlib.Path, setup: str,
              warmup: _Warmup) -> list[float]:
    from composer import Callback
    from composer import Trainer as ComposerTrainer
    from composer.loggers import TensorboardLogger
    from composer.models import ComposerClassifier

    from eventbus.integrations.composer import EventBusCallback

    width, depth, batch_size = shape

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def batch_end(self, state: Any, logger: Any) -> None:
            if not self.times:
                warmup.wait(callbacks[0])
            self.times.append(time.perf_counter())

    clock = Clock()
    callbacks: list[Any] = [clock]
    if setup in ("bus", "daemons"):
        callbacks.insert(0, EventBusCallback(bus=f"ipc://{folder}/bus", run_name=folder.name, run_folder=folder))
    loggers = [TensorboardLogger(log_dir=str(folder / "tensorboard"))] if setup == "own" else []
    trainer = ComposerTrainer(model=ComposerClassifier(mlp(width, depth), num_classes=10),
                              train_dataloader=loader(steps, batch_size), max_duration=f"{steps}ba",
                              device="cpu", progress_bar=False, log_to_console=False,
                              callbacks=callbacks, loggers=loggers, run_name=folder.name, seed=0)
    trainer.fit()
    trainer.close()  # ends the run on the bus (the daemons then exit)
    return clock.times


RUNNERS: dict[str, Callable[..., list[float]]] = {"lightning": _lightning, "transformers": _transformers,
                                                  "composer": _composer}


def _setups(trainer: str) -> list[str]:
    return list(SETUPS) + (["own-wandb"] if trainer == "transformers" else [])


def _fit(trainer: str, shape: tuple[int, int, int], steps: int, folder: pathlib.Path, setup: str) -> dict[str, float]:
    """One fit: steady steps/s; seconds from the last step's end until ``fit`` returned (the bus's close,
    which lets live daemons catch up); for (c) the daemons' warm-up and their exit after the run."""
    warmup = _Warmup()
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        if setup == "daemons":
            warmup.pids = [child.pid for child in stack.enter_context(_daemons(f"ipc://{folder}/bus", folder))]
        times = RUNNERS[trainer](shape, steps, folder, setup, warmup)
        returned = time.perf_counter()
        daemon_cpu = warmup.cpu_since()
    result = {"steps_per_sec": _steps_per_sec(times), "end_s": returned - times[-1], "warmup_s": warmup.seconds,
              "warmup_cpu_s": warmup.cpu, "daemons_exit_s": time.perf_counter() - returned}
    for name, seconds in zip(DAEMONS, daemon_cpu):  # per step after the warm-up, against the step's time
        result[f"{name}_cpu_ms_per_step"] = 1000 * seconds / (len(times) - 1)
    return result


def _installed(trainer: str) -> bool:
    try:
        __import__({"lightning": "lightning.pytorch", "transformers": "transformers",
                    "composer": "composer"}[trainer])
        __import__(f"eventbus.integrations.{trainer}")
        return True
    except Exception as err:  # an optional trainer missing: its rows are left out, with the reason
        print(f"  {trainer}: not measured ({type(err).__name__}: {err})")
        return False


def _setups_for(trainer: str, quick: bool) -> list[str]:
    """--quick (the test suite's smoke run) starts the four daemons for Lightning only: that start-up is
    most of a quick run's time, and one trainer shows the setup works."""
    setups = list(_setups(trainer))
    return setups if not quick or trainer == "lightning" else [s for s in setups if s != "daemons"]


def steps_per_sec(quick: bool, root: pathlib.Path) -> dict[str, Any]:
    repeats = 1 if quick else 2
    sizes = {"~1 ms": STEP_SIZES["~1 ms"]} if quick else STEP_SIZES
    trainers = [t for t in TRAINERS if _installed(t)]
    results: dict[str, Any] = {}
    rows, ends = [], []
    for label, shape in sizes.items():
        steps = (30 if quick else 400) if shape[0] < 512 else 60
        fits: dict[str, dict[str, list[dict[str, float]]]] = {t: {s: [] for s in _setups_for(t, quick)}
                                                               for t in trainers}
        print(f"  {label}: {steps} steps x {repeats} repeats; {_load()}", flush=True)
        for r in range(repeats):
            for trainer in trainers:  # alternate the setups so that noise hits them alike
                for setup in _setups_for(trainer, quick):
                    folder = root / f"{trainer}-{label[1:-3]}-{setup}-{r}"
                    fits[trainer][setup].append(_fit(trainer, shape, steps, folder, setup))
            print(f"  {label}: repeat {r + 1} of {repeats} done; {_load()}", flush=True)
        for trainer in trainers:
            runs = fits[trainer]
            steps_s = {s: median([f["steps_per_sec"] for f in v]) for s, v in runs.items()}
            alone = steps_s["alone"]
            ratios = {f"{s}/alone": v / alone for s, v in steps_s.items() if s != "alone"}
            own = [steps_s[s] for s in steps_s if s.startswith("own")]
            if "daemons" not in runs:  # --quick: the daemons are started for one trainer only
                rows.append((trainer, label, alone, 1000 / alone, ratios["bus/alone"], "-", ratios["own/alone"],
                             f"{ratios['own-wandb/alone']:.3g}" if "own-wandb/alone" in ratios else "-", "-"))
                results.setdefault(trainer, {})[label] = {"steps": steps, "steps_per_sec": steps_s,
                                                          "ratios": ratios, "fits": runs}
                continue
            met = ratios["daemons/alone"] >= TARGETS[label] and all(steps_s["daemons"] > v for v in own)
            rows.append((trainer, label, alone, 1000 / alone, ratios["bus/alone"], ratios["daemons/alone"],
                         ratios["own/alone"], f"{ratios['own-wandb/alone']:.3g}" if "own-wandb/alone" in ratios
                         else "-", "yes" if met else "NO"))
            daemons = runs["daemons"]
            end_of_run = {s: median([f["end_s"] for f in v]) for s, v in runs.items()}
            cpu = {name: median([f[f"{name}_cpu_ms_per_step"] for f in daemons]) for name in DAEMONS}
            ends.append((trainer, label, median([f["warmup_s"] for f in daemons]),
                         median([f["warmup_cpu_s"] for f in daemons]), end_of_run["alone"], end_of_run["bus"],
                         end_of_run["daemons"], median([f["daemons_exit_s"] for f in daemons]),
                         " ".join(f"{cpu[n]:.2g}" for n in DAEMONS)))
            results.setdefault(trainer, {})[label] = {
                "steps": steps, "steps_per_sec": steps_s, "ratios": ratios, "target_met": met,
                "end_of_run_s": end_of_run, "daemon_cpu_ms_per_step": cpu, "fits": runs}
    table(f"9. adapters: steps/s of the trainer alone (a) and ratios to it (medians); {_load()}",
          ["trainer", "step", "(a) steps/s", "ms/step", "(b) bus", "(c) daemons", "(d) own TB", "(d) own W&B",
           f"(c)>={'/'.join(f'{v}' for v in TARGETS.values())} & >(d)"], rows)
    table("9. adapters: (c)'s daemons: warm-up from the first step and its CPU (s), the end of the run (last step "
          "to fit's return, s), the daemons' CPU per step after the warm-up (ms)",
          ["trainer", "step", "warm-up", "its CPU", "end (a)", "end (b)", "end (c)", "daemons exit",
           "CPU/step: " + " ".join(DAEMONS)], ends)
    return results


# ---------------------------------------------------------------------- the Lightning checkpoint stall

class _Fallbacks(logging.Handler):
    """Counts the plugin's "writing ... on the training thread" lines: a save that was not staged."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "on the training thread" in record.getMessage()


def _checkpoint_fit(megabytes: int, saves: int, folder: pathlib.Path, plugin: bool) -> dict[str, list[float]]:
    """One Lightning fit saving ``saves`` times with ``trainer.save_checkpoint`` from a callback: the
    seconds inside each save and a plain copy of the same tensors just before it."""
    import lightning.pytorch as pl

    from eventbus.integrations.lightning import EventBusCallback, EventBusCheckpointIO

    every = 4  # steps between saves: the worker writes the last one meanwhile

    class Payload(pl.LightningModule):
        """A small MLP trained on, and ``megabytes`` of state in 4 MiB buffers (a checkpoint's bulk)."""

        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(64, 2)
            for i in range(max(1, megabytes // 4)):
                self.register_buffer(f"payload{i}", torch.randn(1024, 1024))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9)

    class Saver(pl.Callback):
        def __init__(self) -> None:
            self.stall: list[float] = []
            self.copy: list[float] = []
            self.dump: list[float] = []
            self.buffers: list[torch.Tensor] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if plugin:  # the checkpoint worker holds its lease before the first save
                publisher = bus.adapter.capture.publisher
                _wait(publisher.holds_checkpoint_lease, "the checkpoint worker's lease")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step % every:
                return
            if plugin:  # the previous checkpoint written and acknowledged: a free buffer, as in steady training
                staging = bus.adapter.capture.staging
                _wait(lambda: not staging.busy(), "the checkpoint worker's acknowledgement")
            tensors = [t for t in pl_module.state_dict().values()]
            tensors += [t for s in trainer.optimizers[0].state_dict()["state"].values() for t in s.values()
                        if isinstance(t, torch.Tensor)]
            if not self.buffers:
                self.buffers = [torch.empty_like(t) for t in tensors]
            start = time.perf_counter()
            for target, source in zip(self.buffers, tensors):
                target.copy_(source)
            self.copy.append(time.perf_counter() - start)
            # Lightning building the checkpoint dict (its hooks, loops' state): part of both saves, not of a copy
            start = time.perf_counter()
            trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            self.dump.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.save_checkpoint(folder / f"step{trainer.global_step}.ckpt")
            self.stall.append(time.perf_counter() - start)

    saver = Saver()
    bus = EventBusCallback(bus=f"ipc://{folder}/bus", run_name=folder.name, run_folder=folder)
    callbacks: list[Any] = [bus, saver] if plugin else [saver]
    fallbacks = _Fallbacks()
    log = logging.getLogger("eventbus.integrations.lightning")
    log.addHandler(fallbacks)
    folder.mkdir(parents=True)
    worker = None
    if plugin:
        log_file = open(folder / "checkpoint.log", "w")
        worker = subprocess.Popen([sys.executable, "-m", "workers.checkpoint", "--connect", f"ipc://{folder}/bus",
                                   "--save-interval", "0ep", "--state-dir", str(folder / ".workers")],
                                  cwd=folder, env=python_env(), stdout=log_file, stderr=log_file)
        log_file.close()
    try:
        trainer = pl.Trainer(max_steps=every * saves, max_epochs=1, logger=False, callbacks=callbacks,
                             plugins=[EventBusCheckpointIO()] if plugin else None, accelerator="cpu", devices=1,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, default_root_dir=str(folder))
        trainer.fit(Payload(), loader(every * saves, 16))
    finally:
        log.removeHandler(fallbacks)
        if worker is not None:
            try:
                worker.wait(timeout=120)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    written = sorted(folder.glob("step*.ckpt"))
    if len(written) != saves:
        raise RuntimeError(f"bench adapters: {len(written)} of {saves} checkpoints written in {folder}")
    return {"stall": saver.stall, "copy": saver.copy, "dump": saver.dump, "fallbacks": [float(fallbacks.count)]}


def checkpoint_stall(quick: bool, root: pathlib.Path) -> dict[str, Any]:
    if not _installed("lightning"):
        return {}
    sizes = [10] if quick else [100, 1000]
    saves = 3 if quick else 4
    repeats = 1 if quick else 2
    rows, result = [], {}
    for size in sizes:
        runs: dict[str, dict[str, list[float]]] = {k: {"stall": [], "copy": [], "dump": [], "fallbacks": []}
                                                   for k in ("plugin", "own")}
        for r in range(repeats):  # alternating; the first save of each fit allocates its buffers: left out
            for name in ("plugin", "own"):
                fit = _checkpoint_fit(size, saves, root / f"ckpt-{size}-{name}-{r}", plugin=name == "plugin")
                for key, values in fit.items():
                    runs[name][key] += values if key == "fallbacks" else values[1:]
        plugin, own = median(runs["plugin"]["stall"]), median(runs["own"]["stall"])
        copy = median(runs["plugin"]["copy"] + runs["own"]["copy"])
        dump = median(runs["plugin"]["dump"] + runs["own"]["dump"])
        fallbacks = int(sum(runs["plugin"]["fallbacks"]))
        rows.append((f"{size} MB", 1000 * copy, 1000 * dump, 1000 * plugin, 1000 * own, plugin / copy, own / plugin,
                     fallbacks))
        result[f"{size}MB"] = {"copy_ms": 1000 * copy, "dump_checkpoint_ms": 1000 * dump,
                               "plugin_stall_ms": 1000 * plugin, "lightning_save_ms": 1000 * own,
                               "stall_over_copy": plugin / copy, "save_over_stall": own / plugin,
                               "written_on_training_thread": fallbacks, "target_met": plugin / copy <= 1.2}
    table(f"9. adapters: Lightning checkpoint stall, time inside trainer.save_checkpoint (ms, median); {_load()}",
          ["state", "copy", "dump_checkpoint", "EventBusCheckpointIO", "Lightning's save", "stall/copy (<=1.2)",
           "save/stall",
           "not staged"], rows)
    return result


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the daemons too
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    result: dict[str, Any] = {"load_average_start": list(os.getloadavg())}
    print(f"\n9. adapters ({_load()})", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        result["steps_per_sec"] = steps_per_sec(quick, pathlib.Path(folder))
        result["checkpoint"] = checkpoint_stall(quick, pathlib.Path(folder))
    result["load_average_end"] = list(os.getloadavg())
    emit("adapters", result)
    return result


if __name__ == "__main__":
    run("--quick" in sys.argv)
