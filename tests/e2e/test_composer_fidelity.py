"""Composer's own callbacks and loggers inside eventbus's Trainer, against real Composer 0.32.1.

Each test runs the same seeded job (same weights, data, optimizer and scheduler) once with
``composer.Trainer`` and once with ``eventbus.Trainer``, both carrying Composer's callback and logger
classes, and compares what they logged. Wall-clock values are compared by key only. Skipped when
``sh scripts/bootstrap.sh test`` installs Composer.
"""

from __future__ import annotations

import json
import re
import warnings
from typing import TYPE_CHECKING, Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import eventbus

if TYPE_CHECKING:
    from composer.loggers import InMemoryLogger

# Composer (installed by scripts/bootstrap.sh test) is imported where it is used, so that collecting the
# suite does not import it.

# Values that depend on the wall clock: the same key must be logged, the value cannot match.
TIMED = ("throughput/", "time/train", "time/val", "time/total", "time/remaining_estimate", "memory/")
# Composer logs these counters once more after the last batch; eventbus's (tested) series stops at it.
COUNTERS = ("time/epoch", "time/batch", "time/sample", "time/batch_in_epoch", "time/sample_in_epoch")


def _data(num: int = 64, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num, 8, generator=generator)
    return DataLoader(TensorDataset(x, (x.sum(dim=1) > 0).long()), batch_size=16)


def _module() -> torch.nn.Module:
    torch.manual_seed(123)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _run(which: str, callbacks: list[Any], loggers: list[Any], **kwargs: Any) -> Any:
    """The seeded job under ``which`` trainer; returns the trainer after fit."""
    import composer
    from composer.models import ComposerClassifier as ComposerComposerClassifier
    from composer.optim import CosineAnnealingScheduler

    module = _module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    common = dict(train_dataloader=_data(), eval_dataloader=_data(32, seed=1), optimizers=optimizer,
                  schedulers=CosineAnnealingScheduler(t_max="1dur"), callbacks=callbacks, loggers=loggers,
                  device="cpu", seed=7, progress_bar=False)
    common.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if which == "composer":
            trainer = composer.Trainer(model=ComposerComposerClassifier(module, num_classes=2), **common)
        else:
            trainer = eventbus.Trainer(eventbus.ComposerClassifier(module, num_classes=2), bus=False, **common)
        trainer.fit()
        trainer.close()
    return trainer


def _series(memory: InMemoryLogger) -> dict[str, list[Any]]:
    return {key: [_number(value) for _, value in values] for key, values in memory.data.items()}


def _number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def _compare_series(ours: dict[str, list[Any]], theirs: dict[str, list[Any]]) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, expected in theirs.items():
        got = ours[key]
        if key.startswith(TIMED):
            assert len(got) == len(expected), key
        elif key in COUNTERS:
            assert got == expected[:len(got)] and len(expected) - len(got) <= 1, key
        else:
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-6), key


def _monitors() -> list[Any]:
    from composer.callbacks import LRMonitor, MemoryMonitor, OptimizerMonitor, RuntimeEstimator, SpeedMonitor

    return [LRMonitor(), SpeedMonitor(window_size=2), RuntimeEstimator(), OptimizerMonitor(batch_log_interval=1),
            MemoryMonitor()]


def _file_keys(path: Any) -> set[str]:
    text = path.read_text()
    return set(re.findall(r"^\[metric\]\[batch=\d+\]: (\S+): ", text, flags=re.MULTILINE))


def _tensorboard_tags(folder: Any) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags.update(accumulator.Tags()["scalars"])
    return tags


def test_composer_monitors_and_loggers_log_what_composer_logs(tmp_path):
    from composer.loggers import FileLogger, InMemoryLogger, TensorboardLogger

    results = {}
    for which in ("composer", "eventbus"):
        memory = InMemoryLogger()
        file_logger = FileLogger(filename=str(tmp_path / which / "log.txt"), remote_file_name="uploaded/log.txt",
                                 capture_stdout=False, capture_stderr=False)
        board = TensorboardLogger(log_dir=str(tmp_path / which / "tb"), flush_interval=1)
        trainer = _run(which, _monitors(), [memory, file_logger, board], max_duration="2ep", eval_interval="1ep")
        results[which] = (_series(memory), _file_keys(tmp_path / which / "log.txt"),
                          _tensorboard_tags(tmp_path / which / "tb"), trainer)
    ours, theirs = results["eventbus"], results["composer"]
    _compare_series(ours[0], theirs[0])
    for prefix in ("lr-SGD/group0", "l2_norm/grad/global", "l2_norm/grad/module.0.weight",
                   "throughput/batches_per_sec", "time/remaining_estimate", "metrics/train/MulticlassAccuracy",
                   "metrics/eval/CrossEntropy"):
        assert prefix in ours[0], prefix
    assert ours[1] == theirs[1] and "loss/train/total" in ours[1]
    assert ours[2] == theirs[2] and "loss/train/total" in ours[2]
    # FileLogger uploads its file through Logger.upload_file: it lands in the run folder's artifacts/.
    assert (ours[3].run_folder / "artifacts" / "uploaded" / "log.txt").is_file()


@pytest.mark.parametrize("make_stopper", [  # each given the module composer.callbacks
    lambda callbacks: callbacks.EarlyStopper("MulticlassAccuracy", "eval", patience="1ba", min_delta=10.0),
    lambda callbacks: callbacks.ThresholdStopper("MulticlassAccuracy", "eval", threshold=0.0),
    lambda callbacks: callbacks.EarlyStopper("MulticlassAccuracy", "train", patience=1, min_delta=10.0),
], ids=["early-eval", "threshold-eval", "early-train-epochs"])
def test_composer_stoppers_stop_where_composer_stops(make_stopper: Callable[[Any], Any]):
    import composer.callbacks
    from composer.loggers import InMemoryLogger

    stopped = {}
    for which in ("composer", "eventbus"):
        memory = InMemoryLogger()
        trainer = _run(which, [make_stopper(composer.callbacks)], [memory], max_duration="4ep", eval_interval="1ba")
        stopped[which] = (int(trainer.state.timestamp.batch), _series(memory))
    assert stopped["eventbus"][0] == stopped["composer"][0] < 16  # stopped early
    _compare_series(stopped["eventbus"][1], stopped["composer"][1])


@pytest.mark.parametrize("max_duration, interval, expected_eval_batches", [
    ("1ep", "0.5dur", [2, 4]),
    ("2ep", "0.25dur", [2, 4, 6, 8]),
])
def test_microbatched_dur_run_fires_composers_events_and_keys(max_duration, interval, expected_eval_batches):
    from composer.loggers import InMemoryLogger

    from tests.e2e.fidelity_callbacks import Recorder

    runs = {}
    for which in ("composer", "eventbus"):
        recorder, memory = Recorder(), InMemoryLogger()
        _run(which, [recorder], [memory], max_duration=max_duration, eval_interval=interval,
             device_train_microbatch_size=8)
        runs[which] = (recorder.events, memory, recorder.losses)
    assert runs["eventbus"][0] == runs["composer"][0]
    # state.loss is the last microbatch's own loss there, as in Composer (not the batch's total).
    assert [e for e, _ in runs["eventbus"][2]] == [e for e, _ in runs["composer"][2]]
    assert [v for _, v in runs["eventbus"][2]] == pytest.approx([v for _, v in runs["composer"][2]], rel=1e-5)
    evaluated_at = [int(ts.batch) for ts, _ in runs["eventbus"][1].data["metrics/eval/CrossEntropy"]]
    assert evaluated_at == expected_eval_batches
    _compare_series(_series(runs["eventbus"][1]), _series(runs["composer"][1]))


def test_composer_types_compare_and_convert_both_ways():
    from composer.core import Event as CEvent
    from composer.core import Time as CTime
    from composer.core import TimeUnit as CTimeUnit

    assert eventbus.Event.BATCH_END == CEvent.BATCH_END and eventbus.Event(CEvent.FIT_END) is eventbus.Event.FIT_END
    assert eventbus.TimeUnit(CTimeUnit.EPOCH) is eventbus.TimeUnit.EPOCH
    assert eventbus.TimeUnit.BATCH == CTimeUnit.BATCH and CTimeUnit(eventbus.TimeUnit.BATCH) == CTimeUnit.BATCH
    assert eventbus.Time(3, "ep") - eventbus.Time(1, "ep") > CTime(1, CTimeUnit.EPOCH)
    assert eventbus.Timestamp(batch=3) >= CTime(3, CTimeUnit.BATCH)
    assert eventbus.Timestamp(epoch=2).get(CTimeUnit.EPOCH) == eventbus.Time(2, "ep")
    assert (eventbus.Time(2, "ba") / CTime(4, CTimeUnit.BATCH)).value == 0.5


def test_worker_loads_composer_callbacks_and_loggers():
    from composer.callbacks import LRMonitor
    from composer.loggers import InMemoryLogger

    from eventbus.runtime.loading import load_callback

    assert isinstance(load_callback("composer.callbacks:LRMonitor"), LRMonitor)
    assert isinstance(load_callback("composer.loggers:InMemoryLogger"), InMemoryLogger)


def test_composers_checkpoint_saver_in_a_worker_is_a_one_line_error_naming_the_checkpoint_daemon(tmp_path):
    """Hosted, it would fail at its first save deep in Composer (a snapshot has no FSDP settings); the
    worker refuses it before it connects, and says what to run instead."""
    import os
    import subprocess
    import sys

    from eventbus.errors import ConfigError
    from eventbus.runtime.loading import load_callback
    from tests.support import REPO_ROOT

    with pytest.raises(ConfigError, match="python -m eventbus.workers.checkpoint"):
        load_callback('composer.callbacks:CheckpointSaver:{"save_folder": "never-made"}')
    assert not (tmp_path / "never-made").exists()  # refused before it was built (the test runs in tmp_path)
    result = subprocess.run([sys.executable, "-m", "eventbus", "worker", "--connect", f"ipc://{tmp_path}/bus",
                             "--callback", "composer.callbacks:CheckpointSaver"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "CheckpointSaver" in lines[0] and "python -m eventbus.workers.checkpoint" in lines[0]


def test_metric_order_is_the_models_own_as_in_composer(tmp_path):
    """Iterating state.eval_metrics / state.train_metrics gives Composer's order (its
    ComposerClassifier's: CrossEntropy before MulticlassAccuracy), which logs and CSV columns follow."""
    from tests.e2e.fidelity_callbacks import MetricOrder

    orders = {}
    for which in ("composer", "eventbus"):
        path = tmp_path / f"{which}.json"
        _run(which, [MetricOrder(str(path))], [], max_duration="1ep", eval_interval="1ep")
        orders[which] = json.loads(path.read_text())
    assert orders["composer"]["eval"] == ["CrossEntropy", "MulticlassAccuracy"]
    assert orders["eventbus"] == orders["composer"]


def test_train_metrics_are_logged_when_composer_logs_them(tmp_path):
    """Composer computes and logs metrics/train/* before every BATCH_END and once more at each epoch's
    end (so twice at an epoch's last batch): eventbus logs the same points at the same steps."""
    from composer.loggers import InMemoryLogger

    logged = {}
    for which in ("composer", "eventbus"):
        memory = InMemoryLogger()
        _run(which, [], [memory], max_duration="2ep", eval_interval="1ep")
        logged[which] = [(int(ts.batch), _number(value))
                         for ts, value in memory.data["metrics/train/MulticlassAccuracy"]]
    assert len(logged["composer"]) == 2 * (4 + 1)  # 4 batches per epoch, and the epoch's end
    assert [step for step, _ in logged["eventbus"]] == [step for step, _ in logged["composer"]]
    assert [v for _, v in logged["eventbus"]] == pytest.approx([v for _, v in logged["composer"]], rel=1e-5)


def test_composers_checkpoint_saver_runs_in_process_and_eventbus_resumes_from_its_files(tmp_path):
    from composer.callbacks import CheckpointSaver

    files = {}
    for which in ("composer", "eventbus"):
        folder = tmp_path / which
        _run(which, [CheckpointSaver(folder=str(folder), save_interval="1ep")], [], max_duration="2ep")
        files[which] = sorted(p.name for p in folder.iterdir())
    assert files["eventbus"] == files["composer"] == ["ep1-ba4-rank0.pt", "ep2-ba8-rank0.pt", "latest-rank0.pt"]
    module = _module()
    resumed = eventbus.Trainer(eventbus.ComposerClassifier(module, num_classes=2), _data(), max_duration="2ep",
                               optimizers=torch.optim.SGD(module.parameters(), lr=0.1), bus=False, device="cpu",
                               load_path=str(tmp_path / "eventbus" / "ep1-ba4-rank0.pt"))
    assert int(resumed.state.timestamp.batch) == 4 and int(resumed.state.timestamp.epoch) == 1
    resumed.fit()
    assert int(resumed.state.timestamp.batch) == 8
    resumed.close()
