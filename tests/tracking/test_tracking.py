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


def test_tracking_check_refuses_a_store_that_is_not_there(tmp_path):
    """`tracking check` on a sqlite store that vanished created an empty one and checked the
    runs against it: one line naming the store, exit 2, and no store created."""
    store = tmp_path / "gone" / "mlflow.db"
    result = adaptiveload("tracking", "check", "--experiment", "e", str(tmp_path / "run"),
                          "-o", str(tmp_path / "check.json"),
                          env=cli_env(f"sqlite:///{store}"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert f"sqlite:///{store}: no tracking store there" in result.stderr
    assert not store.exists() and not (tmp_path / "check.json").exists()
