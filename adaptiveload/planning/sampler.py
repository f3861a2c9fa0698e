"""A ``torch.utils.data`` batch sampler over a plan: this rank's micro-batches, step by step.

Use it as ``DataLoader(dataset, batch_sampler=sampler)``. Every rank builds the same plan
locally (no communication) and yields only its own batches; all ranks yield the same number
of batches per epoch (the plan pads the last step), as DDP requires. With ``rank=None`` it
yields every rank's batches, step-major (step 0 rank 0, step 0 rank 1, ...): the form for a
loader that shards batches across processes itself, as HF Accelerate's ``prepare`` does.

Each batch it yields is a ``PlanBatch``: the list of dataset indices, plus ``.info``, a
``BatchInfo`` (epoch, step, rank, padding, the step's sample count). ``BatchInfoDataset``
carries that info through a DataLoader (workers included), so a training loop reads its step
and normaliser from the batch rather than counting batches.

Sequence-parallel groups (a plan with column ``sp_degree``, ``groups``): every rank of a
group gets the group's whole pack, with ``info.sp_degree`` (the group's d) and
``info.sp_rank`` (this rank's place in it, 0..d-1; the group is the aligned ranks
``rank - sp_rank .. rank - sp_rank + d - 1``). The model cuts each segment's tokens into d
chunks and the rank trains chunk ``sp_rank`` of each (Ulysses); ``step_samples`` counts the
group's samples once. Plans without groups yield ``sp_degree`` 1 and ``sp_rank`` 0.

Resuming: ``state_dict(consumed_steps=k)`` records the epoch, the k steps your loop has
finished and the plan's digests; ``load_state_dict`` refuses the state of another plan and
makes the next pass start after those steps (a ``set_epoch`` of that same epoch keeps the
offset). Without ``consumed_steps`` it records the batches the sampler has handed out, which
with ``num_workers > 0`` runs ahead of the loop by the DataLoader's prefetch. Ranks that
should hold one plan can compare it with ``check_ranks`` (one all-gather of digests).

Closed loop: over a ``replan.Replanner`` (instead of a PlanBuilder), ``observe(rows)`` takes
every rank's measured micro-batches of a step and ``refine()`` refits the cost model from all
of them and replans the batches not yet handed out (the epoch's remaining samples, each once,
in its remaining steps), mid-pass.
docs/sampler.md has runnable examples.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from torch.utils.data import Dataset, Sampler, default_collate

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.data.bucketing import (
    bucketize,
    cut_note,
    stills_warning,
)
from adaptiveload.data.manifest import validate_manifest
from adaptiveload.errors import UserError
from adaptiveload.planning.batches import table_degrees
from adaptiveload.planning.dealing import DEFAULT_WINDOW_STEPS
from adaptiveload.planning.plan import (
    FREE,
    PLAN_INPUTS,
    SHOW_IDS,
    Plan,
    PlanConfig,
    over_capacity,
    plan_difference,
    plan_warnings,
    table_digest,
)
from adaptiveload.planning.policies import Budgets, Policy, get_policy


class PlanWarning(UserWarning):
    """A plan runs but is unusual: samples excluded or over a budget alone, heavy padding."""


class BatchInfo(NamedTuple):
    """Where a yielded batch sits in the plan (a NamedTuple: it pickles, pins and moves to a
    device unchanged through DataLoader workers, Accelerate and Lightning).

    `step_samples` counts the samples of all ranks in the step, padding repeats included:
    what a rank's summed loss is divided by so the step's gradient is the mean over all of
    them (docs/definitions.md, loss weighting). `is_padding`: the batch repeats one of this
    epoch (the padded last step); it still has to run under DDP, whose all-reduce every rank
    joins, but a loop may leave it out of its logs or weight it 0.
    """

    epoch: int
    step: int
    rank: int
    num_steps: int
    is_padding: bool
    num_samples: int
    step_samples: int
    # the sequence-parallel group this rank trains the batch in (module docstring): its
    # degree and this rank's place in it; 1 and 0 for a rank's own micro-batch
    sp_degree: int = 1
    sp_rank: int = 0


class PlanBatch(list):
    """One micro-batch: the dataset indices (a plain list to any code that indexes a dataset)
    and ``info``, its ``BatchInfo``."""

    def __init__(self, indices: Sequence[int], info: BatchInfo) -> None:
        super().__init__(indices)
        self.info = info

    def __reduce__(self) -> tuple[Any, ...]:  # to DataLoader workers with its info
        return (PlanBatch, (list(self), self.info))


@dataclass(frozen=True)
class PlanBuilder:
    """Everything but the epoch: ``builder(epoch)`` is that epoch's plan, on any rank.

    The first plan it builds reports, in one PlanWarning line, what about it is unusual
    (`plan.plan_warnings`: excluded samples, named by `excluded_ids` when given; samples over a
    budget on their own; heavy padding).

    Samples one device (a group of the policy's largest sequence-parallel degree) cannot hold
    alone (`plan.over_capacity`, with a Calibration's capacity) are taken out of `samples`
    when it is made, and join `num_excluded` and `excluded_ids`:
    `samples` is then exactly what the plans can yield, the rows to build a dataset over.
    """

    samples: pd.DataFrame  # bucketed; its row order is the dataset order
    policy: str | Policy
    budgets: Budgets
    world_size: int
    seed: int
    cost_model: CostModel | Calibration | None = None
    window_steps: int | None = DEFAULT_WINDOW_STEPS
    steps_per_epoch: str | int = FREE  # free, match or a step count (`build_plan`)
    num_excluded: int = 0
    excluded_ids: Sequence[str] = ()  # of the manifest rows bucketing dropped
    num_over_capacity: int = 0  # of num_excluded, those taken out for the device's capacity
    # the latest epoch's plan ({"epoch": e, "plan": plan}), shared by the samplers of all ranks
    # one process emulates; and whether the first plan's warning was given
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        degree = get_policy(self.policy).max_degree(self.cost_model, self.world_size)
        over = over_capacity(self.samples, self.cost_model, degree)
        if over.any():  # a frozen dataclass: set the fields it is made with once, here
            dropped = self.samples.loc[over, "sample_id"].tolist()
            object.__setattr__(self, "samples", self.samples[~over].reset_index(drop=True))
            object.__setattr__(self, "excluded_ids", [*self.excluded_ids, *dropped])
            object.__setattr__(self, "num_excluded", self.num_excluded + len(dropped))
            object.__setattr__(self, "num_over_capacity", self.num_over_capacity + len(dropped))

    def __call__(self, epoch: int) -> Plan:
        if self._cache.get("epoch") != epoch:
            plan = self.config(epoch).plan(
                self.samples, self.num_excluded, self.num_over_capacity
            )
            self._cache.update(epoch=epoch, plan=plan)
            if not self._cache.get("warned"):
                self._cache["warned"] = True
                self._warn(plan.summary)
        return self._cache["plan"]

    def config(self, epoch: int) -> PlanConfig:
        """What `epoch`'s plan is made from, as `adaptiveload plan` builds it."""
        return PlanConfig(
            self.policy,
            self.budgets,
            self.world_size,
            self.seed,
            epoch,
            cost_model=self.cost_model,
            window_steps=self.window_steps,
            steps_per_epoch=self.steps_per_epoch,
        )

    def _warn(self, summary: Mapping[str, Any]) -> None:
        found = plan_warnings(dict(summary), list(self.excluded_ids))
        found += [note for note in (stills_warning(self.samples), cut_note(self.samples,
                                                                           SHOW_IDS)) if note]
        if not found:
            return
        warnings.warn(f"plan ({summary['policy']}): " + "; ".join(found), PlanWarning,
                      stacklevel=_outside_the_package())


PlanSource = pd.DataFrame | Plan | Callable[[int], Plan]
SampleIndex = Sequence[str] | pd.Index | Mapping[str, int]


class PlanBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches (``PlanBatch``: dataset indices + ``info``) of the current
    epoch's plan.

    `plan`: a plan table or Plan (one fixed epoch) or a builder ``epoch -> Plan`` (a new plan
    per ``set_epoch``). `rank`: this process's rank among the data-parallel ranks, or None for
    every rank's batches in step-major order (for loaders that shard batches themselves).
    `sample_index`: the dataset's sample_ids in dataset order (or a mapping sample_id ->
    position); defaults to a PlanBuilder's ``samples`` order.
    """

    def __init__(
        self,
        plan: PlanSource,
        rank: int | None,
        sample_index: SampleIndex | None = None,
        epoch: int = 0,
    ) -> None:
        self._builder = plan if callable(plan) and not isinstance(plan, pd.DataFrame) else None
        if sample_index is None:
            samples = getattr(self._builder, "samples", None)
            if not isinstance(samples, pd.DataFrame):
                raise ValueError("sample_index is required unless plan is a PlanBuilder")
            sample_index = samples["sample_id"]
        self._index, self._positions = _as_index(sample_index)
        self.rank = rank
        self._fixed = None if self._builder else plan
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
        sample_index: SampleIndex | None = None,
        cost_model: CostModel | Calibration | None = None,
        **bucketing: Any,
    ) -> PlanBatchSampler:
        """Validate `manifest` (a UserError names column, row and fix), bucketize and plan it.

        Dataset index i is row i of ``sampler.samples`` (the bucketed rows: samples that fit
        no bucket are left out), unless `sample_index` gives your dataset's sample_ids in its
        own order (``manifest["sample_id"]`` for a dataset over the manifest's rows) or a
        mapping sample_id -> index. Excluded and oversize samples are reported once, in one
        PlanWarning line, and counted in ``sampler.summary``. Balanced policies deal within the
        default window; a ``PlanBuilder`` takes every planning option. `bucketing`:
        ``bucketize``'s options (mode, grid, max_frames, short_clips), its defaults where absent.
        """
        frame = validate_manifest(manifest, origin="from_manifest: manifest", frame=True)
        bucketed = bucketize(frame, **bucketing)
        builder = PlanBuilder(
            bucketed.samples, policy, budgets, world_size, seed,
            cost_model=cost_model, num_excluded=bucketed.num_excluded,
            excluded_ids=bucketed.excluded_ids.tolist(),
        )
        return cls(builder, rank, sample_index)

    @property
    def samples(self) -> pd.DataFrame:
        """The bucketed samples a PlanBuilder plans over (its dataset order)."""
        samples = getattr(self._builder, "samples", None)
        if not isinstance(samples, pd.DataFrame):
            raise AttributeError("samples is known only when the plan comes from a PlanBuilder")
        return samples

    @property
    def summary(self) -> dict[str, Any]:
        """The current epoch's plan summary: digests, budgets, counts (samples, excluded,
        oversize, padding), and predicted metrics when a cost model was given; with
        ``excluded_ids`` when the sampler bucketed the manifest itself."""
        out = dict(self._summary)
        if isinstance(self._builder, PlanBuilder) and self._builder.num_excluded:
            out["excluded_ids"] = list(self._builder.excluded_ids)
        return out

    @property
    def sampler(self) -> PlanBatchSampler:
        """The sampler itself: where Accelerate's ``loader.set_epoch`` and Lightning's epoch
        loop look for ``set_epoch`` on a batch sampler (``batch_sampler.sampler``)."""
        return self

    @property
    def batches_per_step(self) -> int:
        """Batches handed out per plan step: 1 for one rank, world_size for ``rank=None``."""
        return self.world_size if self.rank is None else 1

    def set_epoch(self, epoch: int, step: int | None = None) -> None:
        """Switch to `epoch`'s plan (rebuilt deterministically); the next pass starts at `step`.

        `step` None: at step 0, unless an epoch set before (by ``set_epoch`` or
        ``load_state_dict``) has not begun its pass yet. Then the same epoch keeps that start,
        so the usual ``set_epoch(epoch)`` at the top of an epoch loop does not replay the steps
        a resume skips, and another epoch is refused (ValueError): a framework that sets its
        own count as the epoch (HF Accelerate's prepared loader sets the number of passes it
        has made) would otherwise drop the resume, or replay another epoch's plan, without a
        word. ``set_epoch(epoch, step=0)`` starts `epoch` afresh whatever was pending.
        """
        if self._builder is None and epoch != self.epoch:
            raise ValueError(
                "a fixed plan table covers one epoch; pass a PlanBuilder to plan each epoch"
            )
        pending = self._resume
        if step is None and epoch == self.epoch and (pending is not None or self._active):
            # the epoch set before, with its start, or the one whose pass is running: Lightning
            # sets the epoch again once a loader with workers has begun drawing its batches
            return
        if step is None and pending is not None and pending < self._total:
            at = pending // self.batches_per_step
            raise ValueError(
                f"set_epoch({epoch}): epoch {self.epoch} was set to start at step {at} and "
                "has not run yet; a second set_epoch would drop it silently. Iterate epoch "
                f"{self.epoch} first, or call set_epoch({epoch}, step=0) to start epoch {epoch} "
                "afresh (a framework that sets epochs itself: docs/sampler.md)"
            )
        self._load(epoch)
        self._start_at(0 if step is None else step)

    def _start_at(self, step: int) -> None:
        """Make the next pass begin at `step` of the current epoch."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"step {step!r}: expected an integer")
        if not 0 <= step <= self.num_steps:
            raise ValueError(f"step {step}: outside 0..{self.num_steps}")
        self._resume = self._pos = int(step) * self.batches_per_step

    def __len__(self) -> int:
        """Batches the pass in progress yields from its start, else the next pass: after a
        resume, the rest of the epoch; after a pass broken off, the whole epoch again."""
        start = self._pass_start if self._active is not None else self._resume or 0
        return self._total - start

    def __iter__(self) -> Iterator[PlanBatch]:
        self._pos = self._resume or 0
        return self._batches()

    def _batches(self) -> Iterator[PlanBatch]:
        # The start is taken when the pass yields its first batch, not in __iter__: a
        # DataLoader with workers calls iter() twice and discards the first iterator unstarted.
        start, self._resume = self._resume or 0, None  # a later pass replays from step 0
        token = self._active = object()  # this pass, until it ends or is broken off (closed)
        self._pass_start = slot = start
        try:
            # the arrays are read at each slot: a `refine` between two batches replans the
            # slots not yet handed out
            while slot < self._total:
                self._pos = slot + 1
                yield PlanBatch(self._flat[self._bounds[slot] : self._bounds[slot + 1]].tolist(),
                                self._info(slot))
                slot += 1
        finally:
            if self._active is token:
                self._active = None

    def _info(self, slot: int) -> BatchInfo:
        step, at_rank = divmod(slot, self.batches_per_step)
        return BatchInfo(
            epoch=self.epoch, step=step, rank=self.rank if self.rank is not None else at_rank,
            num_steps=self.num_steps, is_padding=bool(self._slot_pad[slot]),
            num_samples=int(self._bounds[slot + 1] - self._bounds[slot]),
            step_samples=int(self.samples_per_step[step]),
            sp_degree=int(self._slot_degree[slot]),
            sp_rank=int(self._slot_sp_rank[slot]),
        )

    def state_dict(self, consumed_steps: int | None = None) -> dict[str, Any]:
        """Where to resume: the epoch, the steps done in it, and the plan they belong to.

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
            "plan": self._identity(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next pass yields exactly the batches after ``state["step"]``.

        ValueError, naming what differs, for the state of another rank or another plan
        (another manifest, order of its rows, policy, budgets, seed or world size).
        """
        if state["rank"] != self.rank or state["world_size"] != self.world_size:
            raise ValueError(
                f"state is for rank {state['rank']} of {state['world_size']}, "
                f"this sampler is rank {self.rank} of {self.world_size}"
            )
        if not isinstance(state.get("plan"), Mapping) or "plan_digest" not in state["plan"]:
            raise ValueError(
                "state has no plan digest (saved by an older adaptiveload): it cannot be "
                "checked against this plan; start the epoch afresh"
            )
        self.set_epoch(int(state["epoch"]), step=0)
        saved, here = state["plan"], self._identity()
        if saved["plan_digest"] != here["plan_digest"]:
            raise ValueError(f"state is of another plan: {_differs(saved, here, 'the state')}")
        self._start_at(int(state["step"]))

    def observe(self, rows: Any) -> None:
        """Closed loop: add measured micro-batch rows to what the next ``refine`` fits (the
        plan source must be a ``replan.Replanner``). Each row is one rank's micro-batch of a
        step: ``step, rank, compute_s, samples, tokens, tokens_sq`` (n, Σ S and Σ S² of its
        samples; ``sp_degree`` optional). Every rank must observe the same rows in the same
        order (under DDP, all-gather them first: docs/sampler.md), so that every rank refits
        alike and keeps one plan."""
        self._closed_loop("observe").observe(rows)

    def refine(self) -> Any:
        """Closed loop: refit the cost model from every row observed so far and replan the
        epoch's batches this sampler has not handed out yet (its remaining samples, each
        once, in its remaining steps; at an epoch's end, the next epoch). Call it at the same
        point on every rank. Returns the ``replan.Switch`` (the refitted calibration)."""
        loop = self._closed_loop("refine")
        step = -(-self._pos // self.batches_per_step)  # the first step not yet handed out
        made = loop.refine(self.epoch, step)
        pos, resume, active, start = self._pos, self._resume, self._active, self._pass_start
        self._load(self.epoch)  # the same epoch's plan, now replanned after `step`
        self._pos, self._resume, self._active, self._pass_start = pos, resume, active, start
        return made

    def _closed_loop(self, name: str) -> Any:
        if not hasattr(self._builder, "refine"):
            raise ValueError(
                f"{name}: the plan source has no closed loop; build the sampler from "
                "Replanner(builder) (adaptiveload.planning.replan)"
            )
        return self._builder

    def check_ranks(self, group: Any = None) -> None:
        """ValueError on every process if the processes of `group` (default: all) planned
        differently: one all-gather of the plan digests, naming the first process and input
        that differ (a manifest read in another row order, another seed, ...). A no-op when no
        torch.distributed process group is initialized. Call it once after building the
        sampler (and after ``set_epoch`` if epochs are planned from inputs that may drift)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        here = self._identity()
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, here, group=group)
        for process, there in enumerate(everyone):
            if there["plan_digest"] != here["plan_digest"]:
                raise ValueError(
                    f"process {process} planned another epoch than process "
                    f"{dist.get_rank(group)}: {_differs(there, here, f'process {process}')}; "
                    "every rank must plan the same manifest rows in the same order with the "
                    "same policy, budgets, world size, seed and epoch"
                )

    def _identity(self) -> dict[str, Any]:
        """What says which plan this is: its inputs (PLAN_INPUTS) and digests."""
        keys = (*PLAN_INPUTS, "data_digest", "plan_digest")
        return {k: self._summary[k] for k in keys if k in self._summary}

    def _load(self, epoch: int) -> None:
        if self._builder is None:
            table, summary = _table_and_summary(self._fixed)
        else:
            plan = self._builder(epoch)
            table, summary = plan.table, plan.summary
        self.epoch = epoch
        step = table["step"].to_numpy(np.int64)
        rank = table["rank"].to_numpy(np.int64)
        self.world_size = int(summary.get("world_size") or rank.max() + 1)
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        self.num_steps = int(step.max()) + 1
        self._summary = summary
        # samples in the whole step, all ranks: what a rank's loss share is computed against
        self.samples_per_step = np.bincount(step, minlength=self.num_steps)
        # one slot per batch this sampler hands out: (step) for one rank, (step, rank) for all;
        # a group's rows go to every rank of the group, each with its place in it
        rows, slot, sp_rank = self._group_rows(step, rank, table_degrees(table))
        order = np.argsort(slot, kind="stable")  # keeps each batch's sample order
        rows, slot, sp_rank = rows[order], slot[order], sp_rank[order]
        ids = table["sample_id"].to_numpy()[rows]
        positions = self._index.get_indexer(ids)
        if np.any(positions < 0):
            bad = ids[positions < 0][0]
            raise UserError(f"plan: sample_id {bad!r} is not in the dataset's sample index")
        self._flat = self._positions[positions]
        self._total = self.num_steps * self.batches_per_step
        self._bounds = np.searchsorted(slot, np.arange(self._total + 1))
        empty = np.flatnonzero(np.diff(self._bounds) == 0)
        if empty.size:
            at_step, at_rank = divmod(int(empty[0]), self.batches_per_step)
            who = self.rank if self.rank is not None else at_rank
            raise ValueError(f"rank {who} has no batch at step {at_step}; pad the plan")
        self._slot_pad = table["is_padding"].to_numpy(bool)[rows[self._bounds[:-1]]]
        self._slot_degree = table_degrees(table)[rows[self._bounds[:-1]]]
        self._slot_sp_rank = sp_rank[self._bounds[:-1]]
        # slot the next pass starts at, set by set_epoch or load_state_dict until that pass
        # begins (None: step 0, and no epoch is pending)
        self._resume: int | None = None
        self._active: object | None = None  # the pass in progress (a token), if any
        self._pass_start = 0  # slot the pass in progress started at
        self._pos = 0


    def _group_rows(
        self, step: np.ndarray, rank: np.ndarray, degree: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plan rows this sampler hands out, the slot of each and the rank's place in the
        row's group: a row of a group of d ranks (``rank`` its first) is every one of them's."""
        if self.rank is not None:
            rows = np.flatnonzero((rank <= self.rank) & (self.rank < rank + degree))
            return rows, step[rows], self.rank - rank[rows]
        rows = np.repeat(np.arange(step.size), degree)
        place = np.arange(rows.size) - np.repeat(np.cumsum(degree) - degree, degree)
        return rows, step[rows] * self.world_size + rank[rows] + place, place


class BatchInfoDataset(Dataset):
    """Your map-style dataset, each loaded batch paired with the ``BatchInfo`` of its plan batch.

    ``data = BatchInfoDataset(dataset, collate_fn)`` and ``DataLoader(data,
    batch_sampler=sampler, collate_fn=data.collate)`` yield ``(batch, info)``: your collate's
    batch (``default_collate`` if none) and its BatchInfo. The info travels with the indices
    to the workers (``__getitems__`` receives the ``PlanBatch``), so it is right with any
    ``num_workers``, after a resume and under Accelerate's sharding.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: Sequence[int]) -> _Fetched:
        info = getattr(batch, "info", None)
        if not isinstance(info, BatchInfo):
            raise TypeError(
                "BatchInfoDataset: the batch carries no BatchInfo; load it with "
                "batch_sampler=PlanBatchSampler(...)"
            )
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(list(batch)) if getitems else [self.dataset[i] for i in batch]
        return _Fetched(items, info)

    def collate(self, fetched: _Fetched) -> tuple[Any, BatchInfo]:
        """The DataLoader's ``collate_fn``: (your collated batch, its BatchInfo)."""
        return self.collate_fn(fetched.items), fetched.info


class _Fetched:
    """The items of one batch and its BatchInfo, between ``__getitems__`` and ``collate``."""

    def __init__(self, items: list[Any], info: BatchInfo) -> None:
        self.items, self.info = items, info

    def __getitem__(self, index: int) -> Any:  # what another collate_fn would try first
        raise TypeError(
            "a BatchInfoDataset's batches are collated by its own collate: pass "
            "collate_fn=dataset.collate to the DataLoader"
        )


def _outside_the_package() -> int:
    """The `stacklevel` of the first caller outside adaptiveload: a warning then points at the
    user's line that built the sampler, however deep inside the package it was raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("adaptiveload."):
        frame, level = frame.f_back, level + 1
    return level


def _differs(saved: Mapping[str, Any], here: Mapping[str, Any], where: str) -> str:
    field_, theirs, ours = plan_difference(saved, here)
    return f"{field_} is {theirs!r} in {where}, {ours!r} here"


def _table_and_summary(plan: pd.DataFrame | Plan) -> tuple[pd.DataFrame, dict[str, Any]]:
    """A fixed plan's table and summary (a table written by `adaptiveload plan` carries its
    summary in ``attrs``; any other gets its digest from its content)."""
    if isinstance(plan, Plan):
        return plan.table, plan.summary
    summary = dict(plan.attrs.get("plan", {}))
    summary.setdefault("plan_digest", table_digest(plan))
    return plan, summary


def _as_index(sample_index: SampleIndex) -> tuple[pd.Index, np.ndarray]:
    """(an Index of sample_ids, the dataset position of each of its entries)."""
    if isinstance(sample_index, Mapping):
        index = pd.Index(list(sample_index.keys()))
        positions = np.fromiter(sample_index.values(), dtype=np.int64, count=len(index))
    else:
        index = pd.Index(sample_index)
        positions = np.arange(len(index), dtype=np.int64)
    if not index.is_unique:
        dup = index[index.duplicated()].unique()[:SHOW_IDS].tolist()
        raise UserError(
            f"sample index: sample_ids must be unique; repeated: {', '.join(map(repr, dup))}"
        )
    return index, positions
