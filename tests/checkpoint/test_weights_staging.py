"""Staged weights (``state.model.state_dict()`` for workers): one shared-memory buffer per weights
event, held for the workers that leased them then, bounded, and never read as another event's."""

from __future__ import annotations

import time

import pytest
import torch

from eventbus.bus.publish.leases import Leases
from eventbus.checkpoint.handle import StagedCheckpoint
from eventbus.checkpoint.staging import StagingBuffers
from eventbus.errors import TransferError

pytestmark = pytest.mark.fast


def _stage(staging: StagingBuffers, model: torch.nn.Module, leases: Leases, batch: int) -> dict | None:
    readers = leases.weights_readers("eval_end")
    staged = staging.stage(model.state_dict(), {"batch": batch, "event": "eval_end", "rank": 0}, readers=readers,
                           reader_alive=leases.holds_weights, max_held=2)
    return staged.descriptor if staged is not None else None


def _load(descriptor: dict) -> dict:
    return StagedCheckpoint(descriptor).load(transfer="shm")


def test_each_weights_event_keeps_its_own_buffer_until_every_reader_has_applied_it():
    leases = Leases()
    leases.grant(["weights"], ttl=60, interval=1, holder="w1", events=["eval_end"])
    leases.grant(["weights"], ttl=60, interval=1, holder="w2", events=["eval_end", "fit_end"])
    assert leases.weights_readers("eval_end") == {"w1", "w2"} and leases.weights_readers("fit_end") == {"w2"}
    model = torch.nn.Linear(4, 3)
    staging = StagingBuffers("weightstest")
    try:
        first = _stage(staging, model, leases, 2)
        at_first = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)
        second = _stage(staging, model, leases, 4)
        assert first is not None and second is not None and first["buffer"] != second["buffer"]
        # Two held (max_held): the next weights event is not staged, and takes no one's buffer.
        assert _stage(staging, model, leases, 6) is None
        assert staging.release(first["buffer"], "w1", first["stage"])
        assert _stage(staging, model, leases, 6) is None  # w2 has not applied it yet
        assert not staging.release(first["buffer"], "w2", second["stage"])  # another stage: changes nothing
        assert _stage(staging, model, leases, 6) is None
        torch.testing.assert_close(_load(first), at_first)  # still the first evaluation's
        assert staging.release(first["buffer"], "w2", first["stage"])
        with torch.no_grad():
            model.weight.add_(1.0)
        third = _stage(staging, model, leases, 6)
        assert third is not None and third["buffer"] == first["buffer"] and third["stage"] > second["stage"]
        # A reader still holding the first descriptor is told, never handed the third's weights.
        with pytest.raises(TransferError, match=f"no longer holds stage {first['stage']}"):
            _load(first)
        torch.testing.assert_close(_load(third), model.state_dict())
        assert not torch.equal(_load(second)["weight"], _load(third)["weight"])
        # A late release of the first stage does not free the buffer the third now holds.
        assert not staging.release(first["buffer"], "w2", first["stage"])
        assert staging.busy()
    finally:
        staging.close()


def test_a_reader_whose_lease_expired_is_no_longer_waited_for():
    leases = Leases()
    leases.grant(["weights"], ttl=0.05, interval=1, holder="gone", events=["eval_end"])
    model = torch.nn.Linear(4, 3)
    staging = StagingBuffers("weightsexpiry")
    try:
        first = _stage(staging, model, leases, 2)
        assert first is not None and staging.busy()
        time.sleep(0.1)  # the worker went away: its lease is not renewed
        assert not staging.busy()  # the close of the run does not wait for it either
        assert leases.weights_readers("eval_end") == frozenset()  # and nothing more is staged for it
    finally:
        staging.close()


def test_a_checkpoint_ack_still_frees_its_buffer_and_checkpoints_keep_the_buffers_weights_do_not_hold():
    leases = Leases()
    leases.grant(["weights"], ttl=60, interval=1, holder="w1", events=["eval_end"])
    model = torch.nn.Linear(4, 3)
    staging = StagingBuffers("weightsckpt", max_buffers=3)
    try:
        assert _stage(staging, model, leases, 2) is not None and _stage(staging, model, leases, 4) is not None
        checkpoint = staging.stage({"model": model.state_dict()}, {"batch": 4, "event": "fit_end", "rank": 0})
        assert checkpoint is not None
        torch.testing.assert_close(_load(checkpoint.descriptor)["model"], model.state_dict())
        # Only the checkpoint worker's ack frees a checkpoint's buffer, not a weights release naming it.
        assert not staging.release(checkpoint.descriptor["buffer"], "w1", checkpoint.descriptor["stage"])
        assert staging.is_staged(checkpoint.descriptor["buffer"])
        assert staging.release(checkpoint.descriptor["buffer"])
        assert not staging.is_staged(checkpoint.descriptor["buffer"])
    finally:
        staging.close()
