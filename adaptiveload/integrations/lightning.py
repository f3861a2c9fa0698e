"""Lightning: a DataLoader over one rank's plan that Lightning resumes mid-epoch exactly.

Lightning counts an epoch's batches itself: after ``fit(ckpt_path=...)`` mid-epoch it takes
the steps done from its own progress and ends the epoch when that count reaches
``len(loader)``, computed once per fit. A plain loader over a resumed sampler reports the
rest of the epoch (so the resumed epoch ends early, and every later one too, at the resumed
length), and without a resume the loader replays the epoch's first steps. ``PlanDataLoader``
is what makes that right: its length is the whole epoch's steps, and it is a stateful loader
in Lightning's sense (``state_dict`` / ``load_state_dict``), so Lightning saves where the plan
is with every checkpoint and loads it back into the sampler before the first batch of the
resumed epoch is fetched (workers included). The state holds no rank: Lightning writes rank
0's and every rank loads it, which is right because all ranks finish the same plan steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from adaptiveload.planning.sampler import BatchInfo, BatchInfoDataset, PlanBatchSampler


class PlanDataLoader(DataLoader):
    """``DataLoader(BatchInfoDataset(dataset, collate_fn), batch_sampler=sampler)`` that yields
    ``(batch, info)``, reports the whole epoch's steps as its length, and carries the plan's
    position through Lightning checkpoints. `sampler`: one rank's ``PlanBatchSampler``
    (Lightning runs one process per rank; pass ``use_distributed_sampler=False``). Other
    keyword arguments go to the DataLoader (``num_workers``, ``pin_memory``, ...)."""

    def __init__(
        self,
        dataset: Any,
        sampler: PlanBatchSampler,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if sampler.rank is None:
            raise ValueError("PlanDataLoader: give the sampler of this process's rank, not None")
        if not isinstance(dataset, BatchInfoDataset):
            dataset = BatchInfoDataset(dataset, collate_fn)
        super().__init__(dataset, batch_sampler=sampler, collate_fn=dataset.collate, **kwargs)
        self.plan_sampler = sampler
        self._done = (sampler.epoch, 0)  # (epoch, its steps handed to the loop)

    def __len__(self) -> int:
        """The epoch's steps, whatever a resume skips: Lightning counts from the epoch's start."""
        return self.plan_sampler.num_steps

    def __iter__(self) -> Iterator[tuple[Any, BatchInfo]]:
        for batch, info in super().__iter__():
            # counted as done when handed over: Lightning saves a checkpoint after the step
            self._done = (info.epoch, info.step + 1)
            yield batch, info

    def state_dict(self) -> dict[str, Any]:
        """Where the plan stands after the batches handed to Lightning (with the plan's
        digests, so a resume on other data or inputs is refused), for any rank."""
        sampler = self.plan_sampler
        epoch, steps = self._done
        if epoch != sampler.epoch:  # the next epoch was set, none of its batches handed out
            steps = 0
        state = sampler.state_dict(consumed_steps=steps)
        del state["rank"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume this rank's sampler from a state that any rank of the same plan saved."""
        self.plan_sampler.load_state_dict({**state, "rank": self.plan_sampler.rank})
        self._done = (int(state["epoch"]), int(state["step"]))
