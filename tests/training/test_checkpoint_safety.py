"""Checkpoints never run code when read, and every unusable one is reported, not silently
skipped: a planted malicious pickle, truncated files, litter of killed writes, stale runs."""

from __future__ import annotations

import random

import numpy as np
import torch
from fault_setup import plant_checkpoint
from training_setup import notes

from adaptiveload.training import checkpoint


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    path = checkpoint.save(tmp_path, 1, {"identity": "i"})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    state = torch.load(path, weights_only=True)  # raises if anything but tensors/plain types
    checkpoint.set_rng_state(state["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_malicious_checkpoint_is_not_executed(tmp_path, capsys):
    marker = tmp_path / "marker"
    plant_checkpoint(tmp_path / "ckpt" / "ckpt-00000004.pt", marker)
    found = checkpoint.find(tmp_path / "ckpt", "i")
    assert not marker.exists(), "loading the checkpoint ran its payload"
    assert found.state is None and found.stale is None
    (note,) = notes(capsys.readouterr().err)
    assert "ckpt-00000004.pt" in note and "unsafe" in note and "starting over" in note
    assert not (tmp_path / "ckpt" / "ckpt-00000004.pt").exists()  # removed, not tried again


def test_newer_corrupt_checkpoint_is_skipped_with_a_message(tmp_path, capsys):
    good = checkpoint.save(tmp_path, 2, {"identity": "i"})
    newer = checkpoint.save(tmp_path, 4, {"identity": "i"})
    newer.write_bytes(newer.read_bytes()[:100])  # a torn file
    found = checkpoint.find(tmp_path, "i")
    assert found.state is not None and found.state["path"] == str(good)
    (note,) = notes(capsys.readouterr().err)
    assert "ckpt-00000004.pt" in note and "resuming from step 2" in note


def test_all_corrupt_checkpoints_start_over_in_one_line(tmp_path, capsys):
    for step in (2, 4):
        checkpoint.path_for(tmp_path, step).write_bytes(b"\x00garbage")
    found = checkpoint.find(tmp_path, "i")
    assert found.state is None
    (note,) = notes(capsys.readouterr().err)
    assert "no usable checkpoint" in note and "starting over from step 0" in note


def test_checkpoint_of_another_identity_is_stale_and_removed(tmp_path, capsys):
    checkpoint.save(tmp_path, 4, {"identity": "old", "tracking": {"run_id": "r1"}})
    found = checkpoint.find(tmp_path, "new")
    assert found.state is None and found.stale["tracking"]["run_id"] == "r1"
    (note,) = notes(capsys.readouterr().err)
    assert "another run" in note and "starting over" in note
    assert not list(tmp_path.glob("ckpt-*.pt"))  # cannot be pruned in favour of the new run's


def test_a_checkpoint_past_the_runs_end_is_not_resumed_and_removed(tmp_path, capsys):
    """A longer run of the same identity (started by hand into this folder, with --steps)
    left ckpt-8: a 6-step run resumes from its own ckpt-6, so its results are 6 steps'."""
    checkpoint.save(tmp_path, 6, {"identity": "i"})
    checkpoint.save(tmp_path, 8, {"identity": "i"})
    found = checkpoint.find(tmp_path, "i", last=6)
    assert found.state["step"] == 6 and found.stale is None
    assert "step 8 go past this run's 6 steps" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000006.pt"]


def test_interrupted_writes_leave_no_litter(tmp_path):
    checkpoint.save(tmp_path, 2, {"identity": "i"})
    litter = tmp_path / ".ckpt-00000004.pt.k3j2h1.tmp"  # what a SIGKILL mid-save leaves
    litter.write_bytes(b"half")
    other = tmp_path / "notes.txt"
    other.write_text("kept")
    assert checkpoint.find(tmp_path, "i").state["step"] == 2
    assert not litter.exists() and other.exists()
