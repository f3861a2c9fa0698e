"""The real Snakemake pipeline, end to end, on a tiny experiment in a copy of the repository's
workflow: outputs, report, MLflow runs, a no-op second run; plus lint and config validation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fault_setup import alive, descendants
from repo_paths import ROOT
from workflow_setup import copy_workflow, snakemake
from workflow_setup import dry_run_jobs as _jobs

from adaptiveload.tracking.store import experiment_name

POLICY_PAIR = ("equal-token", "adaptiveload")  # tests/fixtures/tiny.yaml's policies


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = copy_workflow(tmp_path_factory.mktemp("pipeline"))
    out = snakemake(work, "--cores", "2", "--configfile", "experiments/tiny.yaml")
    assert out.returncode == 0, out.stderr[-6000:]
    return work


def test_pipeline_produces_tables_figures_and_mlflow_runs(tiny_run):
    res = tiny_run / "results" / "tiny"
    table = (res / "tables" / "paper_table.md").read_text()
    assert "equal-token" in table and "adaptiveload" in table
    assert "measured (" in table and "model (" in table  # both sources labelled
    assert "18.9%" in table  # the paper's numbers side by side
    stats = (res / "tables" / "stats.md").read_text()  # replicate-level: 2 seeds, p >= 0.5
    assert "paired t interval, sign-flip p" in stats and "seed range (model" in stats
    assert "**train**" in (res / "tables" / "headline.md").read_text()
    for name in ("mixture_tokens", "compute_heatmap", "imbalance_distribution", "throughput",
                 "vram_utilization", "calibration_fit", "p_sweep", "load_vs_lower_bound"):
        png = res / "figures" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
    assert not (res / "figures" / "kernel_bandwidth.png").exists()  # nothing measured
    landing = (res / "analysis" / "landing.rst").read_text()
    assert all(f"**{policy}**" in landing for policy in POLICY_PAIR) and "×" in landing
    assert (tiny_run / "logs" / "tiny" / "aggregate.log").exists()
    assert (tiny_run / "benchmarks" / "tiny" / "aggregate.tsv").exists()

    from mlflow.tracking import MlflowClient

    from adaptiveload.tracking.store import artifact_paths

    uri = f"sqlite:///{tiny_run / 'results' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment_name("tiny"))
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
    assert {"adaptiveload/speedup", "adaptiveload/speedup_ci_low",
            "equal-token/imbalance_rate"} <= set(analysis.data.metrics)
    assert analysis.data.tags["adaptiveload.headline_setup"] == "train"
    # the simulations: runs of their own experiment, the matched setup among them
    sim_exp = client.get_experiment_by_name(experiment_name("tiny", "simulations"))
    sims = client.search_runs([sim_exp.experiment_id], max_results=1000)
    assert len(sims) == 2 * 2 * 3 * 2  # 2 setups x (base + 2 p) x 2 policies x 2 seeds
    assert {r.data.tags["source"] for r in sims} == {"model"}
    assert "sim/h200-1.3b-matched" in {r.data.tags["setup"] for r in sims}
    assert "sim/h200-1.3b-matched" in table
    matched = {p: json.loads((res / "sim" / "h200-1.3b-matched" / "base" / p / "seed0" /
                              "summary.json").read_text())["plan"] for p in POLICY_PAIR}
    assert {s["steps_per_epoch"] for s in matched.values()} == {"match"}
    assert matched["adaptiveload"]["steps"] == matched["equal-token"]["steps"]
    assert all(" " not in k for k in analysis.data.metrics) and len(analysis.data.metrics) < 12
    assert analysis.data.params["experiment.name"] == "tiny" and analysis.data.tags["git_commit"]
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.tags["mlflow.note.content"] == "integration test of the full pipeline"
    arts = set(artifact_paths(client, uri, analysis.info.run_id))
    assert {"figures/throughput.png", "tables/stats.csv", "tables/paper_table.csv"} <= arts
    # the end-of-training check found every run FINISHED, nothing left spooled
    checked = json.loads((res / "tracking" / "check.json").read_text())["runs"]
    assert {r["run_id"] for r in checked} == {r.info.run_id for r in trained}
    assert not list(res.rglob("tracking.spool.jsonl"))


def test_second_run_is_a_noop_and_report_renders(tiny_run):
    out = snakemake(tiny_run, "-n", "--configfile", "experiments/tiny.yaml")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Nothing to be done" in out.stdout + out.stderr
    report = tiny_run / "results" / "tiny" / "report.html"
    out = snakemake(tiny_run, "--configfile", "experiments/tiny.yaml", "--report", str(report))
    assert out.returncode == 0, out.stderr[-3000:]
    assert report.stat().st_size > 100_000  # figures embedded
    text = report.read_text(encoding="utf-8")
    assert "Headline numbers" in text and "stats.csv" in text  # the landing text leads


def test_lint_is_clean():
    out = snakemake(ROOT, "--lint", timeout=300)
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


def test_a_hostile_experiment_file_runs_no_code_and_writes_only_in_its_folder(tmp_path):
    """An experiment file someone shares: a `$(...)` in a value the schema refuses, a name
    that would put its results in the checkout root is refused, and a path the schema cannot
    restrict (a manifest of the user's own, named with `$(...)` and a space) reaches the
    job's shell as one quoted word: the describe job runs on that file and nothing else."""
    work = copy_workflow(tmp_path)
    experiments = work / "experiments"
    for name, text in (("mixture", "name: hostile\ndata: {mixture: '$(touch PWNED)tiny-cpu'}\n"),
                       ("baseline", "name: hostile\nanalysis: {baseline: '$(touch PWNED)'}\n"),
                       ("dots", "name: '..'\n")):
        (experiments / f"{name}.yaml").write_text(text)
        out = snakemake(work, "-n", "--configfile", f"experiments/{name}.yaml", timeout=300)
        text = out.stdout + out.stderr
        assert out.returncode != 0, text[-2000:]
        assert "does not match" in text or "is not one of" in text, text[-2000:]
    made = subprocess.run([sys.executable, "-m", "adaptiveload", "manifest", "synth", "--mixture",
                           "tiny-cpu", "-n", "8", "-o", str(experiments / "m $(touch PWNED).csv")],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    (experiments / "hostile.yaml").write_text(
        "name: hostile\ndata: {manifest: 'experiments/m $(touch PWNED).csv'}\n")
    target = "results/hostile/data/describe.json"
    out = snakemake(work, "--cores", "1", target, "--configfile", "experiments/tiny.yaml",
                    "experiments/hostile.yaml", timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert json.loads((work / target).read_text())
    assert not list(work.rglob("PWNED")) and not (ROOT / "PWNED").exists()
    assert not (work / "config.yaml").exists() and not (work / "data").exists()


def test_a_second_experiment_file_of_the_same_name_is_refused(tmp_path):
    """Two experiment files with one `name` would share results/<name> and its MLflow
    experiment: once the first has written there, the second is refused when the Snakefile
    is read, naming both files and the fix; the first (edited or layered) still runs."""
    work = copy_workflow(tmp_path)
    owner = work / "results" / "tiny" / "experiment_file"
    made = snakemake(work, "--cores", "1", str(owner.relative_to(work)), "--configfile",
                     "experiments/tiny.yaml", timeout=300)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert owner.read_text() == "experiments/tiny.yaml\n"
    (work / "experiments" / "other.yaml").write_text("name: tiny\nseeds: [5]\n")
    refused = snakemake(work, "-n", "--configfile", "experiments/other.yaml", timeout=300)
    text = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert ("experiments/other.yaml: name: 'tiny' is already the name of "
            "experiments/tiny.yaml") in text
    (work / "experiments" / "edit.yaml").write_text("seeds: [5]\n")  # an overlay: no name
    layered = snakemake(work, "-n", "--configfile", "experiments/tiny.yaml",
                        "experiments/edit.yaml", timeout=300)
    assert layered.returncode == 0, layered.stdout[-3000:] + layered.stderr[-3000:]


# -- faults: the pipeline never ends in a false success -------------------------------------
_ANALYSIS = {"aggregate": 1, "stats": 1, "tables": 1, "figures": 1, "landing": 1, "record": 1}
_TRAINING = {"train": 4, "tracking_check": 1, **_ANALYSIS}
# one edit per section of the experiment -> the jobs it reruns (2 policies x 2 seeds)
SECTION_EDITS = [
    ({"description": "edited"}, {"record": 1}),
    ({"analysis": {"seed": 3}},
     {k: 1 for k in ("stats", "tables", "figures", "landing", "record")}),
    ({"calibration": {"repeats": 3}}, {"config_view": 1, "calibrate": 1, "plan": 4, **_TRAINING}),
    ({"train": {"lr": 2.0e-4}}, {"config_view": 1, **_TRAINING}),
    # the experiment's step mode: training plans, training (its view) and the simulation
    # entry that does not set its own
    ({"plan": {"steps_per_epoch": "match"}}, {"config_view": 1, "plan": 4, "simulate": 12,
                                              **_TRAINING}),
    ({"budgets": {"m_comp": 50000}}, {"config_view": 1, "plan": 4, **_TRAINING}),
    ({"data": {"num_samples": 40}}, {"config_view": 2, "manifest": 1, "describe": 1,
                                     "calibrate": 1, "plan": 4, **_TRAINING}),
    # a new kernel trains the new runs only (and builds the kernel)
    ({"model": {"kernels": ["eager", "fused"]}}, {"kernel_build": 1, "run_index": 1,
                                                  **_TRAINING}),
    ({"policies": ["equal-token", "adaptiveload", "adaptiveload-balanced"]},
     {"plan": 2, "run_index": 1, "simulate": 12, **_TRAINING, "train": 2}),
    ({"seeds": [0, 1, 2]}, {"plan": 2, "run_index": 1, "simulate": 12, **_TRAINING, "train": 2}),
    ({"simulate": [{"name": "h200-1.3b", "mixture": "paper-mixed", "num_samples": 300,
                    "calibration": "experiments/calibration/h200-wan2.1-t2v-1.3b.json",
                    "world_size": 4},
                   {"name": "h200-1.3b-matched", "mixture": "paper-mixed", "num_samples": 400,
                    "calibration": "experiments/calibration/h200-wan2.1-t2v-1.3b.json",
                    "world_size": 4, "steps_per_epoch": "match"}]},
     {"sim_manifest": 1, "simulate": 12, **_ANALYSIS}),
    # the matched entry at a step count instead: its 12 simulations only
    ({"simulate": [{"name": "h200-1.3b", "mixture": "paper-mixed", "num_samples": 400,
                    "calibration": "experiments/calibration/h200-wan2.1-t2v-1.3b.json",
                    "world_size": 4},
                   {"name": "h200-1.3b-matched", "mixture": "paper-mixed", "num_samples": 400,
                    "calibration": "experiments/calibration/h200-wan2.1-t2v-1.3b.json",
                    "world_size": 4, "steps_per_epoch": 30}]},
     {"simulate": 12, **_ANALYSIS}),
    ({"sweeps": {"p": [1.2]}}, {"run_index": 1, **_ANALYSIS}),
    # the kernel figure only once the benchmark measured (a checkpoint): not on a CPU
    ({"kernel": {"bench": True}}, {"kernel_build": 1, "kernel_bench": 1, "tables": 1,
                                   "landing": 1, "record": 1}),
]


def test_each_stage_reruns_only_for_the_config_sections_it_reads(tiny_run):
    """Calibration, plans and training depend on their own config sections (their views,
    results/<name>/config/<stage>.yaml), not on the description or the analysis settings:
    each section edited in turn reruns exactly the jobs that read it."""
    edit = tiny_run / "experiments" / "edit.yaml"
    try:
        for change, expected in SECTION_EDITS:
            edit.write_text(yaml.safe_dump(change))
            dry = snakemake(tiny_run, "-n", "--configfile", "experiments/tiny.yaml",
                            "experiments/edit.yaml")
            assert _jobs(dry) == {"config_resolved": 1, **expected}, change
    finally:
        edit.unlink(missing_ok=True)


def test_a_missing_intermediate_is_made_again(tiny_run):
    """A job that fails has its outputs removed; the jobs after it, whose outputs exist, must
    not hide that: every file the pipeline writes is a target (else "Nothing to be done")."""
    res = tiny_run / "results" / "tiny"
    moved = [res / "runs" / "adaptiveload" / "seed0" / "eager" / "summary.json",
             res / "analysis" / "runs.parquet", res / "analysis" / "steps.parquet"]
    for path in moved:
        path.rename(path.with_suffix(".aside"))
    try:
        jobs = _jobs(snakemake(tiny_run, "-n", "--configfile", "experiments/tiny.yaml"))
        assert jobs["train"] == 1 and jobs["aggregate"] == 1 and jobs["record"] == 1
    finally:
        for path in moved:
            path.with_suffix(".aside").rename(path)
    assert _jobs(snakemake(tiny_run, "-n", "--configfile", "experiments/tiny.yaml")) == {}


def test_a_failed_analysis_job_is_never_a_false_success(tiny_run):
    """A run's summary changes, then the aggregate job fails (here: the summary is
    unreadable): every plain rerun fails again, in one line, until the input is fixed; then
    the tables are made from the runs as they are now."""
    res = tiny_run / "results" / "tiny"
    summary = res / "runs" / "adaptiveload" / "seed0" / "eager" / "summary.json"
    good = summary.read_text()
    summary.write_text(good[: len(good) // 2])  # damaged (an edit, a disk)
    for _ in range(2):
        failed = snakemake(tiny_run, "--cores", "2", "--configfile", "experiments/tiny.yaml")
        assert failed.returncode != 0
        assert not (res / "analysis" / "runs.parquet").exists()
        (line,) = [ln for ln in (tiny_run / "logs" / "tiny" / "aggregate.log").read_text()
                   .splitlines() if ln.startswith("error:")]
        assert str(summary.relative_to(tiny_run)) in line and "run the pipeline again" in line
    summary.write_text(good)  # repaired: newer than every table made before
    fixed = snakemake(tiny_run, "--cores", "2", "--configfile", "experiments/tiny.yaml")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    for table in (res / "analysis" / "runs.parquet", res / "tables" / "paper_table.csv"):
        assert table.stat().st_mtime > summary.stat().st_mtime
    assert _jobs(snakemake(tiny_run, "-n", "--configfile", "experiments/tiny.yaml")) == {}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_every_job_dies_with_a_killed_snakemake_and_the_readme_recovers(tmp_path):
    """kill -9 of Snakemake while it calibrates (a job other than training): the job goes
    too. The next run refuses the stale lock, naming `--unlock`; what the README says to run
    after an interruption (`--unlock`, then the profile, which reruns incomplete jobs) works."""
    work = copy_workflow(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile",
         "experiments/tiny.yaml"], cwd=work, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )
    jobs: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(
            b"\0calibrate\0measure\0" in _cmdline(p) for p in descendants(proc.pid)
        ):
            assert proc.poll() is None, "snakemake ended before calibrating"
            time.sleep(0.2)
        jobs = descendants(proc.pid)
        assert jobs, "no job started"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10  # a calibration that just started has a minute left
        while any(alive(p) for p in jobs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in jobs if alive(p)], "jobs outlived the killed snakemake"
        assert not (work / "results" / "tiny" / "calibration" / "calibration.json").exists()
    finally:
        for pid in jobs:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    profile = ["--profile", "workflow/profiles/default", "--configfile", "experiments/tiny.yaml"]
    locked = snakemake(work, *profile)  # the README's recovery command, before --unlock
    assert locked.returncode != 0 and "--unlock" in locked.stdout + locked.stderr
    assert snakemake(work, "--unlock", "--configfile", "experiments/tiny.yaml").returncode == 0
    assert _jobs(snakemake(work, "-n", *profile))["calibrate"] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_job_that_writes_a_computed_file_dies_with_a_killed_snakemake(tmp_path):
    """kill -9 of Snakemake while it writes the run index (a job of Python, not a command):
    the job goes with it and writes nothing afterwards (a `run:` job ran in a separate
    `python -m snakemake` that finished the job long after Snakemake was gone)."""
    work = copy_workflow(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    index = work / "results" / "tiny" / "analysis" / "run_index.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1", str(index.relative_to(work)),
         "--configfile", "experiments/tiny.yaml"], cwd=work, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    jobs: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not any(b"--target-jobs" in _cmdline(p) or b"write_text.py" in _cmdline(p)
                      for p in descendants(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no job started"
            time.sleep(0.02)
        jobs = descendants(proc.pid)
        proc.kill()
        proc.wait()
        killed_at = time.time()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in jobs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in jobs if alive(p)], "the job outlived the killed snakemake"
        time.sleep(2)
        assert not index.exists() or index.stat().st_mtime <= killed_at
    finally:
        for pid in jobs:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _store_steps(db: Path, run_dir: str) -> tuple[str, int] | None:
    """(status, loss steps) of the newest run tagged with `run_dir`, read with sqlite (a
    short timeout: a trainer may hold the write lock); None while that is not possible."""
    import sqlite3

    query = ("SELECT r.status, (SELECT count(*) FROM metrics m WHERE m.run_uuid = r.run_uuid "
             "AND m.key = 'loss') FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid WHERE "
             "t.key = 'adaptiveload.run_dir' AND t.value = ? ORDER BY r.start_time DESC")
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute(query, (run_dir,)).fetchone()
    except sqlite3.OperationalError:
        return None


def test_a_hand_run_killed_in_a_finished_run_folder_is_retrained_by_the_recovery(tiny_run):
    """`adaptiveload train --steps 40` by hand into a finished run folder of the pipeline,
    killed after it reopened the run and logged more steps: the folder's results are gone
    (the run is no longer what they describe), so the recovery command retrains it to the
    experiment's 6 steps, in a new FINISHED MLflow run, instead of "Nothing to be done"
    over a RUNNING run and stale tables. Last in this module: it retrains one run."""
    from adaptiveload.pipeline import Layout
    from adaptiveload.tracking.run import SUPERSEDED_TAG

    out = Layout("tiny")
    run_dir = out.run_dir("adaptiveload", 0, "eager")
    db = tiny_run / "results" / "mlflow.db"
    key = run_dir.removeprefix("results/")
    cmd = [sys.executable, "-m", "adaptiveload", "train", "--config", out.view("train"),
           "--policy", "adaptiveload", "--seed", "0", "--kernel", "eager",
           "--calibration", out.calibration,
           "--manifest", out.manifest, "--plan", out.plan("adaptiveload", 0),
           "--out", run_dir, "--steps", "40"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    log = tiny_run / "hand.log"
    with log.open("w") as err:
        hand = subprocess.Popen(cmd, cwd=tiny_run, env=dict(env, OMP_NUM_THREADS="1"),
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while (_store_steps(db, key) or ("", 0))[1] < 8:
            assert hand.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no steps past 6"
            time.sleep(0.1)
    finally:
        hand.kill()
        hand.wait()
    assert _store_steps(db, key)[0] == "RUNNING"
    profile = ["--profile", "workflow/profiles/default", "--configfile", "experiments/tiny.yaml"]
    assert _jobs(snakemake(tiny_run, "-n", *profile))["train"] == 1
    done = snakemake(tiny_run, *profile, "--cores", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    import pandas as pd
    from mlflow.tracking import MlflowClient

    assert sorted(pd.read_parquet(tiny_run / run_dir / "steps.parquet")["step"].unique()) == (
        list(range(6))
    )
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment_name("tiny"))
    runs = client.search_runs([exp.experiment_id], f"tags.`adaptiveload.run_dir` = '{key}'")
    (live,) = [r for r in runs if SUPERSEDED_TAG not in r.data.tags]
    assert live.info.status == "FINISHED"
    assert len(client.get_metric_history(live.info.run_id, "loss")) == 6
    assert all(r.info.status != "RUNNING" for r in runs)
    checked = json.loads((tiny_run / out.tracking_check).read_text())["runs"]
    assert live.info.run_id in {r["run_id"] for r in checked}
    assert _jobs(snakemake(tiny_run, "-n", *profile)) == {}
