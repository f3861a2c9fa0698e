"""MLflow tracking: store set-up, batched logging, and nothing lost when the store goes away."""

from __future__ import annotations

import json
import shutil
import urllib.request
import warnings

import pytest
from mlflow.tracking import MlflowClient
from repo_paths import ROOT
from training_setup import MlflowServer, adaptiveload, cli_env, free_port, write_experiment

from adaptiveload.analysis.record import log_analysis
from adaptiveload.errors import UserError
from adaptiveload.tracking.run import RunTracker
from adaptiveload.tracking.spool import Spool
from adaptiveload.tracking.store import check_reachable, init_store


def _count_calls(tracker: RunTracker) -> list[int]:
    """Record the metric count of each real log_batch call the tracker makes."""
    calls: list[int] = []
    real = tracker.client.log_batch

    def counting(run_id, metrics=(), **kw):
        calls.append(len(metrics))
        return real(run_id, metrics=metrics, **kw)

    tracker.client.log_batch = counting
    return calls


def _steps(uri: str, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_init_creates_sqlite_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'sub' / 'mlflow.db'}"
    result = adaptiveload("tracking", "init", "--uri", uri, env=cli_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "sub" / "mlflow.db").stat().st_size > 0
    assert init_store(uri) == uri  # a second init is harmless


def test_unreachable_store_is_a_user_error_before_training(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(UserError, match="not reachable"):
        check_reachable(uri)
    exp = write_experiment(tmp_path)
    out = tmp_path / "run"
    result = adaptiveload(
        "train", "--config", str(exp), "--policy", "adaptiveload", "--seed", "0",
        "--out", str(out), env=cli_env(uri), cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 2
    assert "not reachable" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()  # nothing trained, nothing written


def test_one_log_batch_per_step_and_chunks_of_1000(tmp_path):
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = RunTracker.start(uri, "e", "r", {"a": {"b": 1}}, {"t": "x"}, tmp_path / "s.jsonl")
    calls = _count_calls(tracker)
    for step in range(3):
        tracker.log_step(step, {"loss": 1.0 / (step + 1), "step_time_s": 0.5, "rank0/x": 1.0})
    assert calls == [3, 3, 3]
    wide = {"loss": 0.1, **{f"rank{r}/compute_s": float(r) for r in range(1500)}}
    tracker.log_step(3, wide)
    assert calls[3:] == [1000, 501]
    assert tracker.finish()
    assert _steps(uri, tracker.run_id) == [0, 1, 2, 3]
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.params["a.b"] == "1"


def test_store_lost_mid_run_spools_then_uploads_each_step_once(tmp_path):
    server = MlflowServer(tmp_path / "server.db")
    server.start()
    try:
        spool = tmp_path / "run" / "tracking.spool.jsonl"
        tracker = RunTracker.start(server.uri, "e", "r", {}, {}, spool)
        tracker.retry_s = 0.0
        for step in range(2):
            tracker.log_step(step, {"loss": float(step)})
        server.stop()
        with pytest.warns(UserWarning, match="unreachable"):
            for step in range(2, 4):
                tracker.log_step(step, {"loss": float(step)})  # training goes on
        assert [r["step"] for r in Spool.load(spool).records] == [2, 3]

        server.start()
        tracker.log_step(4, {"loss": 4.0})  # the backlog goes up first, in order
        assert not spool.exists()
        assert _steps(server.uri, tracker.run_id) == [0, 1, 2, 3, 4]

        server.stop()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracker.log_step(5, {"loss": 5.0})
            assert not tracker.finish()  # the end of the run finds the store down
        kept = tmp_path / "copy.jsonl"
        shutil.copy(spool, kept)

        server.start()
        env = cli_env()
        result = adaptiveload("sync", str(spool), env=env, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert not spool.exists()
        result = adaptiveload("sync", str(kept), env=env, cwd=ROOT)  # again: idempotent
        assert result.returncode == 0, result.stderr
        assert _steps(server.uri, tracker.run_id) == [0, 1, 2, 3, 4, 5]
        assert MlflowClient(server.uri).get_run(tracker.run_id).info.status == "FINISHED"
    finally:
        server.stop()


def test_stale_spool_of_another_run_blocks_a_new_run(tmp_path):
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    spool = tmp_path / "s.jsonl"
    Spool(spool, "0123abc", uri, [{"kind": "step", "step": 0, "ts": 0, "metrics": {}}]).rewrite()
    with pytest.raises(UserError, match="adaptiveload sync"):
        RunTracker.start(uri, "e", "r", {}, {}, spool)
    assert MlflowClient(uri).get_experiment_by_name("e") is None  # nothing created


_CREATE = """
import sys, time
from pathlib import Path
from adaptiveload.tracking.store import check_reachable
import mlflow.store.tracking.sqlalchemy_store  # the slow imports, before the start line
uri, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():
    time.sleep(0.001)
check_reachable(uri)
"""


def test_two_processes_creating_a_fresh_store_at_once(tmp_path):
    """What two trainings started together on a fresh sqlite store do first: without the
    creation lock, one fails in MLflow's migrations (`duplicate column name`)."""
    import subprocess
    import sys
    import time

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    command = [sys.executable, "-c", _CREATE, uri]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [
        subprocess.Popen([*command, str(r), str(go)], env=cli_env(), cwd=ROOT, **pipes)
        for r in ready
    ]
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both start creating within a millisecond
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for code, err in results:
        assert code == 0, err[-1500:]
    assert MlflowClient(uri).search_experiments()  # one store, created once, answering


def test_sync_is_idempotent(tmp_path):
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    spool = tmp_path / "run" / "tracking.spool.jsonl"
    tracker = RunTracker.start(uri, "e", "r", {}, {}, spool)
    pending = [{"kind": "step", "step": s, "ts": 0, "metrics": {"loss": float(s)}} for s in (0, 1)]
    Spool(spool, tracker.run_id, uri, pending).rewrite()  # what an outage leaves behind
    env = cli_env()
    first = adaptiveload("sync", str(spool), env=env, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    assert "2 record(s) uploaded" in first.stderr and not spool.exists()
    again = adaptiveload("sync", str(spool), env=env, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert "nothing to sync" in again.stderr and "Traceback" not in again.stderr
    assert _steps(uri, tracker.run_id) == [0, 1]


def _rest(server: MlflowServer, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.uri}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        raw = resp.read()
    return json.loads(raw) if path.startswith("/api/") else {"bytes": raw}


def _synthetic_experiment(root):
    """A measured setup (2 seeds) and a simulated one (2 seeds, with warm-up), aggregated, and
    its statistics: what `analyze record` reads."""
    from analysis_synth import write_run

    from adaptiveload.analysis.aggregate import aggregate, parse_index
    from adaptiveload.analysis.stats import compare

    index = []
    for seed in (0, 1):
        for policy, speedup in (("equal-token", 1.0), ("adaptiveload", 1.3)):
            index.append(write_run(root / "runs", policy, seed, speedup=speedup, steps=8))
            index.append(write_run(root / "runs", policy, seed, setup="sim/h200", kernel="none",
                                   speedup=speedup, source="model", device="H200", steps=6))
    agg = aggregate(parse_index(index))
    stats = compare(agg.runs, seed=0)
    stats.to_csv(root / "stats.csv", index=False)
    return agg, stats


def test_moved_results_folder_is_served_with_runs_params_and_artifacts(tmp_path):
    """Runs logged to the sqlite store, the folder moved, then a real `mlflow server
    --artifacts-destination <folder>/mlartifacts` serves everything over REST: the experiment
    `adaptiveload/moved` in model-training kind with its description, params and tags of the
    training and analysis runs, a handful of headline metrics with their intervals, every
    table; the simulations as `source: model` runs of their own experiment, warm-up steps
    marked per step; the UI path that opens the comparison."""
    from adaptiveload.analysis.landing import speedups
    from adaptiveload.analysis.record import log_simulations
    from adaptiveload.tracking.store import experiment_name

    results = tmp_path / "here" / "results"
    uri = init_store(f"sqlite:///{results / 'mlflow.db'}")
    tracker = RunTracker.start(
        uri, experiment_name("moved"), "adaptiveload-s0", {"run": {"policy": "adaptiveload"}},
        {"policy": "adaptiveload"}, results / "s.jsonl", description="a moved experiment",
    )
    tracker.log_step(0, {"loss": 1.0, "imbalance_rate": 0.5})
    (results / "summary.json").write_text('{"imbalance_rate": 0.5}')
    tracker.log_artifact(results / "summary.json")
    assert tracker.finish()
    agg, stats = _synthetic_experiment(results)
    html = results / "paper_table.html"
    html.write_text("<h3>Δ samples/s × 1.5</h3>", encoding="utf-8")
    analysis, ui = log_analysis("moved", agg.runs, results / "stats.csv", [html],
                                config={"name": "moved", "description": "a moved experiment"},
                                uri=uri)
    sims = log_simulations("moved", agg.runs, agg.steps, uri=uri)
    assert len(sims) == 4  # 2 policies x 2 seeds of sim/h200
    assert "file:" not in json.dumps([str(p) for p in results.rglob("*")])
    moved = tmp_path / "elsewhere" / "results"
    moved.parent.mkdir()
    shutil.move(results, moved)

    server = MlflowServer(moved / "mlflow.db", artifacts=moved / "mlartifacts")
    server.start()
    try:
        exp = _rest(server, "/api/2.0/mlflow/experiments/get-by-name?"
                            "experiment_name=adaptiveload/moved")["experiment"]
        tags = {t["key"]: t["value"] for t in exp["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"
        assert tags["mlflow.note.content"] == "a moved experiment"
        assert exp["artifact_location"] == "mlflow-artifacts:/adaptiveload/moved"
        assert ui == (f"#/experiments/{exp['experiment_id']}/runs?"
                      "workflowType=machine_learning&compareRunsMode=CHART")
        found = _rest(server, "/api/2.0/mlflow/runs/search",
                      {"experiment_ids": [exp["experiment_id"]]})
        runs = {r["info"]["run_name"]: r for r in found["runs"]}
        assert set(runs) == {"adaptiveload-s0", "analysis"}
        for run in runs.values():
            assert run["data"]["params"] and run["data"]["tags"]
        # a handful of metrics, of the measured setup, with the speedup's interval
        metrics = {m["key"]: m["value"] for m in runs["analysis"]["data"]["metrics"]}
        assert set(metrics) == {
            *(f"{p}/{k}" for p in ("equal-token", "adaptiveload")
              for k in ("samples_per_s", "imbalance_rate")),
            *(f"adaptiveload/{k}" for k in ("speedup", "speedup_ci_low", "speedup_ci_high")),
        }
        row = speedups(stats).set_index(["setup", "policy"]).loc[("train", "adaptiveload")]
        assert metrics["adaptiveload/speedup"] == pytest.approx(row["estimate"])
        assert metrics["adaptiveload/speedup_ci_low"] < metrics["adaptiveload/speedup"]
        assert metrics["adaptiveload/speedup"] < metrics["adaptiveload/speedup_ci_high"]
        got = _rest(server, f"/get-artifact?path=tables/stats.csv&run_uuid={analysis}")
        assert got["bytes"] == (moved / "stats.csv").read_bytes()
        got = _rest(server, f"/get-artifact?path=tables/paper_table.html&run_uuid={analysis}")
        assert got["bytes"].decode("utf-8") == "<h3>Δ samples/s × 1.5</h3>"
        listed = _rest(server, f"/api/2.0/mlflow/artifacts/list?run_id={analysis}&path=tables")
        assert {f["path"] for f in listed["files"]} == {"tables/paper_table.html",
                                                       "tables/stats.csv"}
        train_id = runs["adaptiveload-s0"]["info"]["run_id"]
        got = _rest(server, f"/get-artifact?path=summary.json&run_uuid={train_id}")
        assert got["bytes"] == b'{"imbalance_rate": 0.5}'

        sim_exp = _rest(server, "/api/2.0/mlflow/experiments/get-by-name?"
                                "experiment_name=adaptiveload/moved/simulations")["experiment"]
        sim_tags = {t["key"]: t["value"] for t in sim_exp["tags"]}
        assert sim_tags["mlflow.experimentKind"] == "custom_model_development"
        found = _rest(server, "/api/2.0/mlflow/runs/search",
                      {"experiment_ids": [sim_exp["experiment_id"]]})["runs"]
        assert sorted(r["info"]["run_id"] for r in found) == sorted(sims)
        for run in found:
            tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
            assert tags["source"] == "model" and tags["setup"] == "sim/h200"
            assert run["info"]["status"] == "FINISHED"
        warmup = _rest(server, "/api/2.0/mlflow/metrics/get-history?"
                               f"run_id={sims[0]}&metric_key=warmup")["metrics"]
        assert {m["step"]: m["value"] for m in warmup} == {s: float(s < 2) for s in range(6)}
        history = _rest(server, "/api/2.0/mlflow/metrics/get-history?"
                                f"run_id={sims[0]}&metric_key=imbalance_rate")["metrics"]
        assert len(history) == 6  # every step, the warm-up too
    finally:
        server.stop()
