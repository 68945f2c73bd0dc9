"""Checkpoints written from the staged buffer without torch: what torch.load reads back, bit for bit."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zipfile

import msgpack
import pytest
import torch
from torch.utils.serialization import config as serialization_config

from eventbus.checkpoint.handle import StagedCheckpoint
from eventbus.checkpoint.staging import StagingBuffers
from eventbus.errors import TransferError
from tests.support import REPO_ROOT


def nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"in": value}
    return value


def trained_state() -> dict:
    """A real model's and Adam's state after a step, the RNG states, and the odd values a state dict holds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(8, 6)).sum().backward()
    optimizer.step()
    return {"state": {"model": model.state_dict(), "optimizers": {"Adam": optimizer.state_dict()},
                      "odd": {"bf16": torch.randn(5).bfloat16(), "half": torch.randn(2, 2).half(),
                              "flags": torch.tensor([True, False, True]), "int8": torch.tensor([-3, 4], dtype=torch.int8),
                              "complex": torch.randn(3, dtype=torch.complex64), "empty": torch.empty(0, 3),
                              "scalar": torch.tensor(2.5, dtype=torch.float64), "large": torch.arange(70_000),
                              "plain": [0, 255, 256, -1, 2**31, -2**63, 2**64 - 1, 0.1, float("inf"), True, None, "é"],
                              "nested": {"tuple": (1, (2.0, "x")), "empty": {}, "list": []},
                              "deep": nested(400)}},
            "rng": [{"torch": torch.get_rng_state(), "python": (3, (1, 2, 3), None)}]}


def records(path) -> dict:
    """Each record of a checkpoint archive (named without its folder): its general-purpose flags in the local
    and the central header, and where its data starts, modulo 64."""
    data, out = path.read_bytes(), {}
    for info in zipfile.ZipFile(path).infolist():
        (flags,) = struct.unpack_from("<H", data, info.header_offset + 6)
        name, extra = struct.unpack_from("<HH", data, info.header_offset + 26)
        out[info.filename.partition("/")[2]] = (flags, info.flag_bits, (info.header_offset + 30 + name + extra) % 64)
    return out


def assert_same(expected, got, where="checkpoint"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for key in expected:
            assert_same(expected[key], got[key], f"{where}/{key}")
    else:
        assert type(got) is type(expected), where
        if isinstance(expected, (list, tuple)):
            assert len(got) == len(expected), where
            for index, (a, b) in enumerate(zip(expected, got)):
                assert_same(a, b, f"{where}[{index}]")
        else:
            assert got == expected, where


@pytest.fixture
def staged(tmp_path):
    (tmp_path / "shm").mkdir()
    staging = StagingBuffers("t" * 32, directory=tmp_path / "shm")
    state = trained_state()
    yield state, staging.stage(state, {"batch": 3, "rank": 0}).descriptor
    staging.close()


def test_a_staged_checkpoint_written_without_torch_reads_back_as_what_was_staged(tmp_path, staged):
    state, descriptor = staged
    path = tmp_path / "ck.pt"
    StagedCheckpoint(descriptor).save(path, "shm")
    torch.save(state, tmp_path / "torch.pt")
    assert zipfile.ZipFile(path).testzip() is None
    assert records(path) == records(tmp_path / "torch.pt")  # laid out as torch's writer lays it out, record by record
    assert_same(state, torch.load(path))  # weights_only: only what torch.save itself writes for a state dict
    assert_same(state, torch.load(path, mmap=True))
    assert_same(StagedCheckpoint(descriptor).load("shm"), torch.load(path, weights_only=False))
    # torch's loader that computes each storage's place from the zip layout miniz writes, checked by its own asserts
    calculate = serialization_config.load.calculate_storage_offsets
    serialization_config.load.calculate_storage_offsets = True
    os.environ["TORCH_SERIALIZATION_DEBUG"] = "1"
    try:
        assert_same(state, torch.load(path, mmap=True))
    finally:
        serialization_config.load.calculate_storage_offsets = calculate
        del os.environ["TORCH_SERIALIZATION_DEBUG"]


def test_select_writes_part_of_the_checkpoint(tmp_path, staged):
    state, descriptor = staged
    StagedCheckpoint(descriptor).save(tmp_path / "model.pt", "shm", lambda whole: {"model": whole["state"]["model"]})
    assert_same({"model": state["state"]["model"]}, torch.load(tmp_path / "model.pt"))


def test_the_write_imports_no_torch(tmp_path, staged):
    """A checkpoint daemon's process: it maps the trainer's buffer (this process's) and never imports torch."""
    state, descriptor = staged
    (tmp_path / "descriptor").write_bytes(msgpack.packb(descriptor))
    script = ("import sys, msgpack; from eventbus.checkpoint.handle import StagedCheckpoint; "
              "descriptor = msgpack.unpackb(open(sys.argv[1], 'rb').read()); "
              "StagedCheckpoint(descriptor).save(sys.argv[2], 'shm'); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "descriptor"), str(tmp_path / "ck.pt")],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert_same(state, torch.load(tmp_path / "ck.pt"))


def test_a_dtype_the_writer_does_not_know_is_saved_by_torch(tmp_path):
    (tmp_path / "shm").mkdir()
    staging = StagingBuffers("u" * 32, directory=tmp_path / "shm")
    state = {"state": {"model": {"w": torch.randn(3).to(torch.float8_e4m3fn), "b": torch.ones(2)}}}
    descriptor = staging.stage(state, {"batch": 1, "rank": 0}).descriptor
    StagedCheckpoint(descriptor).save(tmp_path / "ck.pt", "shm")
    got = torch.load(tmp_path / "ck.pt")["state"]["model"]
    assert got["w"].dtype == torch.float8_e4m3fn and torch.equal(got["w"].view(torch.uint8),
                                                                  state["state"]["model"]["w"].view(torch.uint8))
    assert torch.equal(got["b"], torch.ones(2))
    staging.close()


def test_a_buffer_that_no_longer_holds_its_stage_or_a_layout_outside_it_leaves_no_file(tmp_path, staged):
    _, descriptor = staged
    with pytest.raises(TransferError, match="no longer holds stage"):
        StagedCheckpoint(dict(descriptor, stage=descriptor["stage"] + 1)).save(tmp_path / "ck.pt", "shm")
    layout = [list(entry) for entry in descriptor["layout"]]
    layout[-1][2] = descriptor["size"] - 8  # its bytes run past the buffer's end
    with pytest.raises(ValueError, match="outside its buffer"):
        StagedCheckpoint(dict(descriptor, layout=layout)).save(tmp_path / "ck.pt", "shm")
    layout = [list(entry) for entry in descriptor["layout"]]
    layout[0][1] = [999, 999]  # a shape its bytes do not hold
    with pytest.raises(ValueError, match="does not hold"):
        StagedCheckpoint(dict(descriptor, layout=layout)).save(tmp_path / "ck.pt", "shm")
    assert os.listdir(tmp_path) == ["shm"]  # neither the file nor a temporary one
