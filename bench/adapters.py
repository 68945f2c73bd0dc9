"""9. Trainer adapters: PyTorch Lightning, Hugging Face Trainer and Composer (a) alone, (b) with the
eventbus adapter (bus, no subscriber), (c) with the adapter and ``eventbus run``'s daemons writing
TensorBoard, (d) with the trainer's own in-process logging every step; and the Lightning checkpoint
plugin's stall against Lightning's own save and a plain copy of the state
(:mod:`bench.lightning_checkpoint`).

Steps/s are over the steady part of ``fit``: from the end of the first tenth of the steps to the last
step's end, read by a callback every setup has (bus opening and closing, daemon start and the
trainers' setup are left out). Medians over repeats that alternate the setups (the machine is noisy).
Then (b) and (c) against (a) once more, inside one fit per trainer (:mod:`bench.adapters_in_one_fit`).
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
from typing import Any, Callable, Iterator, Optional

import torch

from bench.common import (
    emit,
    helper_cpu_seconds,
    median,
    paired_ratio,
    process_cpu_seconds,
    python_env,
    ratio_range,
    table,
)
from bench.daemons import STEP_SIZES
from bench.models import loader, mlp
from bench.rotation import Rotation

SETUPS = ("alone", "bus", "daemons", "own")  # (a) (b) (c) (d)
TRAINERS = ("lightning", "transformers", "composer")
DAEMONS = ("logger", "timing", "checkpoint", "health")  # eventbus run's default daemons, in its order
TARGETS = {"~1 ms": 0.90, "~30 ms": 0.98}  # (c)/(a) at least this; and (c) ahead of (d)


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _warm(times: list[float]) -> int:
    """The first step-end reading counted: the first tenth of the steps is the warm-up."""
    return max(2, len(times) // 10)


def _steps_per_sec(times: list[float]) -> float:
    """Steps/s from the step-end clock readings, without the first tenth (warm-up)."""
    warm = _warm(times)
    return (len(times) - 1 - warm) / (times[-1] - times[warm])


def _mark(times: list[float], warmup: "_Warmup") -> None:
    """A step's end: the wall clock, and at the two ends of the steady part the CPU time of this (the
    training) process, all its threads, and of the daemons. Only there: a process's CPU time sums its
    threads', and with the daemons on the other CPU one reading took ~27 us (3 with the bus alone),
    ~2.5% of a ~1 ms step, at every step of the setup it measured."""
    times.append(time.perf_counter())
    warmup.mark(len(times))


def _step_end(times: list[float], warmup: "_Warmup", bus: Any, rotation: Optional[Rotation]) -> None:
    """Every setup's clock at a step's end: the daemons' warm-up waited for after the first step, then
    this step's end marked, or the rotation moved on (setups switched inside one fit)."""
    if (rotation.steps == 0) if rotation is not None else not times:
        warmup.wait(bus)
    if rotation is not None:
        rotation.step()
    else:
        _mark(times, warmup)


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench adapters: gave up waiting for {what}")
        time.sleep(0.02)


def _stat(pid: int) -> tuple[str, float]:
    """(scheduler state, user + system CPU seconds, to the nanosecond) of a process; ("X", 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        return state, process_cpu_seconds(pid)
    except OSError:
        return "X", 0.0


class _Warmup:
    """The daemons' start, as it falls on a run: they connect, then import their libraries (torch,
    TensorBoard) as the first messages arrive. Measured apart, from the first step's end until every
    daemon is connected and asleep for 1 s in a row: on a loaded machine a daemon waiting for a CPU
    is runnable, not asleep, so a starved start is not taken for an idle one."""

    def __init__(self, steps: int = 0) -> None:
        self.pids: list[int] = []
        self.started: list[float] = []
        self.seconds = 0.0
        self.cpu = 0.0
        # The trainer's and the daemons' CPU at the steps where the steady part starts and ends (step counts).
        self.steady = (_warm([0.0] * steps) + 1, steps)
        self.readings: dict[int, list[float]] = {}
        self.trainer_readings: dict[int, float] = {}

    def mark(self, count: int) -> None:
        if count in self.steady:  # the training process, and its bus's helper process (doing the bus's work)
            self.trainer_readings[count] = time.process_time() + helper_cpu_seconds()
            if self.pids:
                self.readings[count] = [_stat(pid)[1] for pid in self.pids]

    def trainer_cpu_per_step(self) -> float:
        """This process's CPU seconds per step over the steady part, with its bus helper process's."""
        first, last = self.steady
        return (self.trainer_readings[last] - self.trainer_readings[first]) / (last - first)

    def steady_cpu(self) -> Optional[list[float]]:
        """Each daemon's CPU seconds over the trainer's steady part (what it spends per step, its
        start and the run's end left out, as for the trainer); None if a reading is missing."""
        first, last = (self.readings.get(count) for count in self.steady)
        if first is None or last is None:
            return None
        return [b - a for a, b in zip(first, last)]

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
               warmup: _Warmup, rotation: Optional[Rotation] = None) -> list[float]:
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
            _step_end(self.times, warmup, callbacks[0], rotation)

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
    if rotation is not None:
        rotation.switch = _switching(trainer.callbacks, callbacks[0])
    trainer.fit(Net(), loader(steps, batch_size))
    return clock.times


def _transformers(shape: tuple[int, int, int], steps: int, folder: pathlib.Path, setup: str,
                  warmup: _Warmup, rotation: Optional[Rotation] = None) -> list[float]:
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
            _step_end(self.times, warmup, bus, rotation)

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
            plain_step = trainer.training_step
            EventBusCallback.attach(trainer)  # the step's loss tensor, as the README recommends
            if rotation is not None:
                bus_step = trainer.training_step
                rotation.switch = _switching(trainer.callback_handler.callbacks, bus, lambda on: setattr(
                    trainer, "training_step", bus_step if on else plain_step))
        trainer.train()
    return clock.times


def _composer(shape: tuple[int, int, int], steps: int, folder: pathlib.Path, setup: str,
              warmup: _Warmup, rotation: Optional[Rotation] = None) -> list[float]:
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
            _step_end(self.times, warmup, callbacks[0], rotation)

    clock = Clock()
    callbacks: list[Any] = [clock]
    if setup in ("bus", "daemons"):
        callbacks.insert(0, EventBusCallback(bus=f"ipc://{folder}/bus", run_name=folder.name, run_folder=folder))
    loggers = [TensorboardLogger(log_dir=str(folder / "tensorboard"))] if setup == "own" else []
    trainer = ComposerTrainer(model=ComposerClassifier(mlp(width, depth), num_classes=10),
                              train_dataloader=loader(steps, batch_size), max_duration=f"{steps}ba",
                              device="cpu", progress_bar=False, log_to_console=False,
                              callbacks=callbacks, loggers=loggers, run_name=folder.name, seed=0)
    if rotation is not None:
        bus, composer_logger = callbacks[0], trainer.logger
        rotation.switch = _switching(trainer.state.callbacks, bus, lambda on: setattr(
            composer_logger, "destinations", (*(d for d in composer_logger.destinations if d is not bus.destination),
                                              *((bus.destination,) if on else ()))))
    trainer.fit()
    trainer.close()  # ends the run on the bus (the daemons then exit)
    return clock.times


def _switching(callbacks: list[Any], bus: Any, also: Callable[[bool], None] = lambda on: None
               ) -> Callable[[str], None]:
    """:attr:`Rotation.switch` for an adapter: its callback taken off the trainer's list for *alone* and put
    back first for *bus* (``also``: what else the adapter hooked, put back or taken off with it)."""
    def switch(setup: str) -> None:
        on = setup != "alone"
        if on and bus not in callbacks:
            callbacks.insert(0, bus)
        elif not on and bus in callbacks:
            callbacks.remove(bus)
        also(on)
    return switch


RUNNERS: dict[str, Callable[..., list[float]]] = {
    "lightning": _lightning, "transformers": _transformers, "composer": _composer}


def _setups(trainer: str) -> list[str]:
    return list(SETUPS) + (["own-wandb"] if trainer == "transformers" else [])


def _fit(trainer: str, shape: tuple[int, int, int], steps: int, folder: pathlib.Path, setup: str) -> dict[str, float]:
    """One fit: steady steps/s; seconds from the last step's end until ``fit`` returned (the bus's close,
    which lets live daemons catch up); for (c) the daemons' warm-up and their exit after the run."""
    warmup = _Warmup(steps)
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        if setup == "daemons":
            warmup.pids = [child.pid for child in stack.enter_context(_daemons(f"ipc://{folder}/bus", folder))]
        times = RUNNERS[trainer](shape, steps, folder, setup, warmup)
        returned = time.perf_counter()
        daemon_cpu = warmup.cpu_since()
    warm = _warm(times)
    steady = warmup.steady_cpu()
    result = {"steps_per_sec": _steps_per_sec(times), "end_s": returned - times[-1], "warmup_s": warmup.seconds,
              "warmup_cpu_s": warmup.cpu, "daemons_exit_s": time.perf_counter() - returned,
              "trainer_cpu_ms_per_step": 1000 * warmup.trainer_cpu_per_step()}
    if steady is not None:  # per step over the trainer's steady part; the rest is the run's end
        last = warmup.readings[warmup.steady[1]]
        if daemon_cpu and min(daemon_cpu) > 0:  # each still running when fit returned
            result["daemons_end_cpu_s"] = sum(daemon_cpu) - sum(b - a for a, b in zip(warmup.started, last))
        for name, seconds in zip(DAEMONS, steady):
            result[f"{name}_cpu_ms_per_step"] = 1000 * seconds / (len(times) - 1 - warm)
    else:
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
    repeats = 1 if quick else 3
    sizes = {"~1 ms": STEP_SIZES["~1 ms"]} if quick else STEP_SIZES
    trainers = [t for t in TRAINERS if _installed(t)]
    results: dict[str, Any] = {}
    rows: list[tuple[Any, ...]] = []
    ends, cpu_rows = [], []
    for label, shape in sizes.items():
        # ~1 ms steps: 2,000 (2-3 s of training), so that what a daemon spends once per run (its first
        # TensorBoard file, the run's end) is not taken for a cost per step; ~30 ms steps: 150 (60 spread
        # single fits by +-10%).
        steps = (30 if quick else 2000) if shape[0] < 512 else 150
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
            alone_runs = [f["steps_per_sec"] for f in runs["alone"]]
            ratios = {f"{s}/alone": paired_ratio([f["steps_per_sec"] for f in v], alone_runs)
                      for s, v in runs.items() if s != "alone"}
            spread = {s: ratio_range([f["steps_per_sec"] for f in v], alone_runs)
                      for s, v in runs.items() if s != "alone"}
            own = [ratios[f"{s}/alone"] for s in steps_s if s.startswith("own")]
            trainer_cpu = {s: median([f["trainer_cpu_ms_per_step"] for f in v]) for s, v in runs.items()}
            daemon_cpu = {name: median([f[f"{name}_cpu_ms_per_step"] for f in runs["daemons"]]) for name in DAEMONS} \
                if "daemons" in runs else {}
            cpu_rows.append(_cpu_row(trainer, label, trainer_cpu, daemon_cpu))
            if "daemons" not in runs:  # --quick: the daemons are started for one trainer only
                rows.append((trainer, label, alone, 1000 / alone, ratios["bus/alone"], spread["bus"], "-", "-",
                             ratios["own/alone"],
                             f"{ratios['own-wandb/alone']:.3g}" if "own-wandb/alone" in ratios else "-", "-"))
                results.setdefault(trainer, {})[label] = {"steps": steps, "steps_per_sec": steps_s,
                                                          "ratios": ratios, "ranges": spread,
                                                          "trainer_cpu_ms_per_step": trainer_cpu, "fits": runs}
                continue
            met = ratios["daemons/alone"] >= TARGETS[label] and all(ratios["daemons/alone"] > v for v in own)
            rows.append((trainer, label, alone, 1000 / alone, ratios["bus/alone"], spread["bus"],
                         ratios["daemons/alone"], spread["daemons"], ratios["own/alone"],
                         f"{ratios['own-wandb/alone']:.3g}" if "own-wandb/alone" in ratios else "-",
                         "yes" if met else "NO"))
            daemons = runs["daemons"]
            end_of_run = {s: median([f["end_s"] for f in v]) for s, v in runs.items()}
            ends.append((trainer, label, median([f["warmup_s"] for f in daemons]),
                         median([f["warmup_cpu_s"] for f in daemons]), end_of_run["alone"], end_of_run["bus"],
                         end_of_run["daemons"], median([f["daemons_exit_s"] for f in daemons]),
                         _median_of(daemons, "daemons_end_cpu_s")))
            results.setdefault(trainer, {})[label] = {
                "steps": steps, "steps_per_sec": steps_s, "ratios": ratios, "ranges": spread, "target_met": met,
                "end_of_run_s": end_of_run, "trainer_cpu_ms_per_step": trainer_cpu,
                "daemon_cpu_ms_per_step": daemon_cpu,
                "daemons_total_cpu_ms_per_step": sum(daemon_cpu.values()) + trainer_cpu["daemons"], "fits": runs}
    table(f"9. adapters: steps/s of the trainer alone (a, median) and ratios to it (the median of each repeat's "
          f"ratio to (a) in that repeat, then the lowest and highest of those); {_load()}",
          ["trainer", "step", "(a) steps/s", "ms/step", "(b) bus", "range", "(c) daemons", "range", "(d) own TB",
           "(d) own W&B",
           f"(c)>={'/'.join(f'{v}' for v in TARGETS.values())} & >(d)"], rows)
    table("9. adapters: (c)'s daemons: warm-up from the first step and its CPU (s), the end of the run (last step "
          "to fit's return, s)",
          ["trainer", "step", "warm-up", "its CPU", "end (a)", "end (b)", "end (c)", "daemons exit",
           "daemons' CPU after the last step"], ends)
    table("9. adapters: CPU per step (ms; user + system, every thread) of the training process (with its bus helper "
          "process) in each setup, of each of (c)'s daemons after their warm-up, and (c)'s total (training process + "
          "daemons)",
          ["trainer", "step", "(a)", "(b)", "(c)", "(d) own TB", "(d) own W&B", *DAEMONS, "(c) total"], cpu_rows)
    return results


def _median_of(fits: list[dict[str, float]], key: str) -> Any:
    values = [f[key] for f in fits if key in f]
    return median(values) if values else "-"


def _cpu_row(trainer: str, label: str, trainer_cpu: dict[str, float], daemon_cpu: dict[str, float]) -> tuple:
    """One row of the CPU table: '-' where a setup was not run (--quick runs the daemons for one trainer)."""
    def cell(value: Any) -> Any:
        return "-" if value is None else value

    total = trainer_cpu["daemons"] + sum(daemon_cpu.values()) if daemon_cpu else None
    return (trainer, label, *(cell(trainer_cpu.get(s)) for s in ("alone", "bus", "daemons", "own", "own-wandb")),
            *(cell(daemon_cpu.get(name)) for name in DAEMONS), cell(total))


def run(quick: bool) -> dict:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the daemons too
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    result: dict[str, Any] = {"load_average_start": list(os.getloadavg())}
    print(f"\n9. adapters ({_load()})", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        result["steps_per_sec"] = steps_per_sec(quick, pathlib.Path(folder))
        from bench.adapters_in_one_fit import in_one_fit  # it runs this module's fits

        switched = in_one_fit(quick, pathlib.Path(folder))
        result["bus_in_one_fit"], result["daemons_in_one_fit"] = switched["bus"], switched["daemons"]
        from bench.lightning_checkpoint import checkpoint_stall  # it uses this module's helpers

        result["checkpoint"] = checkpoint_stall(quick, pathlib.Path(folder))
    result["load_average_end"] = list(os.getloadavg())
    emit("adapters", result)
    return result


if __name__ == "__main__":
    run("--quick" in sys.argv)
