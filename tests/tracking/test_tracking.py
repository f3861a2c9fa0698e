"""MLflow tracking: store set-up, batched logging, and nothing lost when the store goes away."""

from __future__ import annotations

from pathlib import Path

from training_setup import adaptiveload, cli_env


def test_sync_of_a_bad_spool_is_a_user_error(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"kind": "step"}\n')
    result = adaptiveload("sync", str(bad), env=cli_env(), cwd=tmp_path)
    assert result.returncode == 2 and "header" in result.stderr
    assert Path(bad).exists()
