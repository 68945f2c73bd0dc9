import warnings

import pytest

from eventbus import Callback, Event

pytestmark = pytest.mark.fast

COMPOSER_EVENTS = """INIT BEFORE_LOAD AFTER_LOAD FIT_START ITERATION_START EPOCH_START BEFORE_DATALOADER
AFTER_DATALOADER BATCH_START BEFORE_TRAIN_BATCH BEFORE_FORWARD AFTER_FORWARD BEFORE_LOSS AFTER_LOSS
BEFORE_BACKWARD AFTER_BACKWARD AFTER_TRAIN_BATCH BATCH_END BATCH_CHECKPOINT EPOCH_END EPOCH_CHECKPOINT
ITERATION_END ITERATION_CHECKPOINT FIT_END EVAL_BEFORE_ALL EVAL_START EVAL_BATCH_START EVAL_BEFORE_FORWARD
EVAL_AFTER_FORWARD EVAL_BATCH_END EVAL_END EVAL_AFTER_ALL EVAL_STANDALONE_START EVAL_STANDALONE_END
PREDICT_START PREDICT_BATCH_START PREDICT_BEFORE_FORWARD PREDICT_AFTER_FORWARD PREDICT_BATCH_END
PREDICT_END""".split()


def test_all_40_members_in_composer_order_with_lowercase_values():
    assert [e.name for e in Event] == COMPOSER_EVENTS
    assert len(Event) == 40
    assert all(e.value == e.name.lower() for e in Event)


def test_construct_from_value_or_member():
    assert Event("batch_end") is Event.BATCH_END
    assert Event(Event.BATCH_END) is Event.BATCH_END
    with pytest.raises(ValueError):
        Event("no_such_event")


def test_before_and_after_helpers():
    assert Event.BEFORE_FORWARD.is_before_event and not Event.BEFORE_FORWARD.is_after_event
    assert Event.EPOCH_START.is_before_event
    assert Event.BATCH_END.is_after_event and Event.AFTER_LOSS.is_after_event
    assert Event.EVAL_AFTER_FORWARD.is_after_event and Event.EVAL_BEFORE_ALL.is_before_event
    for neither in (Event.INIT, Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT):
        assert not neither.is_before_event and not neither.is_after_event


def test_canonical_name_pairs_before_and_after():
    assert Event.BATCH_START.canonical_name == Event.BATCH_END.canonical_name == "batch"
    assert Event.BEFORE_FORWARD.canonical_name == Event.AFTER_FORWARD.canonical_name == "forward"
    assert Event.EVAL_BEFORE_FORWARD.canonical_name == "eval_forward"
    for event in Event:
        if event.is_before_event:
            partners = [e for e in Event if e.is_after_event and e.canonical_name == event.canonical_name]
            assert len(partners) == 1, event


def test_is_eval_and_is_predict():
    assert {e for e in Event if e.is_eval} == {e for e in Event if e.value.startswith("eval")}
    assert Event.EVAL_STANDALONE_START.is_eval and not Event.BATCH_END.is_eval
    assert {e.value for e in Event if e.is_predict} == {
        "predict_start", "predict_batch_start", "predict_before_forward",
        "predict_after_forward", "predict_batch_end", "predict_end",
    }


def test_old_names_resolve_with_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="FIT_START"):
        assert Event.TRAINING_START is Event.FIT_START
    with pytest.warns(DeprecationWarning, match="FIT_END"):
        assert Event("training_end") is Event.FIT_END
    with pytest.warns(DeprecationWarning):
        assert Event["TRAINING_END"] is Event.FIT_END
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Event.FIT_START is Event("fit_start")  # the current names do not warn


def test_callback_has_exactly_one_method_per_event():
    public = {name for name in dir(Callback) if not name.startswith("_")}
    assert public - {"run_event", "close", "post_close", "state_dict", "load_state_dict"} == {e.value for e in Event}
