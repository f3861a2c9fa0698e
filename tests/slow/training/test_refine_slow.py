"""The closed loop end to end: killed with SIGKILL and started again, a closed-loop run refits
from the checkpoint's rows exactly as before the kill and runs the plans its refits replay;
under torchrun with 2 gloo processes every process refits alike and runs one plan."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from repo_paths import ROOT
from training_setup import cli_env, free_port, write_experiment

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.io import write_json
from adaptiveload.planning.replan import Replanner, cost_digest
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.session import REFITS, Request, resolve

TORCHRUN = Path(sys.executable).parent / "torchrun"
# a prior far from this CPU: the first refit moves it and the plans change
PRIOR = Calibration("wan2.1-micro", "cpu", "model", CostModel(c0=0.1, a=1e-6, b=1e-10), p=1.4,
                    m_mem=2048, m_comp=60000, m_tok=2048)


def _setup(tmp_path: Path, world: int, **train) -> tuple[Path, Path]:
    cal = tmp_path / "prior.json"
    write_json(cal, PRIOR.to_dict())
    exp = write_experiment(tmp_path, world_size=world, data={"num_samples": 60}, **train)
    return exp, cal


def _replayed_cells(exp: Path, cal: Path, policy: str, world: int, out: Path,
                    offset: int, steps: int) -> pd.DataFrame:
    """(step, rank, samples, tokens) of the plans `out`'s refits.json replays, from run step
    `offset` on, for `steps` run steps: what the run must have executed."""
    req = Request(config=exp, policy=policy, seed=1, emulate_world_size=world, calibration=cal)
    run = resolve(req)
    replay = Replanner(prepare_data(run.exp, run.cfg, run.calibration).builder)
    for r in json.loads((out / REFITS).read_text()):
        replay.switch(r["epoch"], r["step"], Calibration.from_dict(r["calibration"]))
    parts, epoch, done = [], 0, offset
    while done < offset + steps:
        plan = replay(epoch).table
        cells = plan.groupby(["step", "rank"])["tokens"].agg(["size", "sum"]).reset_index()
        cells["step"] += done
        parts.append(cells)
        done += int(plan["step"].max()) + 1
        epoch += 1
    cells = pd.concat(parts, ignore_index=True)
    return cells[cells["step"] < offset + steps]


def test_sigkill_and_restart_refits_and_replans_as_before(tmp_path):
    steps, every, kill_after, world = 14, 4, 8, 3
    # read inline: what a kill leaves of background readers is test_train_resume.py's concern
    exp, cal = _setup(tmp_path, world, steps=steps, warmup_steps=1, checkpoint_every=every,
                      refine={"every": 2}, reader_workers=0)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "adaptiveload", "train", "--config", str(exp),
               "--policy", "adaptiveload-balanced", "--seed", "1", "--emulate-world-size",
               str(world), "--calibration", str(cal), "--out", str(out), "--no-track"]
    proc = subprocess.Popen(command, env=cli_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ckpt = out / "checkpoints" / f"ckpt-{kill_after:08d}.pt"
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    saved = torch.load(ckpt, weights_only=True)["closed_loop"]
    assert len(saved["switches"]) >= 3

    again = subprocess.run(command, env=cli_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    refits = json.loads((out / REFITS).read_text())
    # the refits before the kill, fitted again from the checkpoint's rows: the same bits
    before = [cost_digest(Calibration.from_dict(r["calibration"])) for r in refits]
    assert before[: len(saved["switches"])] == [s["cost_digest"] for s in saved["switches"]]
    # and the run executed exactly the plans its refits replay, across the restart
    table = pd.read_parquet(out / "steps.parquet")
    cells = _replayed_cells(exp, cal, "adaptiveload-balanced", world, out, 0, steps)
    np.testing.assert_array_equal(table[["step", "rank", "samples", "tokens"]].to_numpy(),
                                  cells.to_numpy())


def test_torchrun_processes_refit_alike_and_run_one_plan(tmp_path):
    exp, cal = _setup(tmp_path, 2, steps="epoch", epochs=2, warmup_steps=1,
                      checkpoint_every=1000, refine={"every": 2})
    out = tmp_path / "ddp"
    dist = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()),
         "-m", "adaptiveload", "train", "--config", str(exp), "--policy", "adaptiveload-packed",
         "--seed", "1", "--calibration", str(cal), "--no-track", "--out", str(out)],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert dist.returncode == 0, dist.stderr[-3000:]
    assert "refit after step" in dist.stderr
    table = pd.read_parquet(out / "steps.parquet")
    refits = json.loads((out / REFITS).read_text())
    assert len(refits) >= 3 and any(r["replanned"] for r in refits)
    # each process ran its own sampler; both ran the plans rank 0's refits replay (and every
    # refit passed check_ranks: a process that planned otherwise stops the run)
    cells = _replayed_cells(exp, cal, "adaptiveload-packed", 2, out, 1,
                            int(table["step"].max()))
    ran = table[table["step"] >= 1][["step", "rank", "samples", "tokens"]]
    np.testing.assert_array_equal(ran.to_numpy(), cells.to_numpy())
    assert table.loc[table["refit"].notna(), "speed_factor"].notna().all()
