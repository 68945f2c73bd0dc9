"""The same callback, in or out of process: Composer's State read surface on a subscriber's snapshot.

Each test runs a real Trainer with user-style callbacks in process, then feeds the run's journal
(the exact messages a subscriber receives) to fresh instances of the same callbacks, and compares
what they produced. Composer's own OptimizerMonitor runs in a real ``eventbus worker``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from eventbus import Callback, Event, Trainer
from eventbus.bus.journal import read_messages
from eventbus.bus.subscribe.journal_stream import journal_messages
from tests.support import bus_address, make_loader, make_model


class Reads(Callback):
    """What callbacks typically read off ``state``, written down as text."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def fit_start(self, state: Any, logger: Any) -> None:
        names = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in state.model.named_parameters()]
        self.lines.append(f"fit_start {state.run_name} rank={state.rank}/{state.world_size} "
                          f"device={state.device.type} {str(state.device)} precision={state.precision} "
                          f"fsdp={state.fsdp_enabled} mbs={state.device_train_microbatch_size} "
                          f"params={sum(p.numel() for p in state.model.parameters())} {names} "
                          f"evaluators={[e.label for e in state.evaluators]} max={state.max_duration}")

    def batch_end(self, state: Any, logger: Any) -> None:
        group = state.optimizers[0].param_groups[0]
        self.lines.append(
            f"batch_end {int(state.timestamp.batch)} prev={int(state.previous_timestamp.batch)} "
            f"loss={state.loss.item():.7f} {float(state.loss.detach().cpu()):.7f} "
            f"total={state.total_loss_dict['loss/train/total'].item():.7f} "
            f"opt={type(state.optimizers[0]).__name__} lr={group['lr']:.7f} momentum={group['momentum']} "
            f"wd={group['weight_decay']} nesterov={group['nesterov']} "
            f"sched={type(state.schedulers[0]).__name__} {state.schedulers[0].get_last_lr()} "
            f"acc={state.train_metrics['MulticlassAccuracy'].compute().item():.6f} "
            f"elapsed={state.get_elapsed_duration()} label={state.dataloader_label} len={state.dataloader_len} "
            f"samples={state.batch_num_samples}")

    def eval_end(self, state: Any, logger: Any) -> None:
        metrics = state.eval_metrics["eval"]
        self.lines.append(
            f"eval_end {int(state.timestamp.batch)} eval_batches={int(state.eval_timestamp.batch)} "
            f"metrics={sorted(metrics)} acc={metrics['MulticlassAccuracy'].compute().item():.6f} "
            f"ce={float(metrics['CrossEntropy'].compute()):.6f} label={state.dataloader_label}")

    def fit_end(self, state: Any, logger: Any) -> None:
        try:
            state.loss = None
        except Exception as err:  # in process, State is writable: say so the same way in both
            self.lines.append(f"fit_end read-only: {'loss' in str(err)}")
        else:
            self.lines.append("fit_end read-only: True")


def _train(tmp_path, callbacks: list[Any], **kwargs: Any) -> Trainer:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    trainer = Trainer(model, make_loader(), device="cpu", run_name="surface", max_duration="2ep",
                      optimizers=optimizer, schedulers=scheduler, eval_dataloader=make_loader(32, 16),
                      callbacks=callbacks, bus=bus_address(tmp_path), **kwargs)
    trainer.fit()
    trainer.close()
    return trainer


async def _replay(journal: str, callback: Callback) -> None:
    """The run's messages, as a subscriber gets them, applied to ``callback``."""
    async for message in journal_messages(journal):
        if message.event is not None and message.event.value in ("fit_start", "batch_end", "eval_end", "fit_end"):
            getattr(callback, message.event.value)(message.state, None)


def test_user_callbacks_read_the_same_state_in_and_out_of_process(tmp_path):
    in_process = Reads()
    trainer = _train(tmp_path, [in_process])
    out_of_process = Reads()
    asyncio.run(_replay(str(trainer.publisher.journal_path), out_of_process))
    assert len(in_process.lines) == 1 + 8 + 2 + 1
    assert out_of_process.lines == in_process.lines


def test_snapshot_values_have_composer_types(tmp_path):
    trainer = _train(tmp_path, [])

    async def last_batch_end() -> Any:
        states = [m.state async for m in journal_messages(str(trainer.publisher.journal_path))
                  if m.event is Event.BATCH_END]
        return states[-1]

    state = asyncio.run(last_batch_end())
    assert isinstance(state.loss, float) and isinstance(state.loss.item(), float) and state.loss.numel() == 1
    assert state.loss * 2 == 2 * state.loss.item() and state.loss > 0 and f"{state.loss:.3f}"
    assert torch.isfinite(state.loss)  # a torch function turns it into a 0-dim tensor
    assert state.optimizers[0].param_groups[0]["dampening"] == 0
    assert state.model.num_params == sum(p.numel() for p in trainer.state.model.parameters())
    with pytest.raises(AttributeError, match="'optimizers'"):
        state.optimizers = []
    with pytest.raises(TypeError, match="read-only"):
        state.optimizers[0].param_groups[0]["lr"] = 1.0
    with pytest.raises(AttributeError, match="grad"):
        next(state.model.parameters()).grad = None
    assert all(p.grad is None for p in state.model.parameters())  # no grad_norms lease: not captured


def test_composer_optimizer_monitor_logs_the_same_norms_in_a_worker(tmp_path, spawn):
    from composer.callbacks import OptimizerMonitor

    model = make_model()
    trainer = Trainer(model, make_loader(), device="cpu", run_name="monitor", max_duration="2ep",
                      callbacks=[OptimizerMonitor(batch_log_interval=2)], bus=bus_address(tmp_path))
    worker = spawn("-m", "eventbus", "worker", "--connect", bus_address(tmp_path), "--callback",
                   'composer.callbacks:OptimizerMonitor:{"batch_log_interval": 2}')
    worker.wait_for("following")
    deadline = time.monotonic() + 60
    while not trainer.publisher.leases.holds("grad_norms"):  # the worker's heartbeat leased the norms
        assert time.monotonic() < deadline, "\n".join(worker.stderr)
        time.sleep(0.05)
    trainer.fit()
    trainer.close()
    assert worker.finish() == 0, "\n".join(worker.stderr)
    logged: dict[str, list[tuple[int, dict[str, float]]]] = {"trainer": [], "OptimizerMonitor": []}
    for message in read_messages(trainer.publisher.journal_path):
        metrics = message.payload.get("metrics") or {}
        norms = {k: v for k, v in metrics.items() if k.startswith("l2_norm/grad/")}
        if message.kind == "metrics" and norms:
            logged[message.payload["source"]].append((message.payload["step"], norms))
    in_process, out_of_process = logged["trainer"], logged["OptimizerMonitor"]
    assert [step for step, _ in in_process] == [2, 4, 6, 8]
    assert [step for step, _ in out_of_process] == [2, 4, 6, 8]
    for (_, mine), (_, theirs) in zip(in_process, out_of_process):
        assert sorted(theirs) == sorted(mine)
        assert theirs == pytest.approx(mine, rel=1e-5)
