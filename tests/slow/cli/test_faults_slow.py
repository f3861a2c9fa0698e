"""Faults never end in a false success: real processes stopped by real signals, real full and
read-only filesystems (tmpfs mounts, skipped where mounting is not permitted), a real sqlite
MLflow store. Each test backs one row of the fault table in docs/robustness.md."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
from fault_setup import (
    fill,
    immutable,
    limited_writer,
    read_only,
    small_disk,
    wait_for,
)
from mlflow.tracking import MlflowClient
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, write_experiment

from adaptiveload.analysis.record import KIND_TAG, log_analysis
from adaptiveload.tracking.run import SUPERSEDED_TAG, RunTracker
from adaptiveload.tracking.store import experiment_id, init_store, log_artifact, run_artifact_dir


def _train_cmd(exp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "adaptiveload", "train", "--config", str(exp), "--policy",
            "adaptiveload", "--seed", "0", "--out", str(out), *extra]


def _runs(uri: str, experiment: str = "t") -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# a line of MLflow's own logging at warning level or above ("2026/01/31 12:00:00 ERROR
# mlflow.store.db.utils: ..."); its INFO lines of system metrics are part of every run
_MLFLOW_LOG = re.compile(
    r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (?:ERROR|WARNING|CRITICAL) mlflow", re.M
)


def _one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """The command failed with exit 2 and exactly one `error:` line holding `words`, with no
    traceback and none of MLflow's log lines around it."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not _MLFLOW_LOG.search(done.stderr), done.stderr[-3000:]
    (line,) = _errors(done.stderr)
    for word in words:
        assert word in line, line
    return line


def test_trainer_sent_two_sigterms_ends_its_mlflow_run_failed(tmp_path):
    """What a killed Snakemake's trainer receives: SIGTERMs tens of milliseconds apart (two
    were seen; here one every 30 ms until it is gone). The run ends FAILED, not RUNNING."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = write_experiment(tmp_path, steps=10000, warmup_steps=1, checkpoint_every=1)
    out = tmp_path / "run"
    env = dict(cli_env(uri), ADAPTIVELOAD_DIE_WITH_PARENT="1")  # as the pipeline starts it
    proc = subprocess.Popen(_train_cmd(exp, out), env=env, cwd=ROOT, stderr=subprocess.PIPE,
                            text=True)
    wait_for(lambda: (out / "checkpoints" / "ckpt-00000001.pt").exists(), proc)
    deadline = time.monotonic() + 5  # SIGTERMs 30 ms apart, as long as it takes to end
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.03)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert "Traceback" not in proc.stderr.read()
    (run,) = _runs(uri)
    assert run.info.status == "FAILED"


def test_a_second_trainer_of_a_run_folder_is_refused_in_one_line(tmp_path):
    """A hand-started `train` with the pipeline's policy and seed lands in the live run's
    folder: it is refused before it reads the checkpoint or touches the MLflow run."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = write_experiment(tmp_path, steps=10000, warmup_steps=1, checkpoint_every=1)
    out = tmp_path / "run"
    first = subprocess.Popen(_train_cmd(exp, out), env=cli_env(uri), cwd=ROOT,
                             stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: (out / "checkpoints" / "ckpt-00000001.pt").exists(), first)
        second = subprocess.run(_train_cmd(exp, out), env=cli_env(uri), cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        _one_line_error(second, str(out), "another `adaptiveload train`", f"pid {first.pid}")
        assert first.poll() is None  # the live run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    (run,) = _runs(uri)  # the second one opened no run
    steps = [m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "loss")]
    assert len(steps) == len(set(steps))  # and logged no step
    assert not (out / ".train.lock").exists()


# -- resume: MLflow and the per-step table agree --------------------------------------------
def _newest_checkpoint(out: Path) -> int:
    names = sorted((out / "checkpoints").glob("ckpt-*.pt"))
    return int(names[-1].stem.split("-")[1]) if names else 0


def _store_last_step(uri: str) -> int | None:
    """The store's last logged step of `loss` (-1 before any); None while a writer holds the
    database's lock, as a trainer frozen in the middle of a write does. Read with sqlite
    itself and a short timeout: MLflow's client would wait 20 s on that lock, then raise."""
    path = uri.removeprefix("sqlite:///")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)) as db:
            (step,) = db.execute("SELECT max(step) FROM metrics WHERE key = 'loss'").fetchone()
    except sqlite3.OperationalError:
        return None
    return -1 if step is None else int(step)


def _store_ahead_of_checkpoint(uri: str, out: Path) -> bool:
    """MLflow holds a step that the newest checkpoint (of at least step 1) does not."""
    last = _store_last_step(uri)
    return last is not None and last >= max(_newest_checkpoint(out), 1)


def test_a_resumed_run_logs_to_mlflow_what_its_table_holds(tmp_path):
    """Killed after logging steps past its last checkpoint, the rerun measures those steps
    again: MLflow then holds every step once, with the table's values."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = write_experiment(tmp_path, steps=14, warmup_steps=1, checkpoint_every=4)
    out = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(exp, out), env=cli_env(uri), cwd=ROOT,
                            stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        while True:  # freeze it the moment the store is ahead of the checkpoint, then kill
            wait_for(lambda: _store_ahead_of_checkpoint(uri, out), proc)
            proc.send_signal(signal.SIGSTOP)
            # still ahead now that it cannot write, of a checkpoint to resume from
            if _store_ahead_of_checkpoint(uri, out) and _newest_checkpoint(out) > 0:
                break
            proc.send_signal(signal.SIGCONT)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    resumed_from = _newest_checkpoint(out)

    again = adaptiveload(*_train_cmd(exp, out)[3:], env=cli_env(uri), cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"holds steps from {resumed_from} on" in again.stderr, again.stderr[-3000:]
    table = pd.read_parquet(out / "steps.parquet")
    runs = {r.info.run_id: r for r in _runs(uri)}
    (live,) = [r for r in runs.values() if SUPERSEDED_TAG not in r.data.tags]
    (killed,) = [r for r in runs.values() if SUPERSEDED_TAG in r.data.tags]
    assert killed.data.tags[SUPERSEDED_TAG] == live.info.run_id
    assert killed.info.status == "KILLED" and live.info.status == "FINISHED"
    client = MlflowClient(uri)
    for key in ("step_time_s", "loss", "rank1/compute_s"):
        logged = sorted((m.step, m.value) for m in client.get_metric_history(live.info.run_id, key))
        assert [s for s, _ in logged] == list(range(14)), key  # every step once
        per_step = table.groupby("step")
        expected = {
            "step_time_s": per_step["step_time_s"].first(),
            "loss": (table["loss"] * table["samples"]).groupby(table["step"]).sum()
            / per_step["samples"].sum(),
            "rank1/compute_s": table[table["rank"] == 1].set_index("step")["compute_s"],
        }[key]
        assert [v for _, v in logged] == pytest.approx(list(expected), rel=1e-12), key


# -- full and read-only disks ---------------------------------------------------------------
def test_checkpoint_write_on_a_full_disk_is_one_line_and_a_failed_run(tmp_path):
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = write_experiment(tmp_path, steps=6, warmup_steps=1, checkpoint_every=2)
    with small_disk(tmp_path / "disk", 256) as disk:  # a checkpoint is ~400 KiB
        out = disk / "run"
        done = subprocess.run(_train_cmd(exp, out), env=cli_env(uri), cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        line = _one_line_error(done, "ckpt-00000002.pt", "No space left on device", "df -h")
        assert "free space" in line
        assert not list(out.rglob("*.tmp"))  # the partial write is gone
    (run,) = _runs(uri)
    assert run.info.status == "FAILED"


def test_training_on_a_read_only_store_is_one_line_before_training(tmp_path):
    exp = write_experiment(tmp_path, steps=2, warmup_steps=1)
    with small_disk(tmp_path / "disk", 4096) as disk:
        uri = f"sqlite:///{disk / 'mlflow.db'}"
        made = adaptiveload("tracking", "init", "--uri", uri, env=cli_env(), cwd=tmp_path)
        assert made.returncode == 0, made.stderr[-2000:]
        read_only(disk)  # (from another process: this one holds no open file there)
        out = tmp_path / "run"
        done = subprocess.run(_train_cmd(exp, out), env=cli_env(uri), cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        _one_line_error(done, "read-only", str(disk / "mlflow.db"))
        assert not out.exists()  # nothing trained, nothing written


@pytest.mark.parametrize("command", ["train", "record"])
def test_a_store_that_refuses_writes_is_one_line_without_mlflow_logs(tmp_path, command):
    """An existing store the user may not write (`chattr +i`): `train` and `analyze record`
    fail in one line, not after MLflow's logs of the same error with their tracebacks."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with immutable(tmp_path / "mlflow.db"):
        if command == "train":
            exp = write_experiment(tmp_path, steps=2, warmup_steps=1)
            done = subprocess.run(_train_cmd(exp, tmp_path / "run"), env=cli_env(uri), cwd=ROOT,
                                  capture_output=True, text=True, timeout=600)
        else:
            done = _record(*_analysis_inputs(tmp_path), tmp_path / "a.json", uri)
        _one_line_error(done, "read-only", str(tmp_path / "mlflow.db"))
    assert not (tmp_path / "run").exists() and not (tmp_path / "a.json").exists()


def _analysis_inputs(folder: Path) -> tuple[Path, Path]:
    paper = folder / "paper_table.csv"
    pd.DataFrame({"setup": ["train"], "kernel": ["eager"], "policy": ["adaptiveload"],
                  "samples_per_s": [10.0]}).to_csv(paper, index=False)
    stats = folder / "stats.csv"
    pd.DataFrame({"metric": ["samples_per_s"], "p_value": [0.5]}).to_csv(stats, index=False)
    return paper, stats


def _record(paper: Path, stats: Path, out: Path, uri: str, *artifacts: Path):
    extra = [a for path in artifacts for a in ("--artifact", str(path))]
    return adaptiveload("analyze", "record", "--experiment", "e", "--paper-table", str(paper),
                        "--stats", str(stats), "-o", str(out), *extra, env=cli_env(uri),
                        cwd=out.parent, timeout=300)


def test_record_on_a_store_that_is_not_a_database_is_one_line(tmp_path):
    paper, stats = _analysis_inputs(tmp_path)
    (tmp_path / "mlflow.db").write_bytes(os.urandom(4096))
    done = _record(paper, stats, tmp_path / "a.json", f"sqlite:///{tmp_path / 'mlflow.db'}")
    _one_line_error(done, "not an MLflow store", "adaptiveload tracking init")
    assert not (tmp_path / "a.json").exists()


def test_analysis_run_is_replaced_only_once_the_new_one_is_complete(tmp_path):
    """A figure the store cannot take (RLIMIT_FSIZE: the kernel refuses the write as a full
    disk does): the previous analysis run stays, FINISHED; the new one is gone, files too."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    paper, stats = _analysis_inputs(tmp_path)
    first = log_analysis("e", paper, stats, [], uri=uri)
    figure = tmp_path / "big.png"
    figure.write_bytes(b"\x89PNG" + os.urandom(3 << 20))
    script = textwrap.dedent(f"""
        from pathlib import Path
        from adaptiveload.analysis.record import log_analysis
        log_analysis("e", Path({str(paper)!r}), Path({str(stats)!r}), [Path({str(figure)!r})],
                     uri={uri!r})
    """)
    done = subprocess.run([sys.executable, "-c", script], env=cli_env(), capture_output=True,
                          text=True, timeout=300, preexec_fn=limited_writer(2 << 20))
    assert done.returncode != 0 and "cannot write it" in done.stderr
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("e")
    analysis = f"tags.`{KIND_TAG}` = 'analysis'"
    (kept,) = client.search_runs([exp.experiment_id], filter_string=analysis)
    assert kept.info.run_id == first and kept.info.status == "FINISHED"
    everything = client.search_runs([exp.experiment_id], analysis, run_view_type=3)  # ALL
    assert [r.info.status for r in everything if r.info.run_id != first] == ["FAILED"]
    root = run_artifact_dir(uri, kept.info.artifact_uri).parent
    assert not list(root.rglob("*.tmp")) and not list(root.rglob("big.png"))


def test_a_stopped_record_deletes_its_new_run_and_keeps_the_previous_analysis(tmp_path):
    """SIGTERM to the pipeline's job running `analyze record` while it attaches files (a
    stopped pipeline; SIGHUP alike, tests/cli/test_faults.py): the job shell gives it the
    grace to delete the new analysis run with its files, exit 143; none is left RUNNING
    beside the previous one, which stays the experiment's analysis."""
    signum = signal.SIGTERM
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    paper, stats = _analysis_inputs(tmp_path)
    first = log_analysis("e", paper, stats, [], uri=uri)
    files = []
    for i in range(400):  # seconds of copying: time to stop it half-way
        files += ["--artifact", str(tmp_path / f"t{i}.csv")]
        (tmp_path / f"t{i}.csv").write_text("a\n1\n")
    record = shlex.join([sys.executable, "-m", "adaptiveload", "analyze", "record",
                         "--experiment", "e", "--paper-table", str(paper), "--stats", str(stats),
                         "-o", str(tmp_path / "b.json"), *files])
    shell = str(Path(sys.executable).parent / "adaptiveload-job")
    proc = subprocess.Popen([shell, "-c", f"set -euo pipefail; {record}"], env=cli_env(uri),
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    root = tmp_path / "mlartifacts" / "e"
    wait_for(lambda: len(list(root.glob("*/artifacts/tables/t*.csv"))) > 10, proc)
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == 128 + signum
    assert "Traceback" not in proc.stderr.read()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("e")
    (kept,) = client.search_runs([exp.experiment_id])
    assert kept.info.run_id == first and kept.info.status == "FINISHED"
    everything = client.search_runs([exp.experiment_id], run_view_type=3)  # deleted too
    assert sorted(r.info.status for r in everything) == ["FAILED", "FINISHED"]
    assert [p.name for p in root.iterdir()] == [first]  # the new run's files are gone
    assert not (tmp_path / "b.json").exists()


def test_the_next_record_removes_a_killed_records_run_with_its_folder(tmp_path):
    """`analyze record` killed by SIGKILL (no clean-up possible) leaves its run RUNNING with
    part of its files: the next record deletes that run and its folder too (it deleted the
    run only before, leaving the folder), and keeps nothing but its own complete run."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    paper, stats = _analysis_inputs(tmp_path)
    client = MlflowClient(uri)
    exp_id = experiment_id(client, uri, "e")
    killed = client.create_run(exp_id, run_name="analysis", tags={KIND_TAG: "analysis"})
    log_artifact(client, uri, killed.info.run_id, paper, "tables")
    folder = run_artifact_dir(uri, killed.info.artifact_uri).parent
    assert folder.is_dir()
    new = log_analysis("e", paper, stats, [], uri=uri)
    assert not folder.exists()
    (kept,) = client.search_runs([exp_id])
    assert kept.info.run_id == new and kept.info.status == "FINISHED"
    assert [p.name for p in folder.parent.iterdir()] == [new]


def test_record_on_a_full_disk_is_one_line_and_keeps_the_previous_analysis(tmp_path):
    paper, stats = _analysis_inputs(tmp_path)
    figure = tmp_path / "figure.png"
    figure.write_bytes(b"\x89PNG" + os.urandom(1 << 20))
    with small_disk(tmp_path / "disk", 8192) as disk:
        uri = init_store(f"sqlite:///{disk / 'mlflow.db'}")
        first = _record(paper, stats, tmp_path / "a.json", uri)
        assert first.returncode == 0, first.stderr[-3000:]
        fill(disk, leave_bytes=256 << 10)  # room for the run's rows, not for the figure
        done = _record(paper, stats, tmp_path / "b.json", uri, figure)
        _one_line_error(done, "No space left on device")
        assert not (tmp_path / "b.json").exists()
        (disk / "filler").unlink()
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("e")
        runs = client.search_runs([exp.experiment_id])
        assert [r.info.status for r in runs] == ["FINISHED"]
        assert not list((disk / "mlartifacts").rglob("*.tmp"))


def test_truncated_per_step_table_in_aggregate_is_one_line(tmp_path):
    columns = ("step", "rank", "compute_s", "samples", "tokens", "step_time_s")
    table = pd.DataFrame({c: [0, 1] if c == "step" else [1, 1] for c in columns})
    steps = tmp_path / "steps.parquet"
    table.to_parquet(steps)
    steps.write_bytes(steps.read_bytes()[: steps.stat().st_size // 2])  # a full disk's cut
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({
        "experiment": "t", "policy": "p", "seed": 0, "kernel": "eager", "world_size": 1,
        "launch_mode": "emulated", "device": "cpu", "source": "measured", "warmup_steps": 0,
    }))
    index = tmp_path / "run_index.json"
    index.write_text(json.dumps([{"setup": "train", "summary": str(summary), "steps": str(steps)}]))
    done = adaptiveload("analyze", "aggregate", "--index", str(index), "--runs-out",
                        str(tmp_path / "r.parquet"), "--steps-out", str(tmp_path / "s.parquet"),
                        env=cli_env(), cwd=tmp_path, timeout=300)
    _one_line_error(done, str(steps), "cannot be read", "delete it and run the pipeline again")
    assert not (tmp_path / "r.parquet").exists()


# -- the end-of-training check --------------------------------------------------------------
def test_a_store_that_filled_up_during_training_fails_the_check_until_it_is_synced(tmp_path):
    """The store's disk fills during a run: the run's records go to its spool and the run
    stays RUNNING. `tracking check` (the pipeline's end-of-training job) then fails in one
    line naming the spool; once there is space it uploads them and finds the run FINISHED."""
    run_dir = tmp_path / "run"
    with small_disk(tmp_path / "disk", 8192) as disk:
        uri = init_store(f"sqlite:///{disk / 'mlflow.db'}")
        tracker = RunTracker.start(uri, "e", "r", {}, {}, run_dir / "tracking.spool.jsonl",
                                   run_dir=run_dir)
        tracker.retry_s = 0.0
        tracker.log_step(0, {"loss": 1.0})
        fill(disk)
        with pytest.warns(UserWarning):
            for step in range(1, 200):  # until sqlite needs a page it cannot get
                tracker.log_step(step, {"loss": 1.0, **{f"m{i}": float(i) for i in range(50)}})
            assert not tracker.finish()
        assert (run_dir / "tracking.spool.jsonl").exists()
        check = ["tracking", "check", "--experiment", "e", str(run_dir), "-o",
                 str(tmp_path / "check.json")]
        failed = adaptiveload(*check, env=cli_env(uri), cwd=tmp_path, timeout=300)
        _one_line_error(failed, "tracking.spool.jsonl", "full", "run the pipeline again")
        assert not (tmp_path / "check.json").exists()
        (disk / "filler").unlink()
        done = adaptiveload(*check, env=cli_env(uri), cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (run,) = _runs(uri, "e")
        assert run.info.status == "FINISHED"
        steps = [m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "loss")]
        assert sorted(steps) == list(range(200))
        assert not (run_dir / "tracking.spool.jsonl").exists()


def test_the_check_refuses_a_run_left_running(tmp_path):
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_dir = tmp_path / "run"
    RunTracker.start(uri, "e", "r", {}, {}, run_dir / "tracking.spool.jsonl", run_dir=run_dir)
    done = adaptiveload("tracking", "check", "--experiment", "e", str(run_dir), "-o",
                        str(tmp_path / "c.json"), env=cli_env(uri), cwd=tmp_path, timeout=300)
    _one_line_error(done, str(run_dir), "is RUNNING", "delete its summary.json")


def test_a_copied_results_folder_passes_the_check_and_its_runs_are_still_found(tmp_path):
    """results/ (store, artifacts, run folders) copied elsewhere, the old one removed: the
    check run there, on the store beside it (the default results/mlflow.db), finds each
    folder's FINISHED run, and a new run of a folder there supersedes the copied one."""
    old = tmp_path / "old" / "results"
    uri = init_store(f"sqlite:///{old / 'mlflow.db'}")
    run_dir = old / "e" / "runs" / "a"
    tracker = RunTracker.start(uri, "e", "r", {}, {}, run_dir / "tracking.spool.jsonl",
                               run_dir=run_dir)
    tracker.log_step(0, {"loss": 1.0})
    assert tracker.finish()
    new = tmp_path / "new"
    shutil.copytree(old, new / "results")
    shutil.rmtree(old)
    check = adaptiveload("tracking", "check", "--experiment", "e", "results/e/runs/a", "-o",
                         str(tmp_path / "c.json"), env=cli_env(), cwd=new, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    (checked,) = json.loads((tmp_path / "c.json").read_text())["runs"]
    assert checked["run_id"] == tracker.run_id
    moved_uri = f"sqlite:///{new / 'results' / 'mlflow.db'}"
    again = RunTracker.start(moved_uri, "e", "r", {}, {}, new / "results" / "e" / "runs" / "a"
                             / "tracking.spool.jsonl", run_dir=new / "results/e/runs/a")
    runs = {r.info.run_id: r for r in _runs(moved_uri, "e")}
    assert runs[tracker.run_id].data.tags[SUPERSEDED_TAG] == again.run_id
