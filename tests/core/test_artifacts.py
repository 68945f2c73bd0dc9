"""``logger.upload_file`` writes only inside the run's ``artifacts/`` folder, in process and in a worker.

Attacked the way a careless or hostile callback would: ``..`` segments, absolute names, and symbolic
links planted under ``artifacts/`` (to a file outside, to a folder outside, over an existing file).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from eventbus import Trainer
from eventbus.core.artifacts import artifact_path, copy_artifact
from eventbus.errors import ArtifactPathError
from tests.core.uploaders import Uploader
from tests.support import BackgroundTrainer, bus_address, make_loader, make_model

ESCAPING = ["../x", "../../x", "sub/../../x", "planted-file-link", "planted-dir-link/x", "existing-link"]


def plant(tmp_path: pathlib.Path, artifacts: pathlib.Path) -> dict[str, pathlib.Path]:
    """The outside world, and links to it planted under ``artifacts/`` before the run uploads."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("untouched")
    artifacts.mkdir(parents=True)
    (artifacts / "planted-file-link").symlink_to(outside / "new.txt")
    (artifacts / "planted-dir-link").symlink_to(outside, target_is_directory=True)
    (artifacts / "existing-link").symlink_to(victim)
    return {"outside": outside, "victim": victim}


def assert_nothing_escaped(tmp_path: pathlib.Path, world: dict[str, pathlib.Path], run_folder: pathlib.Path):
    assert world["victim"].read_text() == "untouched"
    assert sorted(p.name for p in world["outside"].iterdir()) == ["victim.txt"]
    assert not (run_folder / "x").exists() and not (run_folder.parent / "x").exists()
    assert not (tmp_path / "abs-target.txt").exists() or (tmp_path / "abs-target.txt").read_text() == "original"


@pytest.mark.fast
def test_names_are_confined_to_the_folder(tmp_path):
    folder = tmp_path / "artifacts"
    assert artifact_path(folder, "/tmp/a/b.txt") == folder / "tmp" / "a" / "b.txt"
    assert artifact_path(folder, "a/./b.txt") == folder / "a" / "b.txt"
    for name in ("../x", "a/../../x", "..", "", "/"):
        with pytest.raises(ArtifactPathError):
            artifact_path(folder, name)
    source = tmp_path / "source.txt"
    source.write_text("data")
    assert copy_artifact(folder, "a/b.txt", source) is True
    assert copy_artifact(folder, "a/b.txt", source) is False  # kept: overwrite is off
    assert (folder / "a" / "b.txt").read_text() == "data"


def test_in_process_uploads_stay_inside_artifacts_and_training_goes_on(tmp_path):
    source = tmp_path / "payload.txt"
    source.write_text("payload")
    absolute = tmp_path / "abs-target.txt"
    absolute.write_text("original")
    report = tmp_path / "report.json"
    names = ESCAPING + [str(absolute), "good/name.txt"]
    trainer = Trainer(make_model(), make_loader(num_samples=32), max_duration="2ba", run_name="uploads",
                      callbacks=[Uploader(str(source), names, str(report))])
    world = plant(tmp_path, trainer.run_folder / "artifacts")
    trainer.fit()
    trainer.close()
    assert int(trainer.state.timestamp.batch) == 2  # the run finished
    assert json.loads(report.read_text()) == dict.fromkeys(names)  # no upload raised into the callback
    artifacts = trainer.run_folder / "artifacts"
    assert (artifacts / "good" / "name.txt").read_text() == "payload"
    assert (artifacts / absolute.relative_to("/")).read_text() == "payload"  # as an object-store key
    assert absolute.read_text() == "original"
    assert_nothing_escaped(tmp_path, world, trainer.run_folder)


def test_a_hosted_callbacks_uploads_stay_inside_artifacts(tmp_path, spawn):
    source = tmp_path / "payload.txt"
    source.write_text("payload")
    absolute = tmp_path / "abs-target.txt"
    absolute.write_text("original")
    report = tmp_path / "report.json"
    names = ESCAPING + [str(absolute), "good/name.txt"]
    trainer = Trainer(make_model(), make_loader(num_samples=32), max_duration="2ba", run_name="hosted-uploads",
                      bus=bus_address(tmp_path))
    world = plant(tmp_path, trainer.run_folder / "artifacts")
    spec = json.dumps({"source": str(source), "names": names, "report": str(report)})
    worker = spawn("-m", "eventbus", "worker", "--connect", bus_address(tmp_path),
                   "--callback", f"tests.core.uploaders:Uploader:{spec}")
    worker.wait_for("following")
    BackgroundTrainer(trainer).start().join()
    assert worker.finish() == 0
    assert json.loads(report.read_text()) == dict.fromkeys(names)
    artifacts = trainer.run_folder / "artifacts"
    assert (artifacts / "good" / "name.txt").read_text() == "payload"
    assert (artifacts / absolute.relative_to("/")).read_text() == "payload"
    assert absolute.read_text() == "original"
    assert_nothing_escaped(tmp_path, world, trainer.run_folder)
    said = "\n".join(worker.stderr)
    assert "symbolic link" in said and "'..' segment" in said  # refused out loud, not silently


def test_composers_file_logger_with_an_absolute_filename_runs_in_process(tmp_path):
    """Its default remote name is the absolute path itself: the copy lands under artifacts/ (it used to
    be copied onto itself and end fit() with SameFileError)."""
    from composer.loggers import FileLogger

    log_file = tmp_path / "composer-log" / "log.txt"
    trainer = Trainer(make_model(), make_loader(num_samples=32), max_duration="2ba", run_name="file-logger",
                      loggers=[FileLogger(filename=str(log_file), capture_stdout=False, capture_stderr=False)])
    trainer.fit()
    trainer.close()
    assert int(trainer.state.timestamp.batch) == 2
    assert log_file.stat().st_size > 0
    assert (trainer.run_folder / "artifacts" / log_file.relative_to("/")).read_text() == log_file.read_text()
