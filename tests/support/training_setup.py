"""Small experiments for the training and tracking tests: micro model, explicit budgets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.io import write_json
from adaptiveload.planning.batches import starts
from adaptiveload.planning.plan import Plan
from adaptiveload.planning.policies import POLICIES
from adaptiveload.planning.sampler import PlanBuilder
from adaptiveload.step_table import SP_DEGREE


def write_experiment(
    tmp_path: Path, name: str = "t", model: dict | None = None, data: dict | None = None,
    **train
) -> Path:
    """An experiment YAML (micro Wan, 120 tiny-cpu samples, budgets given) under tmp_path;
    `model` adds fields to its model section, `data` to its data section, `train` to its
    train section."""
    cfg = {
        "name": name,
        "policies": list(POLICIES),
        "data": {"mixture": "tiny-cpu", "num_samples": 120, **(data or {})},
        "model": {"config": "wan2.1-micro", **(model or {})},
        "budgets": {"m_tok": 2048, "m_mem": 2048, "m_comp": 60000, "p": 1.4},
        "train": {"world_size": 3, "steps": 6, "warmup_steps": 1, "checkpoint_every": 2, **train},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli_env(tracking_uri: str | None = None, threads: int = 1) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MLFLOW_ENABLE_TELEMETRY="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def adaptiveload(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, **kw
) -> subprocess.CompletedProcess:
    """`adaptiveload ARGS` in a fresh interpreter (this one's environment unless `env`)."""
    return subprocess.run(
        [sys.executable, "-m", "adaptiveload", *args],
        env=env, cwd=cwd, capture_output=True, text=True, **kw,
    )


def notes(stderr: str) -> list[str]:
    """The `note:` lines of a command's stderr (what it says it did about a run's state)."""
    return [line for line in stderr.splitlines() if line.startswith("note:")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 over a sqlite file; stop() and start() again."""

    def __init__(self, db: Path, port: int | None = None, artifacts: Path | None = None):
        self.db, self.port = db, port or free_port()
        self.artifacts = artifacts or db.parent / "artifacts"
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        env = cli_env()
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no background job workers
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
             f"sqlite:///{self.db}", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--artifacts-destination", str(self.artifacts)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("mlflow server exited during start-up") from None
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("mlflow server did not answer /health in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the session this test started
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


@dataclass(frozen=True)
class GroupedSteps(PlanBuilder):
    """A stand-in for a planner of sequence-parallel degrees: `base`'s plan, one micro-batch
    per rank of m ranks, with micro-batch j of step s run on the j-th group of
    `compositions[s % len(compositions)]` (m degrees in rank order, each group an aligned
    block, summing to this builder's `world_size`). Every sample still runs once, in the
    step it had; micro-batch j keeps its number in the step, so its noise is the one base
    rank j draws (an emulated world of the m base ranks is the reference)."""

    base: PlanBuilder | None = None
    compositions: tuple[tuple[int, ...], ...] = ((1, 1, 2), (2, 1, 1))

    def __call__(self, epoch: int) -> Plan:
        plan = self.base(epoch)
        table = plan.table.copy()
        degree = np.array(self.compositions)  # [compositions, m]
        first = np.stack([starts(c) for c in degree])
        k, j = table["step"].to_numpy() % len(degree), table["rank"].to_numpy()
        table["rank"], table[SP_DEGREE] = first[k, j], degree[k, j]
        digest = f"{plan.summary['plan_digest']}-sp{self.compositions}"
        return Plan(table, dict(plan.summary, world_size=self.world_size, plan_digest=digest))


# a micro-model calibration whose pretend device holds tiny-cpu's longest clip (3,740
# tokens: 12.3 MB by this cost) on two ranks only: adaptiveload-sp then plans groups of 2
SP_COST = CostModel(c0=0.01, a=1e-5, b=1e-9, m_static=1e6, m_tok=3e3, m_seq=5e4)


def sp_calibration(tmp_path: Path) -> Path:
    """A calibration file (`SP_COST`, a 10 MB device) under tmp_path."""
    path = tmp_path / "sp_calibration.json"
    write_json(path, Calibration("wan2.1-micro", "cpu", "model", SP_COST, p=1.4, m_mem=1e4,
                                 m_comp=1e6, capacity_bytes=10e6).to_dict())
    return path
