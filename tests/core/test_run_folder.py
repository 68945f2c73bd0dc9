"""A run's name and folder: generated names are plain folder names that never reuse a run's folder."""

from __future__ import annotations

import pathlib
import types

import pytest

from eventbus.core.run_folder import RUN_NAME, announced_run_folder, check_run_name, new_run_name, resolve_run_folder
from eventbus.errors import ConfigError


def test_a_generated_name_says_the_trainer_sorts_by_time_and_is_a_plain_folder_name(tmp_path):
    name = new_run_name("lightning", tmp_path)
    prefix, date, clock = name.split("-")
    assert prefix == "lightning" and len(date) == 8 and len(clock) == 6 and (date + clock).isdigit()
    assert RUN_NAME.fullmatch(name)


def test_a_generated_name_never_names_a_run_folder_that_exists(tmp_path):
    taken = set()
    for _ in range(3):  # within the same second the names would repeat without the suffix
        name = new_run_name("charlm", tmp_path)
        assert name not in taken
        (tmp_path / name).mkdir()
        taken.add(name)


@pytest.mark.parametrize("name", ["", ".", "..", "../elsewhere", "a/b", "/abs", "-flag", "x" * 101, "sp ace"])
def test_a_run_name_that_is_not_a_plain_folder_name_is_refused(name):
    with pytest.raises(ConfigError, match="run-name must be a plain folder name"):
        check_run_name(name, "run-name")


def test_the_folder_is_the_one_given_else_the_run_under_the_runs_dir(tmp_path):
    assert resolve_run_folder("r", tmp_path / "mine") == tmp_path / "mine"
    assert resolve_run_folder("r") == pathlib.Path("runs") / "r"
    assert resolve_run_folder("r", runs_dir=tmp_path) == tmp_path / "r"


def test_a_daemon_writes_into_the_folder_the_trainer_announced(tmp_path):
    announced = types.SimpleNamespace(run_name="r", header={"run_folder": str(tmp_path / "elsewhere" / "r")})
    unannounced = types.SimpleNamespace(run_name="r", header={})
    assert announced_run_folder(announced) == tmp_path / "elsewhere" / "r"
    assert announced_run_folder(announced, tmp_path / "given") == tmp_path / "given"
    assert announced_run_folder(unannounced) == pathlib.Path("runs") / "r"
