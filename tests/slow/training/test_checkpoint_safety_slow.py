"""Checkpoints never run code when read, and every unusable one is reported, not silently
skipped: a planted malicious pickle, truncated files, litter of killed writes, stale runs."""

from __future__ import annotations

from fault_setup import plant_checkpoint
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, notes, write_experiment


def test_planted_checkpoint_in_a_run_folder_does_not_run(tmp_path):
    """The attack end to end: `adaptiveload train` over a folder holding a crafted
    ckpt-*.pt trains from step 0, says so in one line, and the payload never runs."""
    exp = write_experiment(tmp_path, steps=2, warmup_steps=1, checkpoint_every=2, world_size=2)
    out, marker = tmp_path / "run", tmp_path / "marker"
    plant_checkpoint(out / "checkpoints" / "ckpt-00000001.pt", marker)  # within its 2 steps: read
    result = adaptiveload(
        "train", "--config", str(exp), "--policy", "adaptiveload", "--seed", "0",
        "--out", str(out), "--no-track", env=cli_env(), cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not marker.exists(), "loading the checkpoint ran its payload"
    (note,) = notes(result.stderr)
    assert "ckpt-00000001.pt" in note and "unsafe" in note
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["ckpt-00000002.pt"]
