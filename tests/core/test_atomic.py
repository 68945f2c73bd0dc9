"""Files replaced whole: readers see the old content or the new one, and nothing is left behind."""

from __future__ import annotations

import pytest

from eventbus.core.atomic import atomic_file, write_atomic


def test_a_reader_sees_the_old_content_until_the_new_one_is_complete(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    with atomic_file(target, fsync=False) as file:
        file.write(b"new, half")
        file.flush()
        assert target.read_text() == "old"
        file.write(b" and the rest")
    assert target.read_text() == "new, half and the rest"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_two_writers_at_once_use_their_own_temporary_files(tmp_path):
    target = tmp_path / "metrics.csv"
    with atomic_file(target, fsync=False) as first, atomic_file(target, fsync=False) as second:
        first.write(b"first")
        second.write(b"second")
        temporaries = [p for p in tmp_path.iterdir() if p.name != "metrics.csv"]
        assert len(temporaries) == 2 and all(p.name.startswith(".metrics.csv.tmp-") for p in temporaries)
    assert target.read_text() == "first"  # the last to finish wins, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary_file(tmp_path):
    target = tmp_path / "hyperparameters.json"
    target.write_text("kept")
    with pytest.raises(RuntimeError, match="serialising failed"):
        with atomic_file(target, fsync=True) as file:
            file.write(b"partial")
            raise RuntimeError("serialising failed")
    assert target.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hyperparameters.json"]


@pytest.mark.parametrize("fsync", [False, True])
def test_write_atomic_writes_text_as_utf8_and_bytes_as_they_are(tmp_path, fsync):
    write_atomic(tmp_path / "text", "über", fsync=fsync)
    write_atomic(tmp_path / "bytes", b"\x00\xff", fsync=fsync)
    assert (tmp_path / "text").read_bytes() == "über".encode()
    assert (tmp_path / "bytes").read_bytes() == b"\x00\xff"


def test_a_link_at_the_target_is_replaced_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("untouched")
    (tmp_path / "run").mkdir()
    target = tmp_path / "run" / "cursor.json"
    target.symlink_to(outside)
    write_atomic(target, "cursor", fsync=False)
    assert outside.read_text() == "untouched"
    assert not target.is_symlink() and target.read_text() == "cursor"
