"""Look at an experiment in the real MLflow UI: headless Chromium screenshots of its runs table,
a training run's charts and the analysis run's artifacts.

    python tests/bench/mlflow_screenshots.py [--results results] [--experiment default] \
        [--out results/screenshots]

Starts `mlflow server` on 127.0.0.1 over `<results>/mlflow.db` with
`--artifacts-destination <results>/mlartifacts` (how the store is meant to be served, wherever
the folder lies), finds the experiment and its runs over REST, and has Chromium
(`apt-get install chromium`) render the UI pages to PNGs. A documented manual check, not a test:
open the PNGs and look (experiment description, runs with params and short metric keys, the
charts, tables/stats.csv among the artifacts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from adaptiveload.tracking.store import experiment_name, ui_path

WORKFLOW = "machine_learning"  # the MLflow 3 UI's "Model training" view


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rest(base: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def screenshot(chromium: str, url: str, png: Path, wait_ms: int, height: int = 1000) -> None:
    # without all compositor stages the metric charts stay spinners in a headless screenshot
    subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--window-size=1600,{height}", "--run-all-compositor-stages-before-draw",
         f"--virtual-time-budget={wait_ms}", f"--screenshot={png}", url],
        check=True, capture_output=True, timeout=180,
    )
    print(f"{png}: {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--experiment", default="default")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--wait-ms", type=int, default=120000, help="time the UI gets to render")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium not found: apt-get install chromium")
    results = args.results.resolve()
    out = (args.out or results / "screenshots").resolve()
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
         f"sqlite:///{results / 'mlflow.db'}", "--artifacts-destination",
         str(results / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        exp = rest(base, f"/api/2.0/mlflow/experiments/get-by-name?experiment_name="
                         f"{experiment_name(args.experiment)}")["experiment"]
        runs = rest(base, "/api/2.0/mlflow/runs/search",
                    {"experiment_ids": [exp["experiment_id"]]})["runs"]
        tags = lambda r: {t["key"]: t["value"] for t in r["data"].get("tags", [])}  # noqa: E731
        train = next(r for r in runs if tags(r).get("adaptiveload.kind") != "analysis")
        analysis = next(r for r in runs if tags(r).get("adaptiveload.kind") == "analysis")
        page = f"{base}/#/experiments/{exp['experiment_id']}"
        # a fresh browser profile opens MLflow 3's GenAI view; ask for the model-training one
        view = f"?workflowType={WORKFLOW}"
        screenshot(chromium, f"{page}/runs{view}", out / "runs_table.png", args.wait_ms)
        screenshot(chromium, f"{base}/{ui_path(exp['experiment_id'])}", out / "runs_charts.png",
                   args.wait_ms)
        screenshot(chromium, f"{page}/runs/{train['info']['run_id']}/model-metrics{view}",
                   out / "train_run_charts.png", args.wait_ms, height=2400)
        screenshot(chromium, f"{page}/runs/{analysis['info']['run_id']}/artifacts{view}",
                   out / "analysis_artifacts.png", args.wait_ms)
        screenshot(chromium, f"{page}/runs/{analysis['info']['run_id']}{view}",
                   out / "analysis_overview.png", args.wait_ms)
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the session this script started
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
