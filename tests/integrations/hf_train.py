"""A small Hugging Face Trainer job publishing on the bus (run by tests/integrations/test_transformers.py,
alone or under ``torchrun``). Writes ``<out>/rank<N>.json`` with what the trainer itself did.

Usage: python hf_train.py OUT BUS RUN_NAME [--epochs N] [--sleep S] [--hold-at B] [--stop-at B] [--evaluate-first]
  --hold-at B: at step B, wait until the file OUT/release exists (a monitor attaches meanwhile).
  --stop-at B: at step B, wait until a worker's stop request has reached this rank (deterministic stop).
  --evaluate-first: ``evaluate()`` and ``predict()`` before ``train()`` (neither is published).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
import warnings

import torch
import transformers

from eventbus.integrations.transformers import EventBusCallback

WAIT = 60.0  # seconds a gate waits before the job fails


class Net(torch.nn.Module):
    def __init__(self, sleep: float):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.sleep = sleep

    def forward(self, x, labels=None):
        if self.sleep and self.training:
            time.sleep(self.sleep)
        logits = self.layer(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


class Gates(transformers.TrainerCallback):
    """Runs before EventBusCallback: holds a step's end until the test (or a worker) has acted."""

    def __init__(self, out: pathlib.Path, hold_at: int, stop_at: int):
        self.out, self.hold_at, self.stop_at = out, hold_at, stop_at
        self.bus: EventBusCallback | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.hold_at:
            self._wait(lambda: (self.out / "release").exists(), "release file")
        if state.global_step == self.stop_at and self.bus is not None and args.process_index == 0:
            capture = self.bus.adapter.capture
            assert capture is not None
            self._wait(capture.publisher.wants_stop, "a worker's stop request")

    @staticmethod
    def _wait(condition, what):
        deadline = time.monotonic() + WAIT
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"gave up waiting for {what}")
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("bus")
    parser.add_argument("run_name")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--evaluate-first", action="store_true")
    options = parser.parse_args()
    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"), use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        num_train_epochs=options.epochs, eval_strategy="epoch", learning_rate=0.1, lr_scheduler_type="linear")
    gates = Gates(out, options.hold_at, options.stop_at)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(
            model=Net(options.sleep), args=args, train_dataset=dataset(16, 0), eval_dataset=dataset(8, 1),
            callbacks=[gates, EventBusCallback(bus=options.bus, run_name=options.run_name)])
        gates.bus = EventBusCallback.attach(trainer)
        if options.evaluate_first:
            trainer.evaluate()
            trainer.predict(dataset(8, 2))
        trainer.train()
    rank = args.process_index
    (out / f"rank{rank}.json").write_text(json.dumps({
        "global_step": trainer.state.global_step, "world_size": args.world_size,
        "log_history": trainer.state.log_history, "pid": os.getpid()}))


if __name__ == "__main__":
    main()
