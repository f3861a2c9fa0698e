"""The prepared H200 check (experiments/gpu): its calibration grid cap, its training budgets,
checkpoint-free training, the all-to-all part recorded as not applicable on fewer than 2 GPUs,
and the whole script dry-run on CPU and imported back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest
from repo_paths import GPU_SCRIPTS, ROOT

from adaptiveload.errors import UserError


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_ENABLE_TELEMETRY="false")


def test_training_without_checkpoints_writes_none(tmp_path, gpu_script):
    train_budgets = gpu_script("train_budgets")
    cal = tmp_path / "cal.json"
    cal_out = tmp_path / "cal-train.json"
    run = [sys.executable, "-m", "adaptiveload"]
    proc = subprocess.run(  # an analytic calibration: deterministic, no timing noise
        [*run, "calibrate", "prior", "--model", "wan2.1-micro", "--mixture",
         "tiny-cpu", "--num-samples", "200", "--grid", "tiny", "-o", str(cal)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = ["--calibration", str(cal), "--config", str(GPU_SCRIPTS / "dry_train.yaml"), "-o",
            str(cal_out)]
    assert train_budgets.main(args) == 0
    out = tmp_path / "run"
    proc = subprocess.run(
        [*run, "train", "--config", str(GPU_SCRIPTS / "dry_train.yaml"), "--policy", "adaptiveload",
         "--seed", "0", "--steps", "2", "--emulate-world-size", "4", "--calibration",
         str(cal_out), "--no-track", "--no-checkpoint", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "checkpoints").exists()
    steps = pd.read_parquet(out / "steps.parquet")
    assert sorted(steps["rank"].unique()) == [0, 1, 2, 3] and steps["step"].max() == 1


def test_the_comm_part_is_not_applicable_without_two_gpus(tmp_path):
    """Not a dry run, on a machine without 2 GPUs (here none): the comm part starts nothing,
    records why, and does not count as unfinished; the summary says so."""
    out = tmp_path / "h200"
    env = dict(_env(), PARTS="comm", PYTHON=sys.executable, WHEELS=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(GPU_SCRIPTS / "h200.sh"), str(out)], cwd=ROOT, env=env,
        capture_output=True, text=True, errors="replace", timeout=600,
    )
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert ["comm", "not-applicable", "0"] in rows, proc.stdout[-3000:]
    assert "needs >= 2 processes with a GPU each" in (out / "comm" / "skipped.txt").read_text()
    assert sorted(p.name for p in (out / "comm").iterdir()) == ["skipped.txt"]  # no torchrun
    summary = json.loads((out / "summary.json").read_text())
    assert summary["comm"]["status"] == "not-applicable"
    assert "-- comm" in (out / "summary.txt").read_text()
    unfinished = {part for part, status, _ in rows if status not in ("0", "not-applicable")}
    assert unfinished <= {"preflight"}  # which fails where torch sees no CUDA; comm does not
    assert proc.returncode == (1 if unfinished else 0)


def test_dry_run_of_the_whole_check_imports_back(tmp_path, gpu_script):
    """DRY_RUN=1 h200.sh, every part: the 2-process torchrun check, kernel_check.sh cut at its
    limit (its nvcc build takes minutes here), calibration, 16 emulated ranks under a one-shape
    and the packed policy, both kernels (the fused op's CPU fallback); the packed tarballs,
    then the importer."""
    import_results = gpu_script("import_results")
    out, pack = tmp_path / "h200", tmp_path / "pack"
    env = dict(_env(), DRY_RUN="1", PYTHON=sys.executable, KERNEL_S="5", WHEELS=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(GPU_SCRIPTS / "h200.sh"), str(out), str(pack)],
        cwd=ROOT, env=env, capture_output=True, text=True, errors="replace", timeout=1800,
    )
    parts = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines()[1:])
    # each part ran under its own limit: the kernel part was cut at 5 s, the others finished
    assert parts.pop("kernel") == "124", proc.stdout[-3000:]
    assert set(parts.values()) == {"0"}, parts
    assert proc.returncode == 1  # the script's status says a part did not finish
    assert {"preflight", "dist", "calibrate", "comm", "train_budgets"} <= set(parts)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["train"]) == 4
    assert {r["policy"] for r in summary["train"]} == {"equal-token", "adaptiveload-packed"}
    assert {r["kernel"] for r in summary["train"]} == {"eager", "fused"}
    assert all(r["imbalance_predicted"] is not None for r in summary["train"])
    assert summary["calibration"]["label"].startswith("measured")
    additivity = summary["calibration"]["additivity"]  # CAL_FLAGS_DRY's packs, held out
    assert [r["pack"] for r in additivity["packs"]] == ["short", "mixed"]
    assert additivity["num_measured"] == 2 and additivity["max_rel_err"] >= 0
    assert "additivity: 2 of 2 mixed packs" in (out / "summary.txt").read_text()
    assert summary["dist"]["launch_mode"] == "distributed" and summary["dist"]["world_size"] == 2
    comm = summary["comm"]  # 2 gloo processes on the CPU: the part's plumbing
    assert comm["status"] == "measured" and comm["world_size"] == 2 and comm["backend"] == "gloo"
    assert [link["degree"] for link in comm["links"]] == [2]
    steps = pd.read_parquet(out / "dist" / "ddp" / "steps.parquet")
    assert sorted(steps["rank"].unique()) == [0, 1]
    # PACKDIR as the README lists it: one tarball per part, the summary and steps.tsv beside
    # them; files over 12 MB (long logs) are left out of the tarballs
    packed = sorted(p.name for p in pack.iterdir())
    assert packed == ["calibration.tar.gz", "comm.tar.gz", "dist.tar.gz", "env.tar.gz",
                      "kernel.tar.gz", "steps.tsv", "summary.txt", "train.tar.gz"]
    for tarball in pack.glob("*.tar.gz"):
        with tarfile.open(tarball) as tar:
            members = tar.getmembers()
        assert members and all(m.size < 12 * 2**20 for m in members), tarball.name

    dest = tmp_path / "reference" / "h200" / "{date}"
    with pytest.raises(UserError, match="not an H200"):
        import_results.import_run(pack, dest)
    assert not (tmp_path / "reference").exists()  # validated before writing
    prov = import_results.import_run(pack, dest, dry=True)
    dated = Path(prov["dest"])
    assert dated.name == prov["date"][:10] and (dated / "provenance.json").is_file()
    assert prov["dry_run"] and len(prov["training_runs"]) == 4 and prov["archive_sha256"]
    assert prov["dist_check"]["launch_mode"] == "distributed"
    assert prov["additivity"]["num_measured"] == 2
    assert prov["repo_commit"] and prov["versions"]["torch"]
    again = import_results.import_run(pack, dest, dry=True)  # the same date: a new folder
    assert Path(again["dest"]).name == f"{dated.name}-2"
    merged = import_results.import_run(pack, Path(prov["dest"]), dry=True, merge=True)
    assert merged["merged_over"]["archive_sha256"] == prov["archive_sha256"]
    index = json.loads((dated / "run_index.json").read_text())
    assert all(Path(r["summary"]).is_file() and Path(r["steps"]).is_file() for r in index)
    from adaptiveload.analysis.aggregate import aggregate, parse_index

    agg = aggregate(parse_index(str(dated / "run_index.json")))
    assert len(agg.runs) == 4 and set(agg.runs["source"]) == {"measured"}
