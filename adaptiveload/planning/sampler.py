"""A ``torch.utils.data`` batch sampler over a plan: this rank's micro-batches, step by step.

Use it as ``DataLoader(dataset, batch_sampler=sampler)``. Every rank builds the same plan
locally (no communication) and yields only its own batches; all ranks yield the same number
of batches per epoch (the plan pads the last step), as DDP requires. With ``rank=None`` it
yields every rank's batches, step-major (step 0 rank 0, step 0 rank 1, ...): the form for a
loader that shards batches across processes itself, as HF Accelerate's ``prepare`` does.

Resuming: ``state_dict(consumed_steps=k)`` records the epoch and the k steps your loop has
finished; ``load_state_dict`` makes the next pass start after them. Without ``consumed_steps``
it records the batches the sampler has handed out, which with ``num_workers > 0`` runs ahead of
the loop by the DataLoader's prefetch. docs/sampler.md has runnable examples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from torch.utils.data import Sampler

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.data.bucketing import DEFAULT_GRID, DEFAULT_MAX_FRAMES, DEFAULT_MODE, bucketize
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
    per ``set_epoch``). `rank`: this process's rank, or None for every rank's batches in
    step-major order (for loaders that shard batches themselves). `sample_index`: the
    dataset's sample_ids in dataset order (or a mapping sample_id -> position); defaults to a
    PlanBuilder's ``samples`` order.
    """

    def __init__(
        self,
        plan: PlanSource,
        rank: int | None,
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
        rank: int | None,
        seed: int,
        *,
        bucketing: str = DEFAULT_MODE,
        grid: str = DEFAULT_GRID,
        max_frames: int = DEFAULT_MAX_FRAMES,
        cost_model: CostModel | Calibration | None = None,
        window_steps: int | None = DEFAULT_WINDOW_STEPS,
    ) -> PlanBatchSampler:
        """Bucketize `manifest` and plan it; build your dataset over ``sampler.samples``."""
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

    @property
    def batches_per_step(self) -> int:
        """Batches handed out per plan step: 1 for one rank, world_size for ``rank=None``."""
        return self.world_size if self.rank is None else 1

    def set_epoch(self, epoch: int) -> None:
        """Switch to `epoch`'s plan (rebuilt deterministically) and start it from step 0."""
        if self._builder is None and epoch != self.epoch:
            raise ValueError(
                "a fixed plan table covers one epoch; pass a PlanBuilder to plan each epoch"
            )
        self._load(epoch)

    def __len__(self) -> int:
        return self.num_steps * self.batches_per_step

    def __iter__(self) -> Iterator[list[int]]:
        self._pos = self._start
        return self._batches()

    def _batches(self) -> Iterator[list[int]]:
        # The resume offset is taken when the pass yields its first batch, not in __iter__: a
        # DataLoader with workers calls iter() twice and discards the first iterator unstarted.
        start, self._start = self._start, 0  # a later pass replays the epoch from step 0
        for slot in range(start, len(self)):
            self._pos = slot + 1
            yield self._flat[self._bounds[slot] : self._bounds[slot + 1]].tolist()

    def state_dict(self, consumed_steps: int | None = None) -> dict[str, Any]:
        """Where to resume: the epoch and the steps done in it.

        `consumed_steps`: the steps of this epoch your loop has finished (counting those before
        a resume). Pass it whenever ``num_workers > 0``: otherwise the count is what this
        sampler has handed out, which includes the batches the DataLoader prefetched.
        """
        step = self._pos // self.batches_per_step if consumed_steps is None else consumed_steps
        if not 0 <= step <= self.num_steps:
            raise ValueError(f"consumed_steps {step}: outside 0..{self.num_steps}")
        return {
            "epoch": self.epoch,
            "step": int(step),
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
        self._start = self._pos = int(state["step"]) * self.batches_per_step

    def _load(self, epoch: int) -> None:
        table = self._fixed if self._builder is None else _table(self._builder(epoch))
        self.epoch = epoch
        meta = table.attrs.get("plan", {})
        step = table["step"].to_numpy(np.int64)
        rank = table["rank"].to_numpy(np.int64)
        self.world_size = int(meta.get("world_size") or rank.max() + 1)
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        self.num_steps = int(step.max()) + 1
        # samples in the whole step, all ranks: what a rank's loss share is computed against
        self.samples_per_step = np.bincount(step, minlength=self.num_steps)
        # one slot per batch this sampler hands out: (step) for one rank, (step, rank) for all
        if self.rank is None:
            rows, slot = np.arange(len(table)), step * self.world_size + rank
        else:
            rows = np.flatnonzero(rank == self.rank)
            slot = step[rows]
        order = np.argsort(slot, kind="stable")  # keeps each batch's sample order
        rows, slot = rows[order], slot[order]
        ids = table["sample_id"].to_numpy()[rows]
        positions = self._index.get_indexer(ids)
        if np.any(positions < 0):
            bad = ids[positions < 0][0]
            raise UserError(f"plan: sample_id {bad!r} is not in the dataset's sample index")
        self._flat = self._positions[positions]
        self._bounds = np.searchsorted(slot, np.arange(len(self) + 1))
        empty = np.flatnonzero(np.diff(self._bounds) == 0)
        if empty.size:
            at_step, at_rank = divmod(int(empty[0]), self.batches_per_step)
            who = self.rank if self.rank is not None else at_rank
            raise ValueError(f"rank {who} has no batch at step {at_step}; pad the plan")
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
