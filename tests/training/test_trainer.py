"""Trainer behaviour a user relies on: configuration errors, microbatching, resume, metrics."""

from __future__ import annotations

import datetime
import gc
import pathlib
import time

import pytest
import torch

from eventbus import (
    Callback,
    ComposerModel,
    ConfigError,
    Evaluator,
    GradientClipping,
    InMemoryLogger,
    Trainer,
)
from eventbus.bus.journal import read_messages
from tests.support import make_loader, make_model, make_trainer


class LossRecorder(Callback):
    def __init__(self):
        self.losses: list[float] = []

    def after_train_batch(self, state, logger):
        self.losses.append(state.loss.item())


@pytest.mark.parametrize("kwargs, argument", [
    (dict(max_duration="3weeks"), "max_duration"),
    (dict(max_duration="0.5dur"), "max_duration"),
    (dict(max_duration=[1]), "max_duration"),
    (dict(max_duration=1, eval_interval=[2]), "eval_interval"),
    (dict(max_duration=1, eval_interval=1.5), "eval_interval"),
    (dict(max_duration=1, eval_interval="2parsecs"), "eval_interval"),
    (dict(max_duration=1, device_train_microbatch_size=0), "device_train_microbatch_size"),
    (dict(max_duration=1, device_train_microbatch_size=-4), "device_train_microbatch_size"),
    (dict(max_duration=1, device_train_microbatch_size="auto"), "device_train_microbatch_size"),
    (dict(max_duration=1, train_subset_num_batches=0), "train_subset_num_batches"),
    (dict(max_duration=1, precision="fp8"), "precision"),
    (dict(max_duration=1, eval_dataloader=make_loader(8, 16, shuffle=False).__class__([], batch_size=1)),
     "eval_dataloader"),
])
@pytest.mark.fast
def test_bad_configuration_names_the_argument(kwargs, argument):
    with pytest.raises(ConfigError, match=argument):
        Trainer(make_model(), make_loader(), device="cpu", **kwargs)


@pytest.mark.fast
def test_empty_train_dataloader_is_rejected():
    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 8)), batch_size=4)
    with pytest.raises(ConfigError, match="train_dataloader is empty"):
        Trainer(make_model(), empty, max_duration=1, device="cpu")


@pytest.mark.fast
def test_missing_duration_and_loader_are_explained():
    with pytest.raises(ConfigError, match="max_duration is not set"):
        Trainer(make_model(), make_loader(), device="cpu").fit()
    with pytest.raises(ConfigError, match="train_dataloader is not set"):
        Trainer(make_model(), max_duration=1, device="cpu").fit()


@pytest.mark.fast
def test_plain_module_is_rejected_with_a_hint():
    with pytest.raises(ConfigError, match="ComposerClassifier"):
        Trainer(torch.nn.Linear(8, 2), make_loader(), max_duration=1)  # type: ignore[arg-type]


def _gradients_after_one_batch(microbatch_size):
    torch.manual_seed(0)
    model = make_model()
    grads = {}

    class Grab(Callback):
        def after_train_batch(self, state, logger):
            grads.update({n: p.grad.clone() for n, p in state.model.named_parameters()})

    trainer = Trainer(model, make_loader(48, 48), max_duration="1ba", seed=1, device="cpu",
                      device_train_microbatch_size=microbatch_size, callbacks=[Grab()])
    model.load_state_dict(_reference_weights())
    trainer.fit()
    return grads, trainer.state.total_loss_dict["loss/train/total"]


def _reference_weights():
    torch.manual_seed(123)
    return make_model().state_dict()


@pytest.mark.fast
@pytest.mark.parametrize("microbatch_size", [16, 20, 1])
def test_microbatching_accumulates_the_full_batch_gradient(microbatch_size):
    full, full_loss = _gradients_after_one_batch(None)
    micro, micro_loss = _gradients_after_one_batch(microbatch_size)
    for name in full:
        torch.testing.assert_close(micro[name], full[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(micro_loss, full_loss, rtol=1e-5, atol=1e-6)


def _split_run(tmp_path, total: str, first: str, **kwargs):
    def trainer(duration, seed_model):
        recorder = LossRecorder()
        return make_trainer(tmp_path, duration, model_seed=seed_model, dropout=0.3, shuffle=True, adam_lr=1e-2,
                            seed=7, bus=None, callbacks=[recorder], **kwargs), recorder

    whole, whole_losses = trainer(total, 0)
    whole.fit()
    part1, losses1 = trainer(first, 0)
    part1.fit()
    path = tmp_path / "checkpoint.pt"
    torch.save(part1.state_dict(), path)
    part2, losses2 = trainer(total, 99)  # different initial weights: everything must come from the file
    part2.load_state_dict(torch.load(path, weights_only=True))
    part2.fit()
    return whole_losses.losses, losses1.losses + losses2.losses, part2


@pytest.mark.fast
@pytest.mark.parametrize("total, first", [("10ba", "6ba"), ("3ep", "1ep"), ("3ep", "4ba")])
def test_save_and_load_gives_bit_identical_losses(tmp_path, total, first):
    whole, split, resumed = _split_run(tmp_path, total, first)
    assert split == whole  # exact float equality, not approximate
    assert resumed.state.timestamp.batch.value == len(whole)


@pytest.mark.fast
def test_load_path_resumes_from_a_file(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(make_model(), make_loader(), max_duration="3ba", seed=3, device="cpu")
    trainer.fit()
    torch.save(trainer.state_dict(), tmp_path / "ckpt.pt")
    resumed = Trainer(make_model(), make_loader(), max_duration="5ba", seed=3, device="cpu",
                      load_path=tmp_path / "ckpt.pt")
    assert resumed.state.timestamp.batch.value == 3
    for a, b in zip(trainer.state.model.parameters(), resumed.state.model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="does not exist"):
        Trainer(make_model(), make_loader(), device="cpu", load_path=tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        Trainer(make_model(), make_loader(), device="cpu", load_path=tmp_path / "garbage.pt")
    (tmp_path / "checkpoints").mkdir()  # the folder of checkpoints, given for one of them
    with pytest.raises(ConfigError, match="is a folder, not a checkpoint"):
        Trainer(make_model(), make_loader(), device="cpu", load_path=tmp_path / "checkpoints")


@pytest.mark.fast
def test_checkpoint_layout_matches_composer_and_loads_weights_only(tmp_path):
    class Counter(Callback):
        def __init__(self):
            self.n = 0

        def batch_end(self, state, logger):
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    trainer = Trainer(make_model(), make_loader(), max_duration="2ba", device="cpu", callbacks=[Counter()],
                      schedulers=None)
    trainer.fit()
    torch.save(trainer.state_dict(), tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(loaded) == {"state", "rng"}
    assert {"model", "optimizers", "schedulers", "callbacks", "timestamp", "rank_zero_seed", "run_name"} <= set(
        loaded["state"])
    assert loaded["state"]["callbacks"] == {"Counter": {"n": 2}}
    counter = Counter()
    Trainer(make_model(), make_loader(), device="cpu", callbacks=[counter], load_path=tmp_path / "c.pt")
    assert counter.n == 2


@pytest.mark.fast
def test_logs_composer_keys_and_eval_metrics():
    memory = InMemoryLogger()
    trainer = Trainer(make_model(), make_loader(), max_duration="1ep", device="cpu", loggers=[memory],
                      eval_dataloader=Evaluator("val", make_loader(32, 16)), compute_training_metrics=True)
    trainer.fit()
    for key in ("loss/train/total", "time/epoch", "time/batch", "time/sample", "time/batch_in_epoch",
                "time/sample_in_epoch", "metrics/train/MulticlassAccuracy", "metrics/val/MulticlassAccuracy",
                "metrics/val/CrossEntropy"):
        assert key in memory.data, key
    assert len(memory.data["loss/train/total"]) == 4
    assert [v for _, v in memory.data["time/batch"]] == [0, 1, 2, 3]
    accuracy = memory.most_recent_values["metrics/val/MulticlassAccuracy"]
    assert 0.0 <= accuracy <= 1.0
    assert trainer.state.eval_metric_values["val"]["MulticlassAccuracy"].item() == pytest.approx(accuracy)
    assert memory.hyperparameters["max_duration"] == "1ep"


def test_eval_time_is_not_training_time():
    class SlowEval(Callback):
        def eval_end(self, state, logger):
            time.sleep(0.3)

    trainer = Trainer(make_model(), make_loader(), max_duration="2ep", device="cpu", callbacks=[SlowEval()],
                      eval_dataloader=make_loader(16, 16), eval_interval="1ba")
    started = time.monotonic()
    trainer.fit()
    whole = datetime.timedelta(seconds=time.monotonic() - started)
    # 8 evaluations slept 2.4 s in all: the training clock leaves them out (however slow the machine,
    # what fit() took minus the evaluations' sleeps bounds it), and no batch's clock holds one.
    slept = datetime.timedelta(seconds=8 * 0.3)
    assert trainer.state.timestamp.total_wct <= whole - slept
    assert trainer.state.timestamp.batch_wct < datetime.timedelta(seconds=0.3)


@pytest.mark.fast
def test_schedulers_step_per_epoch_by_default_and_per_batch_on_request():
    def lrs(every_batch):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        trainer = Trainer(model, make_loader(), max_duration="2ep", optimizers=optimizer, schedulers=scheduler,
                          step_schedulers_every_batch=every_batch, device="cpu")
        trainer.fit()
        return trainer.state.lrs["SGD"][0]

    assert lrs(None) == 0.25       # 2 epochs
    assert lrs(True) == 0.5 ** 8   # 8 batches


@pytest.mark.fast
def test_gradient_clipping_bounds_the_gradient_norm():
    norms = []

    class Norm(Callback):
        def after_train_batch(self, state, logger):
            grads = [p.grad for p in state.model.parameters()]
            norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    class Huge(ComposerModel):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 2)

        def forward(self, batch):
            return self.linear(batch[0])

        def loss(self, outputs, batch):
            return outputs.pow(2).sum() * 1000

    # Callbacks run after algorithms on AFTER_TRAIN_BATCH, so Norm sees the clipped gradients.
    Trainer(Huge(), make_loader(), max_duration="3ba", device="cpu", callbacks=[Norm()],
            algorithms=[GradientClipping("norm", 0.5)]).fit()
    assert norms and all(n <= 0.5 + 1e-4 for n in norms)


@pytest.mark.fast
def test_amp_bf16_trains_on_cpu():
    memory = InMemoryLogger()
    Trainer(make_model(), make_loader(), max_duration="2ba", device="cpu", precision="amp_bf16",
            loggers=[memory]).fit()
    assert len(memory.data["loss/train/total"]) == 2


@pytest.mark.fast
def test_composer_docs_callbacks_work_unchanged(capsys):
    from eventbus import Event, Logger, State  # the documented import line

    class EpochMonitor(Callback):
        def epoch_start(self, state: State, logger: Logger):
            print(f'Epoch: {int(state.timestamp.epoch)}')

    class RunEventMonitor(Callback):
        def run_event(self, event: Event, state: State, logger: Logger):
            if event == Event.EPOCH_START:
                print(f'Epoch: {int(state.timestamp.epoch)}')

    for callback in (EpochMonitor(), RunEventMonitor()):
        Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", callbacks=[callback]).fit()
        assert capsys.readouterr().out.splitlines() == ["Epoch: 0", "Epoch: 1", "Epoch: 2"]


def test_a_trainer_dropped_without_close_ends_its_run(tmp_path):
    """As Composer's engine does once collected: a trainer let go after fit (a sweep in a notebook) ends its
    run on the bus, rather than keeping its bus thread and sockets, with the journal unfinished, until exit."""
    trainer = Trainer(make_model(), make_loader(), max_duration="2ba", device="cpu", run_folder=tmp_path / "run")
    trainer.fit()
    publisher = trainer.publisher
    socket_file = pathlib.Path(publisher.address.removeprefix("ipc://"))
    assert socket_file.exists() and publisher._thread.is_alive()
    gc.disable()  # collected here, not by an automatic collection on the bus thread, which closes asynchronously
    try:
        del trainer
        gc.collect()
    finally:
        gc.enable()
    assert not publisher._thread.is_alive()
    assert not socket_file.exists()
    messages = list(read_messages(publisher.journal_path))
    assert [m.kind for m in messages[-2:]] == ["event", "end"] and messages[-2].event == "fit_end"
