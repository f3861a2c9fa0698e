"""A ``torch.utils.data.Sampler`` over a plan: this rank's micro-batches, step by step.

Use it as ``DataLoader(dataset, batch_sampler=sampler)``. Every rank builds the same plan
locally (no communication) and yields only its own batches; all ranks yield the same number
of batches per epoch (the plan pads the last step), as DDP requires.

The shortest path for a user with their own trainer::

    sampler = PlanBatchSampler.from_manifest(manifest_df, "adaptiveload", budgets,
                                             world_size, rank, seed)
    loader = DataLoader(LatentDataset(sampler.samples), batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader: ...

Resuming: ``state_dict()`` records the epoch and how many batches this sampler has handed
out. With ``num_workers > 0`` the DataLoader fetches a few batches ahead, so save the count
of batches your loop actually consumed instead: ``{**sampler.state_dict(), "step": done}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from torch.utils.data import Sampler

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.errors import UserError
from adaptiveload.planning.dealing import DEFAULT_WINDOW_STEPS
from adaptiveload.planning.plan import Plan, build_plan
from adaptiveload.planning.policies import Budgets, Policy


@dataclass(frozen=True)
class PlanBuilder:
    """Everything but the epoch: ``builder(epoch)`` is that epoch's plan, on any rank."""

    samples: pd.DataFrame  # bucketed; its row order is the dataset order
    policy: str | Policy
    budgets: Budgets
    world_size: int
    seed: int
    cost_model: CostModel | Calibration | None = None
    window_steps: int | None = DEFAULT_WINDOW_STEPS
    num_excluded: int = 0
    # the latest epoch's plan, shared by the samplers of all ranks one process emulates
    _latest: dict[int, Plan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __call__(self, epoch: int) -> Plan:
        if epoch not in self._latest:
            plan = build_plan(
                self.samples, self.policy, self.budgets, self.world_size, self.seed, epoch,
                cost_model=self.cost_model, window_steps=self.window_steps,
                num_excluded=self.num_excluded,
            )  # fmt: skip
            self._latest.clear()
            self._latest[epoch] = plan
        return self._latest[epoch]


PlanSource = pd.DataFrame | Plan | Callable[[int], Plan]


class PlanBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches (lists of dataset indices) of the current epoch's plan.

    `plan`: a plan table or Plan (one fixed epoch) or a builder ``epoch -> Plan`` (a new plan
    per ``set_epoch``). `sample_index`: the dataset's sample_ids in dataset order (or a
    mapping sample_id -> position); defaults to a PlanBuilder's ``samples`` order.
    """

    def __init__(
        self,
        plan: PlanSource,
        rank: int,
        sample_index: Sequence[str] | pd.Index | Mapping[str, int] | None = None,
        epoch: int = 0,
    ) -> None:
        self._builder = plan if callable(plan) and not isinstance(plan, pd.DataFrame) else None
        if sample_index is None:
            if not isinstance(self._builder, PlanBuilder):
                raise ValueError("sample_index is required unless plan is a PlanBuilder")
            sample_index = self._builder.samples["sample_id"]
        self._index, self._positions = _as_index(sample_index)
        self.rank = rank
        self._fixed = None if self._builder else _table(plan)
        self.epoch = epoch
        self._load(epoch)

    @classmethod
    def from_manifest(
        cls,
        manifest: pd.DataFrame,
        policy: str | Policy,
        budgets: Budgets,
        world_size: int,
        rank: int,
        seed: int,
        *,
        bucketing: str = "aspect",
        grid: str = "wan",
        max_frames: int = 81,
        cost_model: CostModel | Calibration | None = None,
        window_steps: int | None = DEFAULT_WINDOW_STEPS,
    ) -> PlanBatchSampler:
        """Bucketize `manifest` and plan it; build your dataset over ``sampler.samples``."""
        from adaptiveload.data.bucketing import bucketize

        bucketed = bucketize(manifest, mode=bucketing, grid=grid, max_frames=max_frames)
        builder = PlanBuilder(
            bucketed.samples, policy, budgets, world_size, seed,
            cost_model=cost_model, window_steps=window_steps, num_excluded=bucketed.num_excluded,
        )  # fmt: skip
        return cls(builder, rank)

    @property
    def samples(self) -> pd.DataFrame:
        """The bucketed samples a PlanBuilder plans over (dataset order)."""
        if not isinstance(self._builder, PlanBuilder):
            raise AttributeError("samples is known only when the plan comes from a PlanBuilder")
        return self._builder.samples

    def set_epoch(self, epoch: int) -> None:
        """Switch to `epoch`'s plan (rebuilt deterministically) and start it from step 0."""
        if self._builder is None and epoch != self.epoch:
            raise ValueError(
                "a fixed plan table covers one epoch; pass a PlanBuilder to plan each epoch"
            )
        self._load(epoch)

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[list[int]]:
        start, self._start = self._start, 0  # a later pass replays the epoch from step 0
        self._pos = start
        return self._batches(start)

    def _batches(self, start: int) -> Iterator[list[int]]:
        for step in range(start, self.num_steps):
            self._pos = step + 1
            yield self._flat[self._bounds[step] : self._bounds[step + 1]].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self._pos,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next pass yields exactly the batches after ``state["step"]``."""
        if state["rank"] != self.rank or state["world_size"] != self.world_size:
            raise ValueError(
                f"state is for rank {state['rank']} of {state['world_size']}, "
                f"this sampler is rank {self.rank} of {self.world_size}"
            )
        self.set_epoch(int(state["epoch"]))
        if state["num_steps"] != self.num_steps or not 0 <= state["step"] <= self.num_steps:
            raise ValueError("state does not match this plan (different data, policy or seed?)")
        self._start = self._pos = int(state["step"])

    def _load(self, epoch: int) -> None:
        table = self._fixed if self._builder is None else _table(self._builder(epoch))
        self.epoch = epoch
        meta = table.attrs.get("plan", {})
        step = table["step"].to_numpy(np.int64)
        rank = table["rank"].to_numpy(np.int64)
        self.world_size = int(meta.get("world_size") or rank.max() + 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        self.num_steps = int(step.max()) + 1
        # samples in the whole step, all ranks: what a rank's loss share is computed against
        self.samples_per_step = np.bincount(step, minlength=self.num_steps)
        mine = rank == self.rank
        my_step = step[mine]
        if np.any(np.diff(my_step) < 0):
            raise ValueError("plan table must be ordered by step")
        positions = self._index.get_indexer(table["sample_id"].to_numpy()[mine])
        if np.any(positions < 0):
            bad = table["sample_id"].to_numpy()[mine][positions < 0][0]
            raise UserError(f"plan: sample_id {bad!r} is not in the dataset's sample index")
        self._flat = self._positions[positions]
        self._bounds = np.searchsorted(my_step, np.arange(self.num_steps + 1))
        empty = np.flatnonzero(np.diff(self._bounds) == 0)
        if empty.size:
            raise ValueError(f"rank {self.rank} has no batch at step {empty[0]}; pad the plan")
        self._start = self._pos = 0


def _table(plan: pd.DataFrame | Plan) -> pd.DataFrame:
    return plan.table if isinstance(plan, Plan) else plan


def _as_index(
    sample_index: Sequence[str] | pd.Index | Mapping[str, int],
) -> tuple[pd.Index, np.ndarray]:
    """(an Index of sample_ids, the dataset position of each of its entries)."""
    if isinstance(sample_index, Mapping):
        index = pd.Index(list(sample_index.keys()))
        positions = np.fromiter(sample_index.values(), dtype=np.int64, count=len(index))
    else:
        index = pd.Index(sample_index)
        positions = np.arange(len(index), dtype=np.int64)
    if not index.is_unique:
        raise UserError("sample index: sample_ids must be unique")
    return index, positions
