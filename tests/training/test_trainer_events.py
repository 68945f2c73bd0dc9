"""Event order and counts against the loop and formulas in Composer's reference."""

from __future__ import annotations

import pytest

from eventbus import Callback, Evaluator, Event, Trainer
from tests.support import EventRecorder, make_loader, make_model

pytestmark = pytest.mark.fast

E = Event
MICROBATCH = [E.BEFORE_FORWARD, E.AFTER_FORWARD, E.BEFORE_LOSS, E.AFTER_LOSS, E.BEFORE_BACKWARD, E.AFTER_BACKWARD]
FORWARD_BACKWARD = set(MICROBATCH)
PER_STEP = [E.AFTER_DATALOADER, E.BATCH_START, E.BEFORE_TRAIN_BATCH, E.AFTER_TRAIN_BATCH, E.BATCH_END, E.BATCH_CHECKPOINT]


def expected_fit_sequence(epochs: int, batches: int, micro: int, eval_batches: list[int]) -> list[Event]:
    """The documented loop, written out independently of the trainer: eval at every EPOCH_END."""
    seq = [E.INIT, E.BEFORE_LOAD, E.AFTER_LOAD, E.FIT_START, E.ITERATION_START]
    for _ in range(epochs):
        seq.append(E.EPOCH_START)
        for _ in range(batches):
            seq += [E.BEFORE_DATALOADER, E.AFTER_DATALOADER, E.BATCH_START, E.BEFORE_TRAIN_BATCH]
            seq += MICROBATCH * micro
            seq += [E.AFTER_TRAIN_BATCH, E.BATCH_END, E.BATCH_CHECKPOINT]
        seq += [E.BEFORE_DATALOADER, E.EPOCH_END]
        if eval_batches:
            seq.append(E.EVAL_BEFORE_ALL)
            for count in eval_batches:
                seq.append(E.EVAL_START)
                for _ in range(count):
                    seq += [E.EVAL_BATCH_START, E.EVAL_BEFORE_FORWARD, E.EVAL_AFTER_FORWARD, E.EVAL_BATCH_END]
                seq.append(E.EVAL_END)
            seq.append(E.EVAL_AFTER_ALL)
        seq.append(E.EPOCH_CHECKPOINT)
    seq.append(E.FIT_END)
    return seq


def test_full_ordered_sequence_of_a_small_run(recorder):
    trainer = Trainer(
        make_model(), make_loader(num_samples=32, batch_size=16), max_duration="2ep",
        eval_dataloader=[Evaluator("a", make_loader(16, 8)), Evaluator("b", make_loader(8, 8))],
        device_train_microbatch_size=8, callbacks=[recorder], device="cpu",
    )
    trainer.fit()
    assert recorder.events == expected_fit_sequence(epochs=2, batches=2, micro=2, eval_batches=[2, 1])


def fit_counts(*, epochs: int, steps: int, micro: int = 1, evals: int = 0, evaluators: int = 0,
               eval_batches: int = 0, before_dataloader: int | None = None, epoch_starts: int | None = None,
               fits: int = 1) -> dict[Event, int]:
    """Composer's count formulas (reference file) for one trainer's fit() calls."""
    counts = {e: 0 for e in Event}
    counts.update({E.INIT: 1, E.BEFORE_LOAD: 1, E.AFTER_LOAD: 1, E.ITERATION_START: 1, E.FIT_START: fits, E.FIT_END: fits})
    counts[E.EPOCH_START] = epochs if epoch_starts is None else epoch_starts
    counts[E.EPOCH_END] = counts[E.EPOCH_CHECKPOINT] = epochs
    counts[E.BEFORE_DATALOADER] = steps + epochs if before_dataloader is None else before_dataloader
    for event in PER_STEP:
        counts[event] = steps
    for event in MICROBATCH:
        counts[event] = steps * micro
    counts[E.EVAL_BEFORE_ALL] = counts[E.EVAL_AFTER_ALL] = evals
    counts[E.EVAL_START] = counts[E.EVAL_END] = evals * evaluators
    counts[E.EVAL_BATCH_START] = counts[E.EVAL_BATCH_END] = evals * evaluators * eval_batches
    counts[E.EVAL_BEFORE_FORWARD] = counts[E.EVAL_AFTER_FORWARD] = evals * evaluators * eval_batches
    return counts


def run_counts(recorder: EventRecorder) -> dict[Event, int]:
    return {e: recorder.counts.get(e, 0) for e in Event}


# N = 4 batches per epoch (64 samples / 16) throughout.
@pytest.mark.parametrize("name, kwargs, expected", [
    ("epochs", dict(max_duration="3ep"), fit_counts(epochs=3, steps=12)),
    ("bare int is epochs", dict(max_duration=2), fit_counts(epochs=2, steps=8)),
    ("batches mid-epoch", dict(max_duration="10ba"), fit_counts(epochs=2, steps=10, epoch_starts=3)),
    ("batches on the epoch boundary", dict(max_duration="4ba"), fit_counts(epochs=1, steps=4, before_dataloader=4)),
    ("samples", dict(max_duration="40sp"), fit_counts(epochs=0, steps=3, epoch_starts=1)),
    ("microbatches", dict(max_duration="2ep", device_train_microbatch_size=4), fit_counts(epochs=2, steps=8, micro=4)),
    ("uneven microbatches", dict(max_duration="1ep", device_train_microbatch_size=6), fit_counts(epochs=1, steps=4, micro=3)),
    ("train subset", dict(max_duration="2ep", train_subset_num_batches=3), fit_counts(epochs=2, steps=6)),
])
def test_train_counts(recorder, name, kwargs, expected):
    Trainer(make_model(), make_loader(), callbacks=[recorder], device="cpu", **kwargs).fit()
    assert run_counts(recorder) == expected, name


@pytest.mark.parametrize("eval_interval, max_duration, evals, epochs, steps", [
    (1, "2ep", 2, 2, 8),             # every epoch: E//k, FIT_END already covered
    ("2ba", "2ep", 4, 2, 8),         # every 2 batches: steps//k
    ("3ba", "2ep", 3, 2, 8),         # 8 % 3 != 0: 2 periodic + 1 at the end of training
    ("2ep", "3ep", 2, 3, 12),        # epoch 2 + end of training at epoch 3
    ("32sp", "1ep", 2, 1, 4),        # samples: every 2 batches of 16
    ("0.5dur", "2ep", 2, 2, 8),      # half of max_duration
    (0, "2ep", 0, 2, 8),             # disabled: not even at the end
])
def test_eval_interval_counts(recorder, eval_interval, max_duration, evals, epochs, steps):
    evaluators = [Evaluator("x", make_loader(16, 8)), Evaluator("y", make_loader(16, 8))]
    Trainer(make_model(), make_loader(), max_duration=max_duration, eval_dataloader=evaluators,
            eval_interval=eval_interval, callbacks=[recorder], device="cpu").fit()
    assert run_counts(recorder) == fit_counts(epochs=epochs, steps=steps, evals=evals, evaluators=2, eval_batches=2)


def test_evaluators_with_their_own_intervals_and_subsets(recorder):
    evaluators = [
        Evaluator("every_batch", make_loader(32, 8), eval_interval="1ba", subset_num_batches=1),
        Evaluator("every_epoch", make_loader(32, 8), eval_interval="1ep"),
    ]
    Trainer(make_model(), make_loader(), max_duration="2ep", eval_dataloader=evaluators,
            callbacks=[recorder], device="cpu").fit()
    counts = recorder.counts
    assert counts[E.EVAL_BEFORE_ALL] == 8 + 2  # one evaluation per due point
    assert counts[E.EVAL_START] == 8 + 2
    assert counts[E.EVAL_BATCH_START] == 8 * 1 + 2 * 4


def test_callable_eval_interval(recorder):
    seen = []

    def every_third_batch(state, event):
        seen.append(event)
        return event is Event.BATCH_END and state.timestamp.batch.value % 3 == 0

    Trainer(make_model(), make_loader(), max_duration="2ep", eval_dataloader=make_loader(16, 16),
            eval_interval=every_third_batch, callbacks=[recorder], device="cpu").fit()
    assert recorder.counts[E.EVAL_START] == 2
    assert set(seen) == {E.BATCH_END, E.EPOCH_END, E.FIT_END}


class StopAt(Callback):
    def __init__(self, batch: int, event: str = "batch_end"):
        self.batch, self.event = batch, event

    def run_event(self, event, state, logger):
        if event.value == self.event and state.timestamp.batch.value == self.batch:
            state.stop_training()


def test_mid_epoch_stop_skips_epoch_end_and_evaluates_at_fit_end(recorder):
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", eval_dataloader=make_loader(16, 16),
                      callbacks=[StopAt(6), recorder], device="cpu")
    trainer.fit()
    assert run_counts(recorder) == fit_counts(epochs=1, steps=6, epoch_starts=2, evals=2, evaluators=1, eval_batches=1)
    assert recorder.events[-1] is E.EVAL_AFTER_ALL and recorder.events.index(E.FIT_END) < len(recorder.events) - 1
    assert trainer.state.stop_reason


def test_repeated_fit_calls_continue_the_same_run(recorder):
    trainer = Trainer(make_model(), make_loader(), max_duration="3ba", callbacks=[recorder], device="cpu")
    trainer.fit()
    trainer.fit(duration="3ba")
    trainer.fit(duration="1ep")
    # Composer: fit(duration=d) trains until timestamp.get(d.unit) + d, here epoch 1 + 1ep.
    assert trainer.state.timestamp.batch.value == 8
    assert run_counts(recorder) == fit_counts(epochs=2, steps=8, fits=3)


def test_standalone_eval_and_predict(recorder):
    trainer = Trainer(make_model(), make_loader(), eval_dataloader=[
        Evaluator("a", make_loader(32, 8)), Evaluator("b", make_loader(16, 8))], callbacks=[recorder], device="cpu")
    trainer.eval()
    outputs = trainer.predict(make_loader(48, 16))
    counts = recorder.counts
    assert counts[E.EVAL_STANDALONE_START] == counts[E.EVAL_STANDALONE_END] == 1
    assert counts[E.EVAL_BEFORE_ALL] == counts[E.EVAL_AFTER_ALL] == 0
    assert counts[E.EVAL_START] == 2 and counts[E.EVAL_BATCH_START] == 4 + 2
    assert counts[E.PREDICT_START] == counts[E.PREDICT_END] == 1
    for event in (E.PREDICT_BATCH_START, E.PREDICT_BEFORE_FORWARD, E.PREDICT_AFTER_FORWARD, E.PREDICT_BATCH_END):
        assert counts[event] == 3
    assert len(outputs) == 3 and outputs[0].shape == (16, 2)
    assert counts[E.BEFORE_DATALOADER] == counts[E.AFTER_DATALOADER] == 0  # no dataloader events outside fit
    predict = [e for e in recorder.events if e.is_predict]
    assert predict[:5] == [E.PREDICT_START, E.PREDICT_BATCH_START, E.PREDICT_BEFORE_FORWARD,
                           E.PREDICT_AFTER_FORWARD, E.PREDICT_BATCH_END]


def test_timestamp_advances_just_before_batch_end_and_epoch_end():
    seen = []

    class Watch(Callback):
        def after_train_batch(self, state, logger):
            seen.append(("after_train_batch", state.timestamp.batch.value))

        def batch_end(self, state, logger):
            seen.append(("batch_end", state.timestamp.batch.value))

        def epoch_end(self, state, logger):
            seen.append(("epoch_end", int(state.timestamp.epoch), state.timestamp.batch_in_epoch.value))

    Trainer(make_model(), make_loader(32, 16), max_duration="1ep", callbacks=[Watch()], device="cpu").fit()
    assert seen == [("after_train_batch", 0), ("batch_end", 1), ("after_train_batch", 1), ("batch_end", 2),
                    ("epoch_end", 1, 0)]
