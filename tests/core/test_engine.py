"""Engine ordering and the close/post_close guarantees, with real callbacks and a real trainer."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from eventbus import Algorithm, Callback, Event, LoggerDestination, Trainer
from tests.support import REPO_ROOT, make_loader, make_model


class Tagged(Callback):
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def run_event(self, event, state, logger):
        if event in (Event.INIT, Event.FIT_START):
            self.log.append((event.value, self.name))

    def close(self, state, logger):
        self.log.append(("close", self.name))

    def post_close(self):
        self.log.append(("post_close", self.name))


class TaggedDestination(LoggerDestination, Tagged):
    pass


class TaggedAlgorithm(Algorithm):
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def match(self, event, state):
        return event in (Event.BEFORE_FORWARD, Event.AFTER_FORWARD)

    def apply(self, event, state, logger):
        self.log.append((event.value, self.name))


@pytest.mark.fast
def test_loggers_first_on_init_last_otherwise_and_close_then_post_close():
    log: list = []
    trainer = Trainer(make_model(), make_loader(16, 16), max_duration="1ba", device="cpu",
                      callbacks=[Tagged("a", log), Tagged("b", log)], loggers=[TaggedDestination("L", log)])
    trainer.fit()
    trainer.close()
    trainer.close()  # idempotent
    assert log == [
        ("init", "L"), ("init", "a"), ("init", "b"),
        ("fit_start", "a"), ("fit_start", "b"), ("fit_start", "L"),
        ("close", "a"), ("close", "b"), ("close", "L"),
        ("post_close", "a"), ("post_close", "b"), ("post_close", "L"),
    ]


@pytest.mark.fast
def test_algorithms_run_before_callbacks_and_in_reverse_on_after_events():
    log: list = []

    class Seen(Callback):
        def before_forward(self, state, logger):
            log.append(("before_forward", "callback"))

        def after_forward(self, state, logger):
            log.append(("after_forward", "callback"))

    Trainer(make_model(), make_loader(16, 16), max_duration="1ba", device="cpu", callbacks=[Seen()],
            algorithms=[TaggedAlgorithm("first", log), TaggedAlgorithm("second", log)]).fit()
    assert log == [
        ("before_forward", "first"), ("before_forward", "second"), ("before_forward", "callback"),
        ("after_forward", "second"), ("after_forward", "first"), ("after_forward", "callback"),
    ]


@pytest.mark.fast
def test_callback_exception_propagates_and_everything_is_still_closed(caplog):
    log: list = []

    class Boom(Callback):
        def batch_end(self, state, logger):
            raise ValueError("boom at batch end")

    class BadClose(Callback):
        def close(self, state, logger):
            raise RuntimeError("close failed")

        def post_close(self):
            raise RuntimeError("post_close failed")

    trainer = Trainer(make_model(), make_loader(16, 16), max_duration="2ba", device="cpu",
                      callbacks=[BadClose(), Boom(), Tagged("after", log)])
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="boom at batch end"):
        trainer.fit()
    # The failing close/post_close did not stop the others, and were logged, not raised.
    assert ("close", "after") in log and ("post_close", "after") in log
    assert "close failed" in caplog.text and "post_close failed" in caplog.text
    with pytest.raises(RuntimeError, match="engine is closed"):
        trainer.engine.run_event(Event.FIT_START)
    with pytest.raises(RuntimeError, match="engine is closed"):
        trainer.fit()


def test_close_runs_at_interpreter_exit(tmp_path):
    marker = tmp_path / "closed.txt"
    script = textwrap.dedent(f"""
        from eventbus import Callback, Trainer
        from tests.support import make_loader, make_model

        class Mark(Callback):
            def close(self, state, logger):
                open({str(marker)!r}, "a").write("close\\n")
            def post_close(self):
                open({str(marker)!r}, "a").write("post_close\\n")

        trainer = Trainer(make_model(), make_loader(16, 16), max_duration="1ba", device="cpu", callbacks=[Mark()])
        trainer.fit()
        # no trainer.close(): the engine must close at exit
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO_ROOT)
    assert marker.read_text() == "close\npost_close\n"
