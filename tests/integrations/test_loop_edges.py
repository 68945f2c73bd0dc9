"""A hand-written loop written the ways the doc does not show: ``optimizer.step()`` after the batch's block,
several evaluation sets in a row, an epoch over an empty loader. Real runs, real buses and journals."""

from __future__ import annotations

import pathlib

import pytest
import torch

from eventbus.bus.journal import read_messages
from eventbus.integrations import loop
from tests.integrations.test_loop_usage import model_and_optimizer

START = ["init", "before_load", "after_load", "fit_start", "iteration_start"]
STEP = ["batch_start", "before_train_batch", "after_train_batch", "batch_end"]


def events(folder: pathlib.Path) -> list[tuple[str, dict]]:
    return [(str(message.event), message.payload) for message in read_messages(folder / "events.journal")
            if message.kind == "event"]


def test_an_optimizer_step_after_the_batch_block_ends_that_batch(tmp_path):
    """``batch.loss`` given in the block and the step after it (or after a step's microbatch blocks): each
    step is one batch, with its own samples, not a microbatch of the next step (which halved the count)."""
    model, optimizer = model_and_optimizer()
    steps = 0
    with loop.start(model, optimizer, max_duration="4ba", run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        while not run.should_stop:
            for _ in range(1 if steps < 2 else 2):  # two plain steps, then two of two microbatches
                with run.batch(samples=8) as batch:
                    loss = model(torch.randn(8, 4)).pow(2).mean()
                    loss.backward()
                    batch.loss = loss
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    assert steps == 4 and run.step == 4
    journal = events(tmp_path)
    ends = [payload["ts"] for event, payload in journal if event == "batch_end"]
    assert [(ts["batch"], ts["sample"]) for ts in ends] == [(1, 8), (2, 16), (3, 32), (4, 48)]
    names = [event for event, _ in journal]
    assert names == [*START, *[*STEP, "batch_checkpoint"] * 4, "fit_end"]


def test_several_evaluation_sets_in_a_row_are_one_evaluation(tmp_path):
    """Two ``run.evaluate(label=...)`` one after the other are Composer's two evaluators of one evaluation:
    one EVAL_BEFORE_ALL and one EVAL_AFTER_ALL around both, before the batch's BATCH_CHECKPOINT."""
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, max_duration="2ba", run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        while not run.should_stop:
            with run.batch(samples=8):
                optimizer.step()
            for label in ("val", "test"):
                with run.evaluate(label=label) as evaluation:
                    with evaluation.batch(samples=4):
                        pass
                    evaluation.metrics = {"acc": 0.5}
    evaluators = ["eval_start", "eval_batch_start", "eval_batch_end", "eval_end"] * 2
    one_step = [*STEP, "eval_before_all", *evaluators, "eval_after_all", "batch_checkpoint"]
    assert [event for event, _ in events(tmp_path)] == [*START, *one_step, *one_step, "fit_end"]
    assert run.state.eval_metric_values == {"val": {"acc": 0.5}, "test": {"acc": 0.5}}


def test_an_evaluation_before_an_error_still_ends_on_the_bus(tmp_path):
    """EVAL_AFTER_ALL waits for the loop's next mark (another evaluation may join it): an error there still
    publishes it, and no checkpoint event (as Composer, whose evaluation had ended before the error)."""
    model, optimizer = model_and_optimizer()
    try:
        with loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
            with run.batch(samples=8):
                optimizer.step()
            with run.evaluate():
                pass
            raise KeyError("the loop's own error")
    except KeyError:
        pass
    names = [event for event, _ in events(tmp_path)]
    assert names == [*START, *STEP, "eval_before_all", "eval_start", "eval_end", "eval_after_all"]


def test_a_loop_over_an_empty_loader_reaches_an_epoch_duration(tmp_path):
    """An epoch whose loader yields nothing ends (EPOCH_END): ``while not run.should_stop`` with
    ``max_duration=2`` (epochs) stops after two, where it spun forever."""
    model, optimizer = model_and_optimizer()
    epochs = 0
    with loop.start(model, optimizer, max_duration=2, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        while not run.should_stop and epochs < 10:
            epochs += 1
            with run.epoch():
                for _ in torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(0, 4))):
                    raise AssertionError("an empty loader")
    assert epochs == 2 and run.timestamp.epoch.value == 2 and run.step == 0
    names = [event for event, _ in events(tmp_path)]
    assert names == [*START, *["epoch_start", "epoch_end", "epoch_checkpoint"] * 2, "fit_end"]



# ---------------------------------------------------------------------------------------- marks in the wrong order
# Each is refused (RuntimeError; TypeError for metrics that are no mapping) before anything is published, and
# the run goes on: the right marks afterwards are accepted (no flag stuck) and the journal is in Composer's order.

EVAL = ["eval_before_all", "eval_start", "eval_end", "eval_after_all"]


def test_an_evaluation_inside_a_batch_block_is_refused(tmp_path):
    model, optimizer = model_and_optimizer()
    refused = r"run\.evaluate\(\) inside a run\.batch\(\) block .*evaluate after the batch's block"
    with loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        with run.batch(samples=8):
            with pytest.raises(RuntimeError, match=refused):
                with run.evaluate():
                    raise AssertionError("the block must not run")
            with pytest.raises(RuntimeError, match=r"run\.batch\(\) inside another run\.batch\(\) block"):
                with run.batch(samples=8):
                    raise AssertionError("the block must not run")
            optimizer.step()  # the batch still ends: BATCH_END
        with pytest.raises(RuntimeError, match=refused):  # the error leaves the batch's block (a block that raised)
            with run.batch(samples=8):
                with run.evaluate():
                    pass
        with run.batch(samples=8):  # the step the raising block began
            optimizer.step()
        with run.evaluate():  # between batches: accepted
            pass
    names = [event for event, _ in events(tmp_path)]
    assert names == [*START, *STEP, "batch_checkpoint", *STEP, *EVAL, "batch_checkpoint", "fit_end"]


def test_an_epoch_inside_an_epoch_a_batch_or_an_evaluation_is_refused(tmp_path):
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, max_duration=2, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        with run.epoch():
            with pytest.raises(RuntimeError, match=r"run\.epoch\(\) inside another run\.epoch\(\) block: end one"):
                with run.epoch():
                    raise AssertionError("the block must not run")
            with run.batch(samples=8):
                with pytest.raises(RuntimeError, match=r"run\.epoch\(\) inside a run\.batch\(\) block"):
                    with run.epoch():
                        pass
                optimizer.step()
            with run.evaluate():
                with pytest.raises(RuntimeError, match=r"run\.epoch\(\) inside a run\.evaluate\(\) block"):
                    with run.epoch():
                        pass
        with run.epoch():  # the next epoch: accepted
            with run.batch(samples=8):
                optimizer.step()
    assert run.timestamp.epoch.value == 2
    end = ["batch_checkpoint", "epoch_end", "epoch_checkpoint"]
    names = [event for event, _ in events(tmp_path)]
    assert names == [*START, "epoch_start", *STEP, *EVAL, *end, "epoch_start", *STEP, *end, "fit_end"]


def test_an_evaluation_batch_after_its_block_ended_is_refused(tmp_path):
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        with run.evaluate(label="val") as evaluation:
            with evaluation.batch(samples=4):
                pass
        with pytest.raises(RuntimeError, match=r"evaluation\.batch\(\) after its run\.evaluate\(label='val'\) "
                                               r"block ended: use it inside the `with run\.evaluate\(\)"):
            with evaluation.batch(samples=4):
                raise AssertionError("the block must not run")
        with run.evaluate(label="test") as second:  # still joins the first one: Composer's next evaluator
            with second.batch(samples=4):
                pass
    evaluator = ["eval_start", "eval_batch_start", "eval_batch_end", "eval_end"]
    names = [event for event, _ in events(tmp_path)]
    assert names == [*START, "eval_before_all", *evaluator, *evaluator, "eval_after_all", "fit_end"]


def test_a_batch_inside_an_evaluation_is_refused(tmp_path):
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        with run.evaluate() as evaluation:
            with pytest.raises(RuntimeError, match=r"run\.batch\(\) inside a run\.evaluate\(\) block: train after"):
                with run.batch(samples=8):
                    raise AssertionError("the block must not run")
            with pytest.raises(RuntimeError, match=r"run\.evaluate\(\) inside another run\.evaluate\(\) block"):
                with run.evaluate():
                    raise AssertionError("the block must not run")
            evaluation.metrics = {"acc": 1.0}
        with run.batch(samples=8):
            optimizer.step()
        with pytest.raises(KeyError):  # an evaluation whose block raised (it ends there, as Composer's)...
            with run.evaluate():
                raise KeyError("the loop's own error")
        with run.batch(samples=8):  # ...does not leave the run evaluating
            optimizer.step()
    assert run.state.eval_metric_values["eval"] == {"acc": 1.0}
    names = [event for event, _ in events(tmp_path)]
    assert names == [*START, *EVAL, *STEP, "eval_before_all", "eval_start",  # the error: no EVAL_END
                     "batch_checkpoint", *STEP, "batch_checkpoint", "fit_end"]


def test_metrics_that_are_no_mapping_are_refused_where_they_are_given(tmp_path):
    """``evaluation.metrics = None`` and ``run.log(3.0)``: a TypeError naming the argument at that line (they
    failed later, as ``'NoneType' object is not iterable`` without EVAL_END, and an AttributeError)."""
    model, optimizer = model_and_optimizer()
    with loop.start(model, optimizer, run_folder=tmp_path, bus=f"ipc://{tmp_path}/bus") as run:
        with run.evaluate() as evaluation:
            with pytest.raises(TypeError, match=r"evaluation\.metrics must be a mapping of metric name to value, "
                                                r"e\.g\. \{'loss': 0\.5\}; got NoneType"):
                evaluation.metrics = None  # type: ignore[assignment]
            with pytest.raises(TypeError, match=r"evaluation\.metrics must be a mapping .*; got list"):
                evaluation.metrics = [("loss", 0.5)]  # type: ignore[assignment]
            evaluation.metrics = {"loss": 0.5}
        with pytest.raises(TypeError, match=r"run\.log\(\)'s metrics must be a mapping of metric name to value, "
                                            r"e\.g\. run\.log\(\{'train/loss': loss\}\); got float"):
            run.log(3.0)  # type: ignore[arg-type]
        run.log({"train/loss": 3.0})
    assert run.state.eval_metric_values == {"eval": {"loss": 0.5}}
    journal = list(read_messages(tmp_path / "events.journal"))
    assert [str(m.event) for m in journal if m.kind == "event"] == [*START, *EVAL, "fit_end"]
    logged = [m.payload["metrics"] for m in journal if m.kind == "metrics"]
    assert logged == [{"metrics/eval/loss": 0.5}, {"train/loss": 3.0}]
