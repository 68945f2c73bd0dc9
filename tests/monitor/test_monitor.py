"""``eventbus monitor``: render() on view models, a finished run's journal, and live runs watched
the way a person does (piped, and in a real terminal under tmux): colour for what needs attention,
the metrics as charts with axes, the evaluations over time."""

from __future__ import annotations

import asyncio
import copy
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable, Optional

import pytest

from eventbus import Callback, Trainer
from eventbus.bus import wire
from eventbus.bus.journal import _SEGMENT, JournalWriter, read_messages
from eventbus.bus.subscribe.journal_stream import journal_messages
from eventbus.monitor.app import main
from eventbus.monitor.chart import chart
from eventbus.monitor.fmt import sparkline
from eventbus.monitor.model import DaemonView, EvalRow, SeriesView, ViewModel
from eventbus.monitor.render import render, render_ansi
from eventbus.monitor.watched import WatchedRun
from tests.support import REPO_ROOT, BackgroundTrainer, bus_address, make_loader, make_model

ENV = {k: v for k, v in os.environ.items() if k not in ("TMUX", "TMUX_PANE")}
ENV.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", COLUMNS="160")
BATCH = re.compile(r"total batch (\d+)(?:/(\d+))?")
EXITED = "monitor exited with status "  # what the shell around a monitor in tmux prints after it


class Pace(Callback):
    """Slows the trainer (sleeps per batch); from batch ``hold_at`` on it waits until released (60 s at
    most), so a run is still going while the test attaches its monitors, however slow the machine."""

    def __init__(self, seconds: float, hold_at: Optional[int] = None):
        self.seconds, self.hold_at = seconds, hold_at
        self.release = threading.Event()

    def batch_end(self, state, logger):
        time.sleep(self.seconds)
        if self.hold_at is not None and int(state.timestamp.batch) >= self.hold_at:
            self.release.wait(60)


def shown_batch(text: str) -> tuple[Optional[int], Optional[int]]:
    found = BATCH.findall(text)
    if not found:
        return None, None
    batch, total = found[-1]
    return int(batch), int(total) if total else None


def wait_until(condition: Callable[[], bool], what: str, limit: float = 90.0) -> None:
    deadline = time.monotonic() + limit  # only bounds a failure; nothing is asserted about time
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def current_batch(trainer: Trainer) -> int:
    return int(trainer.state.timestamp.batch)


def monitor_command(*args: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eventbus", "monitor", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ render() on view models


def full_view(**changes) -> ViewModel:
    view = ViewModel(
        target="ipc:///tmp/somewhere/bus", run_name="demo-run", status="live", has_state=True, fraction=0.35,
        max_duration="50ep", train_seconds=70.0, eta_seconds=130.0, eta_source="estimate", epoch=17,
        epochs_total=50, batch_in_epoch=2, batches_per_epoch=4, batch=70, batches_total=200, sample=1120,
        event="batch_end",
        series=[SeriesView("loss/train/total", 0.123456, [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0], None, 63, 70),
                SeriesView("metrics/eval/MulticlassAccuracy", 0.75, [0.5, 0.75], None, 34, 68)],
        throughput=[("samples/s", 2345.6), ("batches/s", 146.6)], throughput_source="timing worker",
        learning_rates=[("SGD", [0.1, 0.01])],
        evals=[("eval", [("CrossEntropy", 0.5), ("MulticlassAccuracy", 0.75)], 68)],
        eval_history=[EvalRow("eval", 34, [("CrossEntropy", 0.7), ("MulticlassAccuracy", 0.5)]),
                      EvalRow("eval", 68, [("CrossEntropy", 0.5), ("MulticlassAccuracy", 0.75)])],
        checkpoint="runs/demo-run/checkpoints/ep16-ba68-rank0.pt", checkpoint_kind="saved", checkpoint_batch=68,
        events_per_second=1234.5, seq=4321, messages=999, last_message_age=0.2,
        monitor={"lag_seconds": 0.012, "recovered": 3, "lost": 1, "protocol_errors": 2},
        trainer={"published": 4321, "dropped_queue_full": 0, "replayed_windows": 3, "protocol_errors": 0},
        trainer_answering=True, trainer_reply_age=1.0,
        daemons=[DaemonView("logger", 1.5, True, delivered=4300, recovered=2, callbacks=["ConsoleLogger"]),
                 DaemonView("timing", 42.0, False, delivered=100, recovered=0)],
    )
    for name, value in changes.items():
        setattr(view, name, value)
    return view


def line_with(frame: list[str], text: str) -> str:
    matches = [line for line in frame if text in line]
    assert matches, f"{text!r} not on the screen:\n" + "\n".join(frame)
    return matches[0]


def test_render_shows_every_panel_of_a_live_run():
    view = full_view()
    before = copy.deepcopy(view)
    frame = render(view, 120, 40)
    assert render(view, 120, 40) == frame and view == before  # pure: same input, same lines, input untouched
    assert len(frame) <= 40 and all(len(line) <= 120 for line in frame)
    assert frame[0].startswith("eventbus monitor · run demo-run · live")
    progress = line_with(frame, "progress")
    assert "35.0%" in progress and "train 0:01:10" in progress and "ETA 0:02:10 (estimate)" in progress
    assert "of 50ep" in progress and "█" in progress and "░" in progress
    position = line_with(frame, "position")
    assert "epoch 17/50" in position and "batch 2/4 in epoch" in position and "total batch 70/200" in position
    loss = frame.index(line_with(frame, "loss/train/total"))
    assert "0.1235" in frame[loss]
    # Its history as a chart with axes: max and min on the y axis, the steps it spans on the x axis.
    plot = frame[loss + 1:loss + 9]
    assert plot[0].split("┤")[0].strip() == "8" and plot[5].split("┤")[0].strip() == "1"
    assert all(line.strip().startswith("│") for line in plot[1:5]) and plot[6].strip().startswith("└──")
    assert plot[7].split() == ["step", "63", "70"]
    top, bottom = (line.split("┤")[1] for line in (plot[0], plot[5]))
    assert top[0] == "█" and top[-1] == " " and bottom[0] == "█" and bottom.rstrip()[-1] == "▁"  # 8 falling to 1
    assert "0.75" in line_with(frame, "metrics/eval/MulticlassAccuracy")
    assert "2,346 samples/s" in line_with(frame, "throughput") and "146.6 batches/s" in line_with(frame, "throughput")
    assert "SGD 0.1, 0.01" in line_with(frame, "learning rate")
    evaluation = line_with(frame, "eval eval")
    assert "CrossEntropy 0.5" in evaluation and "MulticlassAccuracy 0.75" in evaluation and "(at batch 68)" in evaluation
    assert "ep16-ba68-rank0.pt" in line_with(frame, "last checkpoint")
    history = frame.index(line_with(frame, "evaluation"))  # the evaluations over time, oldest first
    assert frame[history].split() == ["evaluation", "batch", "CrossEntropy", "MulticlassAccuracy"]
    assert [line.split() for line in frame[history + 2:history + 4]] == [["eval", "34", "0.7", "0.5"],
                                                                       ["eval", "68", "0.5", "0.75"]]
    bus = line_with(frame, "events/s")
    assert "1234.5 events/s" in bus and "seq 4321" in bus
    monitor = line_with(frame, "this monitor")
    assert "lag 12 ms" in monitor and "recovered 3" in monitor and "lost 1" in monitor and "protocol errors 2" in monitor
    logger = line_with(frame, "  logger")
    assert " ok " in logger and "heartbeat 1.5s ago" in logger and "delivered 4300" in logger and "recovered 2" in logger
    timing = line_with(frame, "  timing")
    assert "STALE" in timing and "heartbeat 42.0s ago" in timing


def test_render_states_of_a_run():
    waiting = render(ViewModel(target="ipc:///tmp/x/bus"), 80, 24)
    assert "waiting for the trainer" in waiting[0] and any("first event at ipc:///tmp/x/bus" in l for l in waiting)
    finished = render(full_view(status="finished", eta_seconds=None, fraction=1.0), 120, 40)
    assert "· finished" in finished[0] and "100.0%" in line_with(finished, "progress")
    assert "done" in line_with(finished, "progress") and "ETA" not in line_with(finished, "progress")
    detached = render(full_view(status="detached"), 120, 40)
    assert "· detached" in detached[0]
    failed = render(full_view(checkpoint="disk full", checkpoint_kind="error"), 120, 40)
    assert "FAILED: disk full" in line_with(failed, "last checkpoint")
    stopped = render(full_view(stop_reason="loss below 0.1"), 120, 40)
    assert "loss below 0.1" in line_with(stopped, "stopped early")
    silent = render(full_view(trainer_answering=False, trainer=None, daemons=[]), 120, 40)
    assert "not answering" in line_with(silent, "trainer")
    empty = render(full_view(throughput=[], evals=[], checkpoint=None, learning_rates=[]), 120, 40)
    assert line_with(empty, "throughput").split()[-1] == "-" and line_with(empty, "last checkpoint").split()[-1] == "-"


def test_render_fits_any_terminal():
    many = [DaemonView(f"worker-{i}", 1.0, True, delivered=i) for i in range(30)]
    for width, height in ((120, 40), (60, 20), (20, 5), (300, 100), (5, 1)):
        frame = render(full_view(daemons=many), width, height)
        assert len(frame) <= height and all(len(line) <= max(width, 20) for line in frame)
    frame = render(full_view(daemons=many), 120, 30)
    assert len(frame) == 30 and "more daemons" in frame[-1]
    plain = render(full_view(ascii_only=True), 120, 40)
    assert all(line.isascii() for line in plain) and "total batch 70/200" in "\n".join(plain)


ALARM = "\x1b[1;31m"  # bold red, as a terminal receives it


def coloured(ansi: str, text: str) -> str:
    """The escape sequence just before ``text`` in ``ansi`` (empty when it is drawn without colour)."""
    at = ansi.index(text)
    start = ansi.rfind("\x1b[", 0, at)
    return ansi[start:ansi.index("m", start) + 1] if start >= 0 and ansi.find("\x1b[0m", start, at) < 0 else ""


def test_what_needs_attention_stands_out_in_colour():
    failed = full_view(checkpoint="disk full", checkpoint_kind="error", trainer_answering=False, trainer=None)
    ansi = render_ansi(failed, 120, 40)
    assert coloured(ansi, "STALE") == ALARM and coloured(ansi, "FAILED: ") == ALARM
    assert coloured(ansi, "not answering") == ALARM
    assert coloured(ansi, "live") == "\x1b[1;32m"  # the run's state in the header: green while live
    assert coloured(render_ansi(full_view(status="detached"), 120, 40), "detached") == "\x1b[1;33m"
    assert coloured(ansi, "ok ") == "\x1b[32m"  # a healthy daemon is green, not an alarm
    # The same frame as plain text (what a pipe gets) has no escape codes at all.
    assert "\x1b" not in "\n".join(render(failed, 120, 40)) and "STALE" in "\n".join(render(failed, 120, 40))


def test_chart_axes():
    lines = [line.plain for line in chart([1, 2, 3, 4, 5, 6, 7, 8], 30, 4, first_step=100, last_step=107)]
    assert len(lines) == 6 and all(len(line) <= 30 for line in lines)
    assert lines[0].startswith("  8 ┤") and lines[3].startswith("  1 ┤") and lines[1].startswith("    │")
    assert lines[4].startswith("    └─") and lines[5].split() == ["step", "100", "107"]
    assert lines[0].rstrip().endswith("█") and lines[0][5] == " " and lines[3][5:].rstrip()[0] == "▁"  # rising
    without_steps = [line.plain for line in chart([2.5, 0.5], 30, 2)]
    assert without_steps[0].startswith("  2.5 ┤") and without_steps[1].startswith("  0.5 ┤")
    assert without_steps[-1].split() == ["1", "point", "2"]  # no steps known: the points' count
    flat = [line.plain for line in chart([3.0] * 4, 20, 2, ascii_only=True)]
    assert all(line.isascii() for line in flat) and flat[0].startswith("  3 +")
    assert chart([], 30, 4) == [] and chart([float("nan")], 30, 4) == []


def test_sparkline():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 20) == "▁▂▃▄▅▆▇█"
    assert sparkline([8, 1], 20) == "█▁"
    assert sparkline(list(range(1000)), 10) == "▁▂▃▃▄▅▆▆▇█"  # the whole history, averaged into 10 columns
    assert len(sparkline(list(range(1000)), 37)) == 37
    assert sparkline([], 10) == "" and sparkline([1.0, 2.0], 0) == ""
    assert sparkline([float("nan"), 1.0, float("inf"), 2.0], 10) == "▁█"
    assert len(set(sparkline([3.0] * 5, 10))) == 1
    assert sparkline([1, 2, 3], 10, ascii_only=True).isascii()


# ------------------------------------------------------------------ a finished run's journal


def finished_run(name: str) -> Trainer:
    trainer = Trainer(make_model(), make_loader(), max_duration="3ep", device="cpu", run_name=name,
                      eval_dataloader=make_loader(16, 16))
    trainer.fit()
    trainer.close()
    return trainer


def test_watched_run_follows_a_real_runs_messages():
    trainer = finished_run("tracked")

    async def read() -> WatchedRun:
        run = WatchedRun(["loss/train/total", "metrics/eval/*"])
        async for message in journal_messages("runs/tracked/events.journal"):
            run.feed(message)
        return run

    view = asyncio.run(read()).view()
    assert view.run_name == "tracked" and view.status == "finished"
    assert (view.batch, view.batches_total, view.epoch, view.epochs_total) == (12, 12, 3, 3)
    assert view.fraction == 1.0 and view.batches_per_epoch == 4
    loss = view.series[0]
    assert loss.key == "loss/train/total" and loss.latest == pytest.approx(trainer.state.loss.item())
    assert len(loss.values) == 12
    assert {s.key for s in view.series[1:]} == {"metrics/eval/CrossEntropy", "metrics/eval/MulticlassAccuracy"}
    assert [label for label, _, _ in view.evals] == ["eval"] and view.evals[0][2] == 12
    assert dict(view.learning_rates) and view.throughput_source == "from batch_wct"
    # Every evaluation of the run, at the batch it ran, with what it measured; the last one is the run's.
    assert [(row.label, row.batch) for row in view.eval_history] == [("eval", 4), ("eval", 8), ("eval", 12)]
    assert dict(view.eval_history[-1].values) == pytest.approx(
        {name: float(value) for name, value in trainer.state.eval_metric_values["eval"].items()})
    assert len({dict(row.values)["CrossEntropy"] for row in view.eval_history}) == 3
    # Drawn: the loss as a chart spanning the run's steps, the evaluations as a table.
    frame = render(view, 100, 50)
    plot = frame.index(line_with(frame, "loss/train/total")) + 1
    low, high = min(loss.values), max(loss.values)
    assert frame[plot].split("┤")[0].strip() == f"{high:.4g}"
    assert line_with(frame[plot:], f"{low:.4g} ┤")
    assert line_with(frame[plot:], "step ").split() == ["step", str(loss.first_step), str(loss.last_step)]
    assert loss.last_step is not None and loss.first_step is not None and loss.last_step - loss.first_step == 11
    history = frame.index(line_with(frame, "evaluation"))
    assert [line.split()[:2] for line in frame[history + 2:history + 5]] == [["eval", "4"], ["eval", "8"],
                                                                           ["eval", "12"]]


def test_a_refused_stats_request_keeps_the_trainers_last_answer_on_screen():
    """Under a flood the trainer may refuse a stats request (the budget all clients share): it still
    answers, and the dashboard keeps the counters and daemons of its last answer instead of blanking them."""
    run = WatchedRun([])
    answer = {"seq": 40, "now": 1000.0, "publisher": {"published": 40, "sent": 40},
              "subscribers": {"logger": {"last_seen": 999.0, "callbacks": ["ProgressLogger"]}}}
    run.set_trainer_stats(answer, now=10.0)
    before = run.view(now=10.5)
    run.set_trainer_stats({"op": "stats", "error": "over the budget of all clients together", "retry_after": 0.5},
                          now=11.0)
    after = run.view(now=11.5)
    assert after.trainer_answering and after.trainer == before.trainer == {"published": 40, "sent": 40}
    assert [daemon.identity for daemon in after.daemons] == [daemon.identity for daemon in before.daemons] == ["logger"]


def test_journal_mode_shows_the_final_state_of_a_finished_run(tmp_path):
    trainer = finished_run("looked-at")
    result = monitor_command("runs/looked-at/events.journal", "--once", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    screen = result.stdout
    assert "\x1b" not in screen
    lines = screen.splitlines()
    assert lines[0].startswith("eventbus monitor · run looked-at · finished")
    assert shown_batch(screen) == (12, 12) == (current_batch(trainer), 12)
    assert f"{trainer.state.loss.item():.4g}" in line_with(lines, "loss/train/total")
    assert "100.0%" in line_with(lines, "progress") and "epoch 3/3" in line_with(lines, "position")
    # The run folder works as well, and without --once it is the same single frame.
    again = monitor_command("runs/looked-at", cwd=tmp_path)
    assert again.returncode == 0 and shown_batch(again.stdout) == (12, 12)
    (tmp_path / "empty.journal").write_bytes(b"")  # a run that has written nothing yet: no run to name
    empty = monitor_command("empty.journal", "--once", cwd=tmp_path)
    assert empty.returncode == 0 and "no message yet in the journal" in empty.stderr, empty.stderr
    assert "None" not in empty.stderr


def test_bad_targets_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a journal")
    for argv in (["nope.journal"], ["tcp://localhost"], ["http://example.com:80"], ["ipc://"], ["notes.txt"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("eventbus monitor: error:") and len(err.strip().splitlines()) == 1, err
    assert main(["tcp://127.0.0.1:65535"]) == 2  # well formed, but its request service would need port 65536
    assert "a bus takes two ports, PORT and PORT+1 (its request service), so PORT is 1-65534" in \
        capsys.readouterr().err
    for argv in (["x", "--refresh", "0"], []):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert exited.value.code == 0 and "usage: eventbus monitor" in help_text and "Press q (or Ctrl-C) to quit" in help_text
    missing = monitor_command("runs/nothing/events.journal", cwd=tmp_path)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr


def test_a_journal_with_no_readable_message_is_a_one_line_error(tmp_path, capsys):
    """Records there but none readable (another version's journal, damage throughout, every record refused):
    exit 2 saying why, not a blank frame and 0. An empty journal is a run that has written nothing yet (above)."""
    writer = JournalWriter(tmp_path / "events.journal")
    for seq in (1, 2, 3):  # metrics messages without their metrics: each record is refused when read
        writer.append(wire.encode("metrics", "run", 0, seq, None, 0.0, 0.0, {"step": seq}), seq)
    writer.close()
    data = (tmp_path / "events.journal").read_bytes()
    cases = {"older.journal": (b"EVBJOURNAL3\n" + data[12:], "earlier eventbus (journal format 3)"),
             "scrambled.journal": (data[:_SEGMENT.size] + bytes(b ^ 0x5A for b in data[_SEGMENT.size:]),
                                   "damaged bytes at offset"),
             "refused.journal": (data, "unreadable record(s) skipped")}
    for name, (content, why) in cases.items():
        (tmp_path / name).write_bytes(content)
        assert main([str(tmp_path / name)]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"eventbus monitor: error: {tmp_path / name} holds no message it can read") and why in err


# ------------------------------------------------------------------ live runs


def last_frame(lines: list[str]) -> list[str]:
    starts = [i for i, line in enumerate(lines) if line.startswith("eventbus monitor · run ")]
    assert starts, "no frame printed"
    return lines[starts[-1]:]


class HoldInEvaluation(Callback):
    """Holds the training thread inside its first evaluation until released (60 s at most)."""

    def __init__(self) -> None:
        self.held, self.release = threading.Event(), threading.Event()

    def eval_batch_end(self, state, logger):
        if not self.held.is_set():
            self.held.set()
            self.release.wait(60)


def test_a_monitor_that_joins_during_an_evaluation_shows_the_runs_total(tmp_path):
    """The state it joins at describes the eval loader; the run's total comes from the latest BATCH_END."""
    address = bus_address(tmp_path)
    hold = HoldInEvaluation()
    trainer = Trainer(make_model(), make_loader(), max_duration="5ep", device="cpu", run_name="evaluating",
                      bus=address, callbacks=[hold], eval_dataloader=make_loader(16, 16))
    background = BackgroundTrainer(trainer).start()
    try:
        assert hold.held.wait(60), "the first evaluation"
        once = monitor_command(address, "--once", cwd=tmp_path)
        assert once.returncode == 0, once.stderr
        assert once.stdout.startswith("eventbus monitor · run evaluating · live")
        assert shown_batch(once.stdout) == (4, 20), once.stdout  # 4 batches an epoch, 5 epochs
    finally:
        hold.release.set()
        background.join()


def test_piped_monitors_follow_a_live_run(tmp_path, spawn):
    """Off a terminal: plain frames; --once prints one and exits; SIGTERM detaches; the run's end exits 0."""
    address = bus_address(tmp_path)
    pace = Pace(0.02, hold_at=40)
    trainer = Trainer(make_model(), make_loader(), max_duration="20ep", device="cpu", run_name="piped",
                      bus=address, callbacks=[pace])
    background = BackgroundTrainer(trainer).start()
    try:
        wait_until(lambda: current_batch(trainer) >= 2, "the first batches")
        follower = spawn("-m", "eventbus", "monitor", address, "--refresh", "0.2", env={"COLUMNS": "160"})
        leaver = spawn("-m", "eventbus", "monitor", address, env={"COLUMNS": "160"})
        once = monitor_command(address, "--once", cwd=tmp_path)
        assert once.returncode == 0, once.stderr
        assert "\x1b" not in once.stdout and once.stdout.startswith("eventbus monitor · run piped · live")
        batch, total = shown_batch(once.stdout)
        assert total == 80 and 2 <= batch <= current_batch(trainer)
        for monitor in (follower, leaver):
            monitor.wait_for("eventbus monitor · run piped · live")
        leaver.proc.send_signal(signal.SIGTERM)  # detach: the run goes on
        assert leaver.finish() == 0
        assert "· detached" in last_frame(leaver.stdout)[0]
    finally:
        pace.release.set()
    background.join()
    assert current_batch(trainer) == 80
    assert follower.finish() == 0, "\n".join(follower.stderr[-20:])
    assert not any("\x1b" in line for line in follower.stdout)
    final = last_frame(follower.stdout)
    assert "· finished" in final[0] and shown_batch("\n".join(final)) == (80, 80)
    assert f"{trainer.state.loss.item():.4g}" in line_with(final, "loss/train/total")


def test_sigterm_while_waiting_for_the_trainer_detaches_cleanly(tmp_path, spawn):
    """SIGTERM before the trainer came killed the monitor (exit 143); Ctrl-C there already exited 0."""
    waiting = spawn("-m", "eventbus", "monitor", f"ipc://{tmp_path}/runs/later/bus")
    waiting.wait_for("eventbus monitor: waiting: no trainer serves")
    waiting.proc.send_signal(signal.SIGTERM)
    assert waiting.finish() == 0, "\n".join(waiting.stderr)


def test_a_daemon_whose_callbacks_send_metrics_back_is_one_daemon(tmp_path, spawn):
    """The timing daemon's callbacks send their metrics back under their names, joined for the steps
    they logged together ("SpeedMonitor+RuntimeEstimator+LRMonitor"); the trainer hears from each name.
    The monitor shows one daemon, hosting them."""
    address = bus_address(tmp_path)
    timing = spawn("-m", "eventbus.workers.timing", "--connect", address, "--state-dir", str(tmp_path / "state"))
    timing.wait_for("following")
    pace = Pace(0.02, hold_at=20)
    trainer = Trainer(make_model(), make_loader(), max_duration="10ep", device="cpu", run_name="one-daemon",
                      bus=address, callbacks=[pace])
    background = BackgroundTrainer(trainer).start()
    try:
        journal = trainer.publisher.journal_path
        wait_until(lambda: any("+" in (message.payload.get("source") or "") for message in read_messages(journal)
                               if message.kind == "metrics"), "metrics the timing daemon's callbacks logged together")
        once = monitor_command(address, "--once", cwd=tmp_path)
        assert once.returncode == 0, once.stderr
        assert line_with(once.stdout.splitlines(), "daemons").split()[1:3] == ["1", "connected,"], once.stdout
    finally:
        pace.release.set()
    background.join()
    assert timing.finish() == 0, "\n".join(timing.stderr[-20:])


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it; "
                                                          "apt-get install tmux)")
def test_monitor_in_a_real_terminal(tmp_path):
    """As a person would: monitors in terminals (tmux panes) attached to a live run, then its end."""
    address = bus_address(tmp_path)
    pace = Pace(0.05, hold_at=150)  # ~10 s of training; held at batch 150 until both monitors are checked
    trainer = Trainer(make_model(), make_loader(), max_duration="50ep", device="cpu", run_name="watched",
                      bus=address, callbacks=[pace], eval_dataloader=make_loader(16, 16))
    server = f"eventbus-test-{uuid.uuid4().hex[:12]}"  # a private tmux server: nobody else's sessions touched
    config = tmp_path / "tmux.conf"
    config.write_text("set -g remain-on-exit on\nset -g status off\n")  # keep the final screen readable
    sessions: list[str] = []

    def tmux(*args: str, check: bool = True) -> str:
        return subprocess.run(["tmux", "-L", server, "-f", str(config), *args], capture_output=True, text=True,
                              check=check, env=ENV, timeout=30).stdout

    def open_monitor(session: str) -> None:
        # The monitor is not the pane's process: tmux (3.3a) throws away what it has not read yet of a pane whose
        # process exits, which cut the last frame short under load. The shell outlives it (Ctrl-C reaches the
        # shell too: trapped) and prints its exit status: once that is on the screen, all the monitor wrote is.
        command = (f"trap true INT; echo what was on the terminal before; {shlex.quote(sys.executable)} -m eventbus "
                   f"monitor {shlex.quote(address)} --refresh 0.2; echo {EXITED}$?; read line")
        tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", "-c", str(REPO_ROOT),
             "-e", f"PYTHONPATH={REPO_ROOT}", "sh", "-c", command)
        sessions.append(session)

    def screen(session: str) -> str:
        return tmux("capture-pane", "-p", "-t", session)

    def final_screen(session: str) -> str:
        """The last frame drawn: the shell's line after it scrolls its top line into the history."""
        lines = tmux("capture-pane", "-p", "-S", "-", "-t", session).splitlines()
        return "\n".join(last_frame(lines))

    def wait_for_screen(session: str, condition: Callable[[str], bool], what: str) -> str:
        seen = [""]

        def check() -> bool:
            seen[0] = screen(session)
            return condition(seen[0])

        try:
            wait_until(check, what)
        except AssertionError:
            raise AssertionError(f"{what}; the screen:\n{seen[0]}") from None
        return seen[0]

    def exit_status(session: str) -> Optional[str]:
        """The monitor's exit status, once the shell has printed it (after everything the monitor wrote)."""
        found = re.findall(rf"{EXITED}(\d+)$", screen(session), re.MULTILINE)
        return found[-1] if found else None

    background = BackgroundTrainer(trainer).start()
    try:
        first, second = f"{server}-first", f"{server}-second"
        open_monitor(first)
        reached = max(1, current_batch(trainer))  # the monitor must get at least this far: it is live
        # A frame reaches the terminal in pieces: its bus row, below the metrics, shows it was drawn whole.
        # Its total, from the first frame: joined during an evaluation, it reads the train loader's length
        # from the run's latest BATCH_END (test_a_monitor_that_joins_during_an_evaluation_shows_the_runs_total).
        text = wait_for_screen(first, lambda s: "run watched · live" in s and (shown_batch(s)[0] or 0) >= reached
                               and "events/s" in s, f"the first monitor showing the run at batch >= {reached}")
        batch, total = shown_batch(text)
        assert total == 200 and reached <= batch <= current_batch(trainer)  # a batch the trainer really reached
        assert "loss/train/total" in text and "SGD" in text
        # The loss as a chart with its axes, once the monitor has seen more than one value of it.
        text = wait_for_screen(first, lambda s: "┤" in s and "step " in s, "the loss as a chart")
        # Drawn on the alternate screen: what the terminal showed before is not wiped.
        assert tmux("display-message", "-p", "-t", first, "#{alternate_on}").strip() == "1"
        assert "what was on the terminal before" not in text

        open_monitor(second)  # a second monitor at the same time
        # As for the first: a whole frame (its bus row drawn), with the batch and the run's length in it.
        text2 = wait_for_screen(second, lambda s: "run watched · live" in s and shown_batch(s)[1] is not None
                                and "events/s" in s, "the second monitor showing the run")
        batch2, total2 = shown_batch(text2)
        assert total2 == 200 and batch <= batch2 <= current_batch(trainer)
        pace.release.set()
        for session, since in ((first, batch2), (second, batch2)):  # both keep following the run
            wait_for_screen(session, lambda s, since=since: (shown_batch(s)[0] or 0) > since,
                            f"{session} following the run past batch {since}")

        tmux("send-keys", "-t", second, "C-c")  # detach the second: the run does not notice
        wait_until(lambda: exit_status(second) is not None, "the second monitor exiting on Ctrl-C")
        assert exit_status(second) == "0" and "run watched · detached" in final_screen(second)

        background.join()
        final = current_batch(trainer)
        assert final == 200
        wait_until(lambda: exit_status(first) is not None, "the first monitor exiting at the end of the run")
        assert exit_status(first) == "0"
        text = final_screen(first)
        assert "run watched · finished" in text and shown_batch(text) == (final, 200), text
        assert f"{trainer.state.loss.item():.4g}" in text and "100.0%" in text, text  # the whole frame if not
        # Back on the normal screen: the lines from before, then the last frame, left for reading.
        history = tmux("capture-pane", "-p", "-S", "-", "-t", first)
        assert history.index("what was on the terminal before") < history.rindex("run watched · finished")
        assert tmux("display-message", "-p", "-t", first, "#{alternate_on}").strip() == "0"
    finally:
        pace.release.set()
        for session in sessions:
            tmux("kill-session", "-t", session, check=False)
        tmux("kill-server", check=False)
    background.join()
