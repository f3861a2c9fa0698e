"""One torchrun process of the sequence-parallel training test
(tests/slow/training/test_sp_train_slow.py):
`torchrun --nproc-per-node 4 tests/support/sp_train_worker.py EXPERIMENT OUT` (gloo, CPU).

The experiment's packed plan on 3 ranks, regrouped by `training_setup.GroupedSteps` into
steps of groups {1, 1, 2} and {2, 1, 1} on 4 ranks, trains for one whole epoch three ways,
one `Trainer` after another in this process: `ddp`; `resumed` (2 steps, then a second
Trainer resumes from that checkpoint to the epoch's end); `fsdp` (FSDP2). Each run leaves its
checkpoints and, from rank 0, its per-step table under OUT/<run>.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from training_setup import GroupedSteps

from adaptiveload import experiment
from adaptiveload.io import write_parquet
from adaptiveload.training import checkpoint
from adaptiveload.training.distributed import resolve_ranks
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import TrainData, Trainer
from adaptiveload.training.settings import TrainConfig, from_experiment

POLICY = "adaptiveload-packed"
IDENTITY = "sp-test"


def data_of(exp: dict, cfg: TrainConfig) -> TrainData:
    """The experiment's data with its 3-rank plan regrouped onto 4 ranks."""
    base = prepare_data(exp, replace(cfg, world_size=3, launch_mode="emulated"))
    b = base.builder
    return replace(base, builder=GroupedSteps(b.samples, b.policy, b.budgets, 4, b.seed, base=b))


def train(cfg: TrainConfig, data: TrainData, out: Path, resume: bool = False) -> Trainer:
    """One run into `out` (resuming from its newest checkpoint with `resume`). The trainer is
    returned unclosed: closing it ends the process group the next run needs."""
    ranks = resolve_ranks(None, cfg.world_size)
    found = (checkpoint.find(out / "checkpoints", IDENTITY, tidy=ranks.is_main, last=cfg.steps)
             if resume else checkpoint.Found())
    trainer = Trainer(cfg, data, out / "checkpoints", ranks, resume=found.state, progress=False,
                      identity=IDENTITY)
    steps = trainer.run().steps
    if ranks.is_main:
        write_parquet(out / "steps.parquet", steps)
    return trainer


def main(path: Path, out: Path) -> None:
    exp = experiment.load(path)
    cfg = from_experiment(exp, POLICY, 0, launch_mode="distributed", world_size=4)
    data = data_of(exp, cfg)
    whole = replace(cfg, steps=int(data.builder(0).table["step"].max()) + 1)
    train(whole, data, out / "ddp")
    train(replace(whole, steps=2), data, out / "resumed")
    train(whole, data, out / "resumed", resume=True)
    last = train(replace(whole, fsdp=True), data, out / "fsdp")
    last.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
