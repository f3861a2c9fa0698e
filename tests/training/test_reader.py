"""The reader seam: the trainer loads through a Reader that hears of each rank's upcoming
micro-batches in that rank's plan order (also after a resume), and prefetching changes no
number of the run but the load times."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from training_setup import write_experiment

from adaptiveload import experiment
from adaptiveload.planning.sampler import PlanBatchSampler
from adaptiveload.training import checkpoint
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import prepare_data, run_identity
from adaptiveload.training.loop import Trainer
from adaptiveload.training.reader import PlanFeed, ProcessReader
from adaptiveload.training.settings import from_experiment

WORLD = 2


class Recording:
    """A reader that records what it is asked for, around the process pool one."""

    def __init__(self, inner):
        self.inner, self.prefetched, self.got = inner, [], []

    def prefetch(self, batches):
        self.prefetched += [(b.info.rank, b.info.epoch, b.info.step, list(b)) for b in batches]
        self.inner.prefetch(batches)

    def get(self, indices):
        self.got.append((indices.info.rank, indices.info.epoch, indices.info.step, list(indices)))
        return self.inner.get(indices)

    def cancel(self, batches):
        self.inner.cancel(batches)

    def close(self):
        self.inner.close()


def _trainer(tmp_path, steps, resume=None, workers=2):
    torch.set_num_threads(1)
    exp = experiment.load(
        write_experiment(
            tmp_path, steps=steps, warmup_steps=0, world_size=WORLD, reader_workers=workers
        )
    )
    cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=WORLD)
    data = prepare_data(exp, cfg)
    identity = run_identity(cfg, data)["identity"]
    state = checkpoint.find(tmp_path / "ckpt", identity).state if resume else None
    trainer = Trainer(
        cfg,
        data,
        tmp_path / "ckpt",
        Ranks.emulated(WORLD),
        resume=state,
        progress=False,
        identity=identity,
    )
    return trainer, data


def _recorded_run(tmp_path, steps, resume=False):
    trainer, data = _trainer(tmp_path, steps, resume)
    recording = Recording(ProcessReader(data.dataset, workers=2, clock=time.perf_counter))
    trainer.feed = PlanFeed(recording, data.builder, trainer.samplers, depth=2)
    try:
        trainer.run()
    finally:
        trainer.close()
    return recording, data


def _plan_order(data, rank):
    return [
        (b.info.rank, b.info.epoch, b.info.step, list(b))
        for b in PlanBatchSampler(data.builder, rank)
    ]


def test_fetch_order_is_each_ranks_plan_order_across_a_resume(tmp_path):
    first, data = _recorded_run(tmp_path, steps=2)  # stops after step 2's checkpoint
    resumed, _ = _recorded_run(tmp_path, steps=4, resume=True)
    for run, start in ((first, 0), (resumed, 2)):
        for rank in range(WORLD):
            plan = _plan_order(data, rank)
            fetched = [f for f in run.prefetched if f[0] == rank]
            got = [g for g in run.got if g[0] == rank]
            # announced in plan order from where the run starts, ahead of the loop
            assert fetched == plan[start : start + len(fetched)]
            assert got == plan[start : start + 2] and len(fetched) >= len(got)
            assert all(g in fetched for g in got)  # nothing was read unannounced


def test_prefetching_changes_no_number_of_the_run_but_load_times(tmp_path):
    tables = {}
    for workers in (0, 2):
        (tmp_path / str(workers)).mkdir()
        trainer, _ = _trainer(tmp_path / str(workers), steps=3, workers=workers)
        try:
            tables[workers] = trainer.run().steps
        finally:
            trainer.close()
    same = ["step", "rank", "samples", "tokens", "loss"]
    assert tables[0][same].equals(tables[2][same])
    inline = tables[0]  # read on the loop's thread: all of the load is exposed
    assert (inline["load_exposed_s"] == inline["load_s"]).all() and (inline["load_s"] > 0).all()
    assert (tables[2]["load_s"] > 0).all() and (tables[2]["load_exposed_s"] >= 0).all()


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie awaiting its reaper does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_end_when_the_trainer_is_killed():
    """A trainer killed outright never shuts its pool down: its forked workers must not live
    on (they hold the run folder's lock they were born with, and the restart could not take it)."""
    script = (
        "import os, signal, time\n"
        "from adaptiveload.training.reader import ProcessReader\n"
        "reader = ProcessReader(None, workers=2, clock=time.perf_counter)\n"
        "pids = {reader._pool.submit(os.getpid).result() for _ in range(8)}\n"
        "print(*pids, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert pids
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), f"orphaned reader workers {pids}"
