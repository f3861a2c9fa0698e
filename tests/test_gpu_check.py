"""The prepared H200 check (experiments/gpu): its calibration grid cap, its training budgets,
checkpoint-free training, the all-to-all part recorded as not applicable on fewer than 2 GPUs,
and the whole script dry-run on CPU and imported back."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest

from adaptiveload import experiment
from adaptiveload.calibration.additivity import held_out
from adaptiveload.calibration.measure import calibrate
from adaptiveload.calibration.settings import BudgetRules, CalibrationConfig, Grid
from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "experiments" / "gpu"
sys.path.insert(0, str(GPU))

import import_results  # noqa: E402
import train_budgets  # noqa: E402

PRIOR = ROOT / "experiments" / "calibration" / "h200-wan2.1-t2v-1.3b.json"
MEASURED = ROOT / "experiments" / "calibration" / "h200-wan2.1-t2v-1.3b-measured.json"


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_ENABLE_TELEMETRY="false")


def test_max_batch_tokens_that_leaves_too_few_points_is_refused():
    with pytest.raises(UserError, match="leaves 3 grid point"):
        grid = Grid(batch_sizes=(1, 2), tokens=(16, 64), max_batch_tokens=64)
        calibrate(CalibrationConfig(model="wan2.1-micro", grid=grid, budgets=BudgetRules(0.1)),
                  progress=False)


def _script_calibration(variable: str, *extra: str) -> CalibrationConfig:
    """The CalibrationConfig h200.sh's `variable` (CAL_FLAGS_CUDA or CAL_FLAGS_DRY) gives,
    through the command line's own parser and its one place flags become a config."""
    import typer

    from adaptiveload.cli.app import app
    from adaptiveload.cli.calibrate import _settings

    script = (GPU / "h200.sh").read_text()
    flags = re.search(rf'^{variable}="(.*?)"$', script, re.S | re.M).group(1)
    measure = typer.main.get_command(app).commands["calibrate"].commands["measure"]
    ctx = measure.make_context("measure", [*shlex.split(flags.replace("\\\n", " ")), *extra,
                                           "-o", "unused.json"])
    return _settings(None, dict(ctx.params, max_loo=ctx.params["max_loo_error"]))


def _device_seconds(seconds: float, grid: Grid) -> float:
    """Device time of one grid point or pack of `seconds` a step (all above the 50 ms that
    buys a probe step): its warm-up steps (the last one timed), then one step per pass."""
    return (grid.warmup + grid.repeats) * seconds


def test_the_device_check_times_mixed_packs_within_the_h200_and_its_part_limit():
    """The calibrate part's packs (CAL_FLAGS_CUDA): mixes of short and long segments, each
    within the H200's memory and the grid's largest bucket by the measured calibration; grid
    and packs together predicted to leave the part's limit room for the model's start and the
    validation (model: the measured 1.3B calibration's step times)."""
    cfg = _script_calibration("CAL_FLAGS_CUDA", "--model", "wan2.1-t2v-1.3b", "--device", "cuda")
    grid, cal = cfg.grid, Calibration.load(MEASURED)
    assert [p.name for p in grid.packs] == ["floor", "short", "medium", "long"]
    usable = cal.usable_bytes
    for pack in grid.packs:
        assert min(pack.tokens) == 1560 and len(set(pack.tokens)) >= 2
        assert max(pack.tokens) <= max(grid.tokens)
        assert cal.cost.set_memory(pack.tokens) < 0.5 * usable, pack.name
    assert cal.cost.set_time(grid.packs[0].tokens) < 1.25 * cal.cost.t_floor  # under the floor
    packs_s = sum(_device_seconds(cal.cost.set_time(p.tokens), grid) for p in grid.packs)
    from adaptiveload.calibration.measure import _checked_grid

    points, _ = _checked_grid(grid, largest=75600)
    grid_s = sum(_device_seconds(float(cal.cost.step_time(b, s)), grid)
                 for b, s in points)
    limit = int(re.search(r"CALIBRATE_S:-(\d+)", (GPU / "h200.sh").read_text()).group(1))
    # then memory up to the budgets: M_mem and the largest pack of the 16-rank packed plan
    from adaptiveload.calibration.grid import memory_points
    from adaptiveload.calibration.measure import _memory_targets
    from adaptiveload.calibration.mix import mixture_token_mix

    mix = mixture_token_mix("paper-mixed", 20_000)
    targets = _memory_targets(cal, mix, cfg.validation.world_size, cfg.seed)
    assert targets["largest_pack"] > targets["m_mem"] > 3.5 * cal.measured_memory_tokens
    reached = max(b * s for b, s in points)
    memory = memory_points(list(targets.values()), grid.tokens, reached, cal.cost)
    assert all(b * s >= t for (b, s), t in zip(memory, sorted(targets.values()), strict=True))
    assert all(cal.cost.memory(b, s) < usable for b, s in memory)  # measurable on the H200
    memory_s = sum(float(cal.cost.step_time(b, s)) for b, s in memory)  # one pass each
    assert packs_s < 25 and memory_s < 30
    assert grid_s + packs_s + memory_s < limit - 50, (grid_s, packs_s, memory_s, limit)
    dry = _script_calibration("CAL_FLAGS_DRY", "--model", "wan2.1-micro")
    assert [p.name for p in dry.grid.packs] == ["short", "mixed"]


def test_the_summary_reports_the_additivity_of_the_packs(tmp_path, gpu_script):
    summarize = gpu_script("summarize")
    cal = Calibration.load(MEASURED)
    rows = [{"pack": "mixed", "tokens": [32760, 1560], "samples": 2, "sum_tokens": 34320,
             "status": "ok", "time_s": 3.3, "peak_bytes": 30e9},
            {"pack": "huge", "tokens": [75600, 75600, 1560], "samples": 3, "sum_tokens": 152760,
             "status": "oom", "time_s": None, "peak_bytes": None}]
    data = cal.to_dict()
    data["additivity"] = held_out(cal.cost, rows, memory_measured=True, timer="wall")
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "h200.json").write_text(json.dumps(data))
    summarize.main(tmp_path)
    add = json.loads((tmp_path / "summary.json").read_text())["calibration"]["additivity"]
    assert (add["num_packs"], add["num_measured"], add["worst_pack"]) == (2, 1, "mixed")
    pred = cal.cost.set_time([32760, 1560])
    assert add["packs"][0]["predicted_s"] == pytest.approx(pred)
    assert add["max_rel_err"] == pytest.approx(abs(pred / 3.3 - 1))
    assert "cpu_s_passes" not in add["packs"][0]  # the headline, not the raw passes
    text = (tmp_path / "summary.txt").read_text()
    assert "additivity: 1 of 2 mixed packs held out of the fit (wall-clock seconds)" in text
    assert "  mixed: 32760 + 1560 = 34320 tokens: measured 3.3 s" in text
    assert "  huge: 75600x2 + 1560 = 152760 tokens: oom" in text
    del data["additivity"]  # a calibration of before the packs
    (tmp_path / "calibration" / "h200.json").write_text(json.dumps(data))
    summarize.main(tmp_path)
    assert "additivity: no packs in this calibration" in (tmp_path / "summary.txt").read_text()


def test_training_budgets_fit_the_longest_bucket_and_keep_the_measured_model():
    prior = Calibration.load(PRIOR)
    exp = experiment.load(GPU / "h200_train.yaml")
    out = train_budgets.scaled(prior, exp, fill=1.0)
    longest = out.extra["manifest"]["tokens_max"]
    assert longest == 7200  # 5 frames of 720p: 2 latent frames x 45 x 80
    assert out.m_mem == pytest.approx(longest)
    assert out.extra["budgets"]["max_fits"]
    assert out.cost == prior.cost and out.source == prior.source
    assert out.capacity_bytes < prior.capacity_bytes
    b = out.extra["budgets"]
    assert out.m_comp == pytest.approx(b["ref_batch"] * b["ref_tokens"] ** out.p)
    # M_mem sized to the longest bucket exactly: rounding must not drop it as the reference
    assert (b["ref_tokens"], b["ref_batch"]) == (longest, 1) and out.m_tok == longest
    roomy = train_budgets.scaled(prior, exp, fill=1.5)  # the script's default
    assert roomy.m_mem == pytest.approx(1.5 * longest) and roomy.m_tok == longest
    assert out.extra["paper_scale_budgets"]["m_mem"] == prior.m_mem
    with pytest.raises(UserError, match="--fill"):
        train_budgets.scaled(prior, exp, fill=0.5)


@pytest.mark.slow
def test_training_without_checkpoints_writes_none(tmp_path):
    cal = tmp_path / "cal.json"
    cal_out = tmp_path / "cal-train.json"
    run = [sys.executable, "-m", "adaptiveload"]
    proc = subprocess.run(  # an analytic calibration: deterministic, no timing noise
        [*run, "calibrate", "prior", "--model", "wan2.1-micro", "--mixture",
         "tiny-cpu", "--num-samples", "200", "--grid", "tiny", "-o", str(cal)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = ["--calibration", str(cal), "--config", str(GPU / "dry_train.yaml"), "-o", str(cal_out)]
    assert train_budgets.main(args) == 0
    out = tmp_path / "run"
    proc = subprocess.run(
        [*run, "train", "--config", str(GPU / "dry_train.yaml"), "--policy", "adaptiveload",
         "--seed", "0", "--steps", "2", "--emulate-world-size", "4", "--calibration",
         str(cal_out), "--no-track", "--no-checkpoint", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "checkpoints").exists()
    steps = pd.read_parquet(out / "steps.parquet")
    assert sorted(steps["rank"].unique()) == [0, 1, 2, 3] and steps["step"].max() == 1


@pytest.mark.slow
def test_the_comm_part_is_not_applicable_without_two_gpus(tmp_path):
    """Not a dry run, on a machine without 2 GPUs (here none): the comm part starts nothing,
    records why, and does not count as unfinished; the summary says so."""
    out = tmp_path / "h200"
    env = dict(_env(), PARTS="comm", PYTHON=sys.executable, WHEELS=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(GPU / "h200.sh"), str(out)], cwd=ROOT, env=env, capture_output=True,
        text=True, errors="replace", timeout=600,
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


@pytest.mark.slow
def test_dry_run_of_the_whole_check_imports_back(tmp_path):
    """DRY_RUN=1 h200.sh, every part: the 2-process torchrun check, kernel_check.sh cut at its
    limit (its nvcc build takes minutes here), calibration, 16 emulated ranks under a one-shape
    and the packed policy, both kernels (the fused op's CPU fallback); the packed tarballs,
    then the importer."""
    out, pack = tmp_path / "h200", tmp_path / "pack"
    env = dict(_env(), DRY_RUN="1", PYTHON=sys.executable, KERNEL_S="5", WHEELS=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(GPU / "h200.sh"), str(out), str(pack)],
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
