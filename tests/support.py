"""What tests share besides fixtures: the toy model and data, the one trainer factory, the bus address,
child processes with their output collected, a trainer on a thread, and an event recorder.

Fixtures live in ``tests/conftest.py`` (pytest finds them there); test modules import from here.
"""

from __future__ import annotations

import collections
import os
import pathlib
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from eventbus import Callback, ComposerClassifier, Event, Trainer

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


class EventRecorder(Callback):
    """Records every event it sees, in order (a real callback, run by the real engine)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def run_event(self, event: Event, state: Any, logger: Any) -> None:
        self.events.append(event)

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(self.events)


def make_loader(num_samples: int = 64, batch_size: int = 16, features: int = 8, shuffle: bool = False,
                seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, features, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def make_model(features: int = 8, dropout: float = 0.0) -> ComposerClassifier:
    module = torch.nn.Sequential(
        torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 2)
    )
    return ComposerClassifier(module, num_classes=2)


def bus_address(folder: pathlib.Path | str, name: str = "bus") -> str:
    """The ipc address of a test's bus: a socket file in the test's own folder, so tests never share one."""
    return f"ipc://{folder}/{name}"


def make_trainer(tmp_path: pathlib.Path, max_duration: str = "3ep", *, model_seed: int | None = None,
                 dropout: float = 0.0, shuffle: bool = False, adam_lr: float | None = None,
                 **trainer_kwargs: Any) -> Trainer:
    """A real Trainer on CPU training the toy classifier on 64 samples in batches of 16.

    It publishes on ``bus_address(tmp_path)`` unless ``bus=`` says otherwise (``None``/``False``: no bus).
    ``model_seed`` seeds the initial weights (a resume test starts its runs alike or, on purpose, apart);
    ``adam_lr`` trains with Adam instead of the Trainer's default optimizer; every other keyword goes to
    the Trainer as given.
    """
    if model_seed is not None:
        torch.manual_seed(model_seed)
    model = make_model(dropout=dropout)
    if adam_lr is not None:
        trainer_kwargs.setdefault("optimizers", torch.optim.Adam(model.parameters(), lr=adam_lr))
    trainer_kwargs.setdefault("bus", bus_address(tmp_path))
    return Trainer(model, make_loader(shuffle=shuffle), max_duration=max_duration, device="cpu", **trainer_kwargs)


_PORT_DRAWS = random.SystemRandom()


def free_port() -> int:
    """A free TCP port, on every interface (a compose trainer binds 0.0.0.0), whose successor (the
    request service's port) is free too. Drawn below the kernel's ephemeral range: a port of that range
    can be handed to any process's outgoing connection between this check and the bind (a parallel
    test's connection once took a trainer's service port)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral = int(ports.read().split()[0])
    low = max(1024, ephemeral - 20000)
    while True:
        port = _PORT_DRAWS.randrange(low, ephemeral - 2)  # never a seeded sequence shared by two workers
        try:
            for candidate in (port, port + 1):
                with socket.socket() as probe:
                    probe.bind(("0.0.0.0", candidate))
        except OSError:
            continue
        return port


class Process:
    """A real child process with its output collected line by line (for waiting on a message)."""

    def __init__(self, args: list[str], cwd, env: dict | None = None):
        # EVENTBUS_VERBOSE: workers and daemons say when they follow a run, which tests wait for.
        full_env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", EVENTBUS_VERBOSE="1")
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=full_env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._threads = [threading.Thread(target=self._collect, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _collect(stream, lines):
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.stdout + self.stderr):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not seen; stderr:\n" + "\n".join(self.stderr[-30:]))

    def finish(self, timeout: float = 120.0) -> int:
        code = self.proc.wait(timeout=timeout)
        for thread in self._threads:
            thread.join(timeout=5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class HoldTraining(Callback):
    """Holds the training thread at its first ``BATCH_END`` until :meth:`release` (or ``timeout``): the
    run, its bus thread and its request service stay up for as long as a test needs them, whatever
    the machine's speed (a run of a few dozen batches can end before a loaded machine's test is done)."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.held = threading.Event()
        self._released = threading.Event()

    def batch_end(self, state: Any, logger: Any) -> None:
        if not self.held.is_set():
            self.held.set()
            self._released.wait(self.timeout)

    def release(self) -> None:
        self._released.set()


class BackgroundTrainer:
    """Runs ``trainer.fit()`` then ``close()`` on a thread, as a training script's main thread would."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        started = time.perf_counter()
        try:
            self.trainer.fit()
        except BaseException as err:  # re-raised by join()
            self.error = err
        finally:
            self.seconds = time.perf_counter() - started
            self.trainer.close()

    def start(self) -> "BackgroundTrainer":
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float = 120.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "training did not finish"
        if self.error is not None:
            raise self.error
