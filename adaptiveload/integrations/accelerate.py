"""HF Accelerate: a prepared loader whose pass count is the sampler's epoch.

Accelerate's prepared loader (``DataLoaderShard``) calls ``set_epoch(iteration)`` on every
pass, where ``iteration`` counts the passes that loader object has made, from 0. A loader
prepared after a resume of epoch 1, or afresh each epoch, would thus set epoch 0: the
sampler refuses that when an epoch it was set to has not run yet (``set_epoch``), and
``prepare`` here makes it right instead by starting the loader's count at the sampler's
epoch. Each later pass then runs the next epoch's plan, as Accelerate counts it.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from adaptiveload.planning.sampler import PlanBatchSampler


def prepare(accelerator: Any, loader: DataLoader) -> Any:
    """``accelerator.prepare(loader)`` for a loader over a ``PlanBatchSampler(rank=None)``,
    its pass count set to the sampler's epoch: the first pass runs that epoch from where a
    resume (``load_state_dict``) left it, each later pass the next epoch.

    ValueError for a per-rank sampler: Accelerate deals every process its share of the
    batches itself, so a sampler of one rank would be sharded twice."""
    sampler = loader.batch_sampler
    if not isinstance(sampler, PlanBatchSampler):
        raise ValueError("prepare: the loader's batch_sampler is not a PlanBatchSampler")
    if sampler.rank is not None:
        raise ValueError(
            f"prepare: the sampler is of rank {sampler.rank}; build it with rank=None (every "
            "rank's batches, step-major): Accelerate gives process i the batches of rank i"
        )
    prepared = accelerator.prepare(loader)
    prepared.iteration = sampler.epoch  # DataLoaderShard.__iter__ calls set_epoch(iteration)
    return prepared
