"""The real Snakemake pipeline, end to end, on a tiny experiment in a copy of the repository's
workflow: outputs, report, MLflow runs, a no-op second run; plus lint and config validation."""

from __future__ import annotations

import json

import pytest
from workflow_setup import REPO, copy_workflow, snakemake


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = copy_workflow(tmp_path_factory.mktemp("pipeline"))
    out = snakemake(work, "--cores", "2", "--configfile", "experiments/tiny.yaml")
    assert out.returncode == 0, out.stderr[-6000:]
    return work


@pytest.mark.slow
def test_pipeline_produces_tables_figures_and_mlflow_runs(tiny_run):
    res = tiny_run / "results" / "tiny"
    table = (res / "tables" / "paper_table.md").read_text()
    assert "equal-token" in table and "adaptiveload" in table
    assert "measured (" in table and "model (" in table  # both sources labelled
    assert "18.9%" in table  # the paper's numbers side by side
    assert "Mann-Whitney U" in (res / "tables" / "stats.md").read_text()
    for name in ("mixture_tokens", "compute_heatmap", "imbalance_distribution", "throughput",
                 "vram_utilization", "calibration_fit", "kernel_bandwidth", "p_sweep",
                 "load_vs_lower_bound"):
        png = res / "figures" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
    assert (tiny_run / "logs" / "tiny" / "aggregate.log").exists()
    assert (tiny_run / "benchmarks" / "tiny" / "aggregate.tsv").exists()

    from mlflow.tracking import MlflowClient

    from adaptiveload.tracking.store import artifact_paths

    uri = f"sqlite:///{tiny_run / 'results' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    kinds = [r.data.tags.get("adaptiveload.kind", "train") for r in runs]
    assert kinds.count("analysis") == 1
    trained = [r for r in runs if r.data.tags.get("adaptiveload.kind") != "analysis"]
    assert len(trained) == 4  # 2 policies x 2 seeds
    for run in trained:
        assert "summary/imbalance_rate_mean_of_steps" in run.data.metrics
        assert run.data.params["run.policy"] == run.data.tags["policy"]
        assert len(client.get_metric_history(run.info.run_id, "loss")) == 6
        policy, seed = run.data.tags["policy"], run.data.tags["seed"]
        assert run.data.tags["mlflow.note.content"].startswith(f"{policy}, seed {seed}, ")
        # the run executed the plan the pipeline's plan rule wrote (train --plan)
        executed = json.loads(
            (res / "runs" / policy / f"seed{seed}" / "eager" / "plan_summary.json").read_text()
        )
        planned = json.loads((res / "plans" / policy / f"seed{seed}.json").read_text())
        assert executed["plan_digest"] == planned["plan_digest"]
    analysis = next(r for r in runs if r.data.tags.get("adaptiveload.kind") == "analysis")
    assert "train/eager/adaptiveload/throughput_change" in analysis.data.metrics
    assert all(" " not in k for k in analysis.data.metrics) and len(analysis.data.metrics) < 60
    assert analysis.data.params["experiment.name"] == "tiny" and analysis.data.tags["git_commit"]
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.tags["mlflow.note.content"] == "integration test of the full pipeline"
    arts = set(artifact_paths(client, uri, analysis.info.run_id))
    assert {"figures/throughput.png", "tables/stats.csv", "tables/paper_table.csv"} <= arts


@pytest.mark.slow
def test_second_run_is_a_noop_and_report_renders(tiny_run):
    out = snakemake(tiny_run, "-n", "--configfile", "experiments/tiny.yaml")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Nothing to be done" in out.stdout + out.stderr
    report = tiny_run / "results" / "tiny" / "report.html"
    out = snakemake(tiny_run, "--configfile", "experiments/tiny.yaml", "--report", str(report))
    assert out.returncode == 0, out.stderr[-3000:]
    assert report.stat().st_size > 100_000  # figures embedded


def test_lint_is_clean():
    out = snakemake(REPO, "--lint", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_bad_config_fails_validation_naming_the_field(tmp_path):
    work = copy_workflow(tmp_path)
    (work / "experiments" / "bad.yaml").write_text("name: bad\ntrain: {world_size: 0}\n")
    out = snakemake(work, "-n", "--configfile", "experiments/bad.yaml", timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr  # Snakemake prints its errors on stdout
    assert "world_size" in text and "minimum" in text


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("name: bad\ntrain: {lr: .nan}\n", "train.lr"),  # no JSON Schema bound refuses NaN
        ("name: bad\ntrain: {grad_clip: .inf}\n", "grad_clip"),
        ("name: bad\ntrain: {steps: 3}\ntrain: {steps: 4}\n", "key 'train' given twice"),
    ],
)
def test_dry_run_refuses_what_the_commands_refuse(tmp_path, text, expect):
    work = copy_workflow(tmp_path)
    (work / "experiments" / "bad.yaml").write_text(text)
    out = snakemake(work, "-n", "--configfile", "experiments/bad.yaml", timeout=300)
    assert out.returncode != 0
    assert expect in out.stdout + out.stderr
