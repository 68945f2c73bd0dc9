"""A hand-written loop used the ways users write them: AMP's skipped steps, a loss read as a number, a run
name used twice, a run used after it closed, a run never closed. Real buses and journals; the last one
in a process of its own, which exits without closing it."""

from __future__ import annotations

import io
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from eventbus.bus.journal import read_messages
from eventbus.bus.subscribe.journal_stream import journal_messages
from eventbus.errors import ConfigError
from eventbus.integrations import loop
from eventbus.runtime.host import CallbackHost
from eventbus.workers.logger import ProgressLogger


def batch_ends(folder: pathlib.Path) -> list[dict]:
    return [message.payload for message in read_messages(folder / "events.journal")
            if message.event == "batch_end"]


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_a_step_the_grad_scaler_skips_still_ends_its_batch(tmp_path):
    """AMP's GradScaler skips ``optimizer.step()`` when the gradients hold inf: given as ``scaler=``, that
    batch still ends (Composer, Lightning and Hugging Face count it), where it was taken for accumulation."""
    model, optimizer = model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu")
    with loop.start(model, optimizer, max_duration="6ba", run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus",
                    scaler=scaler) as run:
        batches = 0
        while not run.should_stop:
            with run.batch(samples=8) as batch:
                optimizer.zero_grad()
                loss = model(torch.randn(8, 4)).pow(2).mean()
                if batches in (1, 2):
                    loss = loss * float("inf")  # gradients of inf: the scaler skips this step
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                batch.loss = loss
            batches += 1
    assert batches == 6 and run.step == 6
    ends = batch_ends(tmp_path)
    assert [payload["ts"]["batch"] for payload in ends] == list(range(1, 7))  # timestamp.batch at each BATCH_END
    assert "step" not in scaler.__dict__  # the scaler is the user's own again


def test_a_loss_given_as_a_number_reaches_the_snapshot(tmp_path):
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, max_duration="2ba", run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        for value in (0.5, float("nan")):
            with run.batch(samples=8) as batch:
                optimizer.step()
                batch.loss = value  # read with .item() in the user's loop
        with pytest.raises(TypeError, match="tensor or a number"):
            with run.batch() as batch:
                optimizer.step()
                batch.loss = "0.5"
    losses = [payload["loss"] for payload in batch_ends(tmp_path)]
    assert losses[0] == 0.5 and losses[1] != losses[1]  # NaN, for the health daemon to see


@pytest.mark.parametrize("microbatches", [1, 2])
async def test_the_logger_s_progress_lines_show_the_loss_of_a_loop_that_logs_none(tmp_path, microbatches):
    """A loop (like Lightning and Hugging Face) logs no ``loss/train/total``: the progress line shows the loss
    its snapshot holds, the step's whole loss under gradient accumulation (not its last microbatch's share)."""
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, max_duration="4ba", run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus",
                    steps_per_epoch=4) as run:
        with run.epoch():
            for value in (4.0, 3.0, 2.0, 1.25):
                for microbatch in range(microbatches):
                    with run.batch(samples=8) as batch:
                        model(torch.randn(8, 4)).sum().backward()
                        if microbatch == microbatches - 1:
                            optimizer.step()
                            optimizer.zero_grad()
                        batch.loss = torch.tensor(value / microbatches)  # each microbatch's share
    stream = io.StringIO()
    await CallbackHost([ProgressLogger(stream=stream, log_interval=2)]).run(journal_messages(tmp_path / "events.journal"))
    assert re.findall(r"\[batch (\d)/4\] loss (\S+)", stream.getvalue()) == [("2", "3"), ("4", "1.25")]


def test_a_run_name_used_again_is_refused_unless_it_is_resumed(tmp_path):
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        with run.batch():
            optimizer.step()
    with pytest.raises(ConfigError, match="already exists .* resume=True"):
        loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus")
    with loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus", resume=True) as run:
        assert run.step == 0  # no checkpoint was written: the journal's second run starts over


def test_a_closed_run_refuses_further_marks(tmp_path):
    model, optimizer = model_and_optimizer()
    run = loop.start(model, optimizer, run_folder=tmp_path, bus=False)
    run.close()
    for mark in (run.batch_start, lambda: run.log({"x": 1.0}), lambda: run.epoch().__enter__(),
                 lambda: run.evaluate().__enter__()):
        with pytest.raises(RuntimeError, match="is closed"):
            mark()


def test_a_run_never_closed_still_ends_on_the_bus_at_exit(tmp_path):
    """A loop without ``with`` or ``close()``: at the interpreter's exit every batch published is journaled,
    the run's end too (followers exit), and the socket files are gone."""
    script = textwrap.dedent(f"""
        import torch
        from eventbus.integrations import loop
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        run = loop.start(model, optimizer, run_folder={str(tmp_path)!r}, bus="ipc://{tmp_path}/bus")
        for _ in range(10):
            with run.batch(samples=8) as batch:
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                optimizer.step()
                batch.loss = loss
            run.log({{"train/loss": loss}})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True)
    messages = list(read_messages(tmp_path / "events.journal"))
    assert [m.payload["ts"]["batch"] for m in messages if m.event == "batch_end"] == list(range(1, 11))
    assert messages[-1].kind == "end"
    assert not (tmp_path / "bus").exists() and not (tmp_path / "bus.ctl").exists()
