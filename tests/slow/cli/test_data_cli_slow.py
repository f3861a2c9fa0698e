"""`adaptiveload manifest ...` end to end, through a real subprocess."""

import json
import subprocess
from pathlib import Path

import pandas as pd
from training_setup import adaptiveload

from adaptiveload.data.manifest import load_manifest
from adaptiveload.data.mixtures import synthesize


def cli(*args: str | Path | int) -> subprocess.CompletedProcess:
    return adaptiveload("manifest", *map(str, args))


def test_synth_then_describe(tmp_path):
    csv, pq = tmp_path / "m.csv", tmp_path / "m.parquet"
    assert cli("synth", "--mixture", "tiny-cpu", "-n", 300, "--seed", 5, "-o", csv).returncode == 0
    assert cli("synth", "--mixture", "tiny-cpu", "-n", 300, "--seed", 5, "-o", pq).returncode == 0
    expected = synthesize("tiny-cpu", 300, 5)
    for path in (csv, pq):
        got = load_manifest(path)
        pd.testing.assert_frame_equal(
            got[["sample_id", "num_frames", "height", "width"]],
            expected[["sample_id", "num_frames", "height", "width"]],
        )
    out = cli("describe", pq, "--grid", "tiny", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["num_samples"] == 300 and summary["num_excluded"] == 0
    assert summary["excluded_examples"] == []
    assert set(summary["tokens"]) == {"min", "max", "mean", "p50", "p99"}
    assert sum(b["count"] for b in summary["buckets"]) == 300
    assert set(summary["buckets"][0]) == {"frames", "height", "width", "tokens", "count"}
    assert cli("describe", csv, "--bucketing", "exact", "-o", tmp_path / "d.json").returncode == 0
    exact = json.loads((tmp_path / "d.json").read_text())
    assert exact["bucketing"] == "exact" and exact["num_samples"] == 300


def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("sample_id,num_frames,height,width\na,81,480,832\nb,0,480,832\n")
    out = cli("describe", bad, "--json")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "bad.csv" in out.stderr and "'num_frames'" in out.stderr and "line 3" in out.stderr

    target = tmp_path / "never.csv"
    for args in (
        ("synth", "--mixture", "nope", "-n", 5, "-o", target),
        ("synth", "--mixture", "tiny-cpu", "-n", 0, "-o", target),
        ("synth", "--mixture", "tiny-cpu", "-n", 5, "-o", tmp_path / "never.txt"),
    ):
        out = cli(*args)
        assert out.returncode == 2 and out.stderr.startswith("error: "), out.stderr
    assert list(tmp_path.iterdir()) == [bad]
