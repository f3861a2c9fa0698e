"""A plan's sequence-parallel groups as the trainer runs them (docs/sequence_parallel.md,
Training).

A plan with the column `sp_degree` (`step_table.SP_DEGREE`) runs a row's micro-batch on the
ranks ``rank .. rank + sp_degree - 1`` of its step (``rank`` the group's first rank, a
multiple of the degree); it holds a group's rows once, on that first rank. A plan without the
column runs one rank per micro-batch. `PlanBatchSampler` yields every rank of a group that
group's pack, with ``info.sp_degree``, ``info.sp_rank`` (the rank's place in the group) and
``info.step_samples`` counting the group's samples once. What the trainer needs beyond that is
each micro-batch's number in its step (by first rank: 0, 1, ...), which seeds its noise on
every rank of its group alike and is the rank itself where every micro-batch is one rank's,
as before groups: `PlanGroups.at` gives a rank's `Placement`. Everything comes from the plan
alone, so it is identical on every rank without communication.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from adaptiveload.errors import UserError
from adaptiveload.model.architectures import get_config
from adaptiveload.planning.batches import table_degrees
from adaptiveload.planning.plan import Plan
from adaptiveload.planning.sampler import BatchInfo
from adaptiveload.step_table import SP_DEGREE
from adaptiveload.training.settings import TrainConfig
from adaptiveload.training.sp_groups import check_group_degree


class Placement(NamedTuple):
    """Where one rank's micro-batch of a step runs: on `degree` ranks from `first` (degree 1:
    the rank alone), as the step's micro-batch number `index` (ordered by first rank), in a
    step of `step_samples` samples (G, each once)."""

    degree: int
    first: int
    index: int
    step_samples: int

    def leads(self, rank: int) -> bool:
        """Whether `rank` is its group's first rank: the one whose row counts the samples."""
        return rank == self.first


class PlanGroups:
    """The groups of `builder`'s plans (epoch -> Plan, e.g. a `PlanBuilder`) on `world_size`
    ranks: each micro-batch's number in its step, per (step, first rank), for the latest
    epoch asked about."""

    def __init__(self, builder: Callable[[int], Plan], world_size: int):
        self.builder, self.world_size = builder, world_size
        self._cache: dict[int, tuple[np.ndarray, tuple[int, ...]]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, tuple[int, ...]]:
        if epoch not in self._cache:
            self._cache.clear()
            self._cache[epoch] = _numbers(self.builder(epoch).table, self.world_size)
        return self._cache[epoch]

    def at(self, info: BatchInfo, rank: int) -> Placement:
        """The placement of `rank`'s batch `info` (what its sampler yielded)."""
        first = rank - info.sp_rank
        number = self._epoch(info.epoch)[0][info.step, first]
        return Placement(info.sp_degree, first, int(number), info.step_samples)

    def degrees(self, epoch: int) -> tuple[int, ...]:
        """The degrees above 1 of `epoch`'s groups, ascending (empty: no groups)."""
        return self._epoch(epoch)[1]


def _numbers(table: pd.DataFrame, n: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """[steps, N]: on each group's (micro-batch's) first rank its number in the step; and the
    degrees above 1. ValueError for a group past the last rank or two groups on one rank of a
    step (a plan no planner makes: a rank would train both packs as one)."""
    step = table["step"].to_numpy(np.int64)
    rank = table["rank"].to_numpy(np.int64)
    degree = table_degrees(table)
    steps = int(step.max()) + 1 if step.size else 0
    if step.size and (rank + degree > n).any():
        row = int(np.argmax(rank + degree > n))
        raise ValueError(f"plan row {row}: a group of {degree[row]} from rank {rank[row]} "
                         f"passes the last of {n} ranks")
    key, first_row = np.unique(step * n + rank, return_index=True)
    cell_degree = degree[first_row]
    taken = np.zeros(steps * n, dtype=np.int64)
    for j in range(int(cell_degree.max(initial=1))):
        np.add.at(taken, key[cell_degree > j] + j, 1)
    if (taken > 1).any():
        at = int(np.argmax(taken > 1))
        raise ValueError(f"plan step {at // n}: rank {at % n} is in two groups")
    lead = np.zeros(steps * n, dtype=bool)
    lead[key] = True
    numbers = np.cumsum(lead.reshape(steps, n), axis=1) - 1
    return numbers, tuple(int(d) for d in np.unique(cell_degree) if d > 1)


def check_groups(
    table: pd.DataFrame, cfg: TrainConfig, distributed: bool, origin: str | Path
) -> None:
    """UserError unless the run can train the plan's groups (`table`: epoch 0's plan): they
    need processes of their own (emulated ranks run in one process, which cannot hold a
    sample's shards at once), the packed layout (the model shards a token stream), and
    degrees that are powers of two dividing the world (the groups are aligned blocks,
    `sp_groups`) and divide the model's heads (each rank of a group computes whole heads).
    `origin`: the experiment file, named in the message."""
    degree = table_degrees(table)
    if not (degree > 1).any():
        return
    row = int(np.argmax(degree > 1))
    where = (f"policy {cfg.policy} plans micro-batches on sequence-parallel groups (column "
             f"{SP_DEGREE} {degree[row]} at step {table['step'].iat[row]}, rank "
             f"{table['rank'].iat[row]})")
    if not distributed:
        raise UserError(
            f"{origin}: {where}, which emulated ranks cannot run (one process cannot hold a "
            f"sample's shards at once); launch with torchrun --nproc-per-node {cfg.world_size}"
        )
    if not cfg.execution.packed:
        raise UserError(f"{origin}: {where}, but model.batch_layout is 'dense'; set "
                        "model.batch_layout: packed (a group shards one token stream)")
    for d in np.unique(degree):
        try:
            check_group_degree(int(d), cfg.world_size)
        except UserError as err:
            raise UserError(f"{origin}: {where}; {err}") from None
    heads = get_config(cfg.model).num_heads
    wrong = sorted({int(d) for d in degree if heads % d})
    if wrong:
        raise UserError(
            f"{origin}: {where}; degree {wrong[0]} does not divide the {heads} heads of "
            f"{cfg.model} (each rank of a group computes whole heads); plan with degrees "
            f"dividing {heads}"
        )
