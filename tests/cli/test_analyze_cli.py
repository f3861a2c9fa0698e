"""`adaptiveload analyze` given the wrong table: one line, exit 2, nothing written."""

from __future__ import annotations

import pandas as pd
from cli_runner import run


def test_convergence_of_one_runs_steps_is_one_line(tmp_path, monkeypatch, capsys):
    """`analyze convergence --steps` given one run's steps.parquet (no run keys) instead of
    the aggregated table: exit 2, one line naming the file and the table to pass."""
    steps = tmp_path / "steps.parquet"
    pd.DataFrame({"step": [0, 1], "rank": [0, 0], "step_time_s": [0.1, 0.1],
                  "loss": [1.0, 0.9]}).to_parquet(steps)
    code, _, err = run(monkeypatch, capsys, "analyze", "convergence", "--steps", str(steps),
                       "--csv", str(tmp_path / "c.csv"), "--md", str(tmp_path / "c.md"))
    assert code == 2 and err.strip().count("\n") == 0
    assert f"{steps}: no column setup" in err and "analyze aggregate --steps-out" in err
    assert not (tmp_path / "c.csv").exists()
