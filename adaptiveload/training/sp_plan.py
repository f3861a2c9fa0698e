"""A plan's sequence-parallel groups as the trainer runs them (docs/sequence_parallel.md,
Training).

A plan with the column `sp_degree` (`step_table.SP_DEGREE`) runs a row's micro-batch on the
ranks ``rank .. rank + sp_degree - 1`` of its step (``rank`` the group's first rank, a
multiple of the degree); it holds a group's rows once, on that first rank. A plan without the
column runs one rank per micro-batch. `GroupedPlans` turns each epoch's plan into what every
rank does:

- called with an epoch (a plan source for `PlanBatchSampler`), the plan with a group's rows
  on every rank of the group, so that each rank's sampler yields every rank of a group that
  group's pack (the same samples, in the same order); its summary is the plan's own, so a
  resume and `check_ranks` compare the plan itself, not this view of it;
- `at(epoch, step, rank)`: the rank's `Placement`: its group's degree and first rank, the
  micro-batch's place in its step (what its noise is seeded by: the same on every rank of the
  group, and the rank itself where every micro-batch is one rank's, as before groups) and the
  step's sample count G with each sample once (a group's samples are not counted d times).

Everything comes from the plan alone, so it is identical on every rank without communication.
A plan of one rank per micro-batch passes through unchanged (the same Plan object).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from adaptiveload.errors import UserError
from adaptiveload.model.architectures import get_config
from adaptiveload.planning.batches import starts
from adaptiveload.planning.plan import Plan
from adaptiveload.step_table import SP_DEGREE
from adaptiveload.training.settings import TrainConfig
from adaptiveload.training.sp_groups import check_group_degree


def table_degrees(table: pd.DataFrame) -> np.ndarray:
    """Each row's sequence-parallel degree: the table's `SP_DEGREE` column, 1 without one."""
    if SP_DEGREE in table.columns:
        return table[SP_DEGREE].to_numpy(np.int64)
    return np.ones(len(table), dtype=np.int64)


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


@dataclass(frozen=True)
class _Epoch:
    """One epoch's groups: per (step, rank) cell the degree, first rank and micro-batch
    number, per step G; and the plan with a group's rows on each of its ranks."""

    degree: np.ndarray  # [steps, N]
    first: np.ndarray  # [steps, N]
    index: np.ndarray  # [steps, N]
    step_samples: np.ndarray  # [steps]
    members: Plan


class GroupedPlans:
    """The plans of `builder` (epoch -> Plan, e.g. a `PlanBuilder`) on `world_size` ranks, as
    each rank of a group runs them (module docstring); the latest epoch's is cached."""

    def __init__(self, builder: Callable[[int], Plan], world_size: int):
        self.builder, self.world_size = builder, world_size
        self._cache: dict[int, _Epoch] = {}

    def _epoch(self, epoch: int) -> _Epoch:
        if epoch not in self._cache:
            self._cache.clear()
            self._cache[epoch] = _layout(self.builder(epoch), self.world_size)
        return self._cache[epoch]

    def __call__(self, epoch: int) -> Plan:
        return self._epoch(epoch).members

    def at(self, epoch: int, step: int, rank: int) -> Placement:
        e = self._epoch(epoch)
        return Placement(int(e.degree[step, rank]), int(e.first[step, rank]),
                         int(e.index[step, rank]), int(e.step_samples[step]))

    def degrees(self, epoch: int) -> tuple[int, ...]:
        """The degrees above 1 of `epoch`'s groups, ascending (empty: no groups)."""
        return tuple(int(d) for d in np.unique(self._epoch(epoch).degree) if d > 1)


def _layout(plan: Plan, n: int) -> _Epoch:
    """The groups of `plan` on `n` ranks; ValueError for a group past the last rank or two
    groups on one rank of a step (a plan no planner makes)."""
    table = plan.table
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
    first = np.full(steps * n, -1, dtype=np.int64)
    degrees = np.ones(steps * n, dtype=np.int64)
    for j in range(int(cell_degree.max(initial=1))):
        cells = key[cell_degree > j] + j
        if (first[cells] >= 0).any():
            at = int(cells[np.argmax(first[cells] >= 0)])
            raise ValueError(f"plan step {at // n}: rank {at % n} is in two groups")
        first[cells] = key[cell_degree > j] % n
        degrees[cells] = cell_degree[cell_degree > j]
    first = first.reshape(steps, n)
    lead = first == np.arange(n)[None, :]
    number = np.cumsum(lead, axis=1) - 1  # on a first rank: its micro-batch's number
    index = np.take_along_axis(number, np.maximum(first, 0), axis=1)
    members = plan
    if (degree > 1).any():
        rows = np.repeat(np.arange(len(table)), degree)
        offset = np.arange(rows.size) - np.repeat(starts(degree), degree)
        spread = table.iloc[rows].reset_index(drop=True)
        spread["rank"] = rank[rows] + offset
        spread = spread.iloc[np.argsort(step[rows] * n + spread["rank"].to_numpy(), kind="stable")]
        spread = spread.reset_index(drop=True)
        spread.attrs = dict(table.attrs)
        members = Plan(table=spread, summary=plan.summary, simulation=plan.simulation)
    return _Epoch(degrees.reshape(steps, n), first, index,
                  np.bincount(step, minlength=steps), members)


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
