"""PlanBatchSampler: DataLoader integration, rank views, epochs and mid-epoch resume."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_data import bucketed
from torch.utils.data import DataLoader, Dataset

from adaptiveload.planning.plan import build_plan
from adaptiveload.planning.policies import POLICIES, Budgets
from adaptiveload.planning.sampler import PlanBatchSampler, PlanBuilder

BUDGETS = Budgets(m_tok=40_000, m_mem=40_000, m_comp=40_000**1.5, p=1.5)
WORLD = 4


class Shapes(Dataset):
    """Item i -> (i, a tensor of the sample's bucket shape); collates only within a bucket."""

    def __init__(self, samples: pd.DataFrame) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        row = self.samples.iloc[i]
        shape = (int(row.bucket_frames), int(row.bucket_height), int(row.bucket_width))
        return {"index": i, "sample_id": row.sample_id, "x": torch.zeros(1, *shape[:1])}


@pytest.fixture(scope="module")
def samples() -> pd.DataFrame:
    return bucketed(600, seed=5)


@pytest.mark.parametrize("policy", ["equal-token", "adaptiveload-balanced"])
def test_dataloader_yields_this_ranks_batches(samples, policy):
    builder = PlanBuilder(samples, policy, BUDGETS, WORLD, seed=1)
    table = builder(0).table
    seen = []
    for rank in range(WORLD):
        sampler = PlanBatchSampler(builder, rank)
        loader = DataLoader(Shapes(samples), batch_sampler=sampler)
        got = list(loader)
        assert len(got) == len(sampler) == table["step"].max() + 1
        mine = table[table["rank"] == rank]
        for step, batch in enumerate(got):
            expect = mine.loc[mine["step"] == step, "sample_id"].tolist()
            assert list(batch["sample_id"]) == expect
        seen += [i for batch in got for i in batch["index"].tolist()]
    # all ranks together cover every sample; repeats only from the padded last step
    assert set(seen) == set(range(len(samples)))
    assert len(seen) == len(samples) + int(table["is_padding"].sum())


def test_set_epoch_rebuilds_deterministically(samples):
    a = PlanBatchSampler(PlanBuilder(samples, "adaptiveload", BUDGETS, WORLD, seed=2), rank=3)
    b = PlanBatchSampler(PlanBuilder(samples, "adaptiveload", BUDGETS, WORLD, seed=2), rank=3)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    second = list(a)
    assert second == list(b) and second != first
    a.set_epoch(0)
    assert list(a) == first
    builder = PlanBuilder(samples, "adaptiveload", BUDGETS, WORLD, seed=2)
    assert builder(1) is builder(1)  # ranks emulated in one process share the epoch's plan
    assert list(a) == first  # a second pass replays the epoch


@pytest.mark.parametrize("consumed", [0, 1, 7])
def test_resume_mid_epoch_yields_exactly_the_rest(samples, consumed):
    def make() -> PlanBatchSampler:
        return PlanBatchSampler(
            PlanBuilder(samples, "adaptiveload-balanced", BUDGETS, WORLD, seed=3), rank=2
        )

    sampler = make()
    sampler.set_epoch(4)
    full = list(sampler)
    it = iter(sampler)
    head = [next(it) for _ in range(consumed)]
    state = sampler.state_dict()
    assert state["epoch"] == 4 and state["step"] == consumed
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(DataLoader(Shapes(samples), batch_sampler=resumed))
    assert head + [b["index"].tolist() for b in rest] == full
    assert list(resumed) == full  # after the remainder, the next pass is the whole epoch


def test_fixed_table_with_sample_index_and_mapping(samples):
    plan = build_plan(samples, "equal-token", BUDGETS, WORLD, seed=4)
    shuffled = samples.sample(frac=1.0, random_state=0).reset_index(drop=True)
    by_list = PlanBatchSampler(plan.table, 1, shuffled["sample_id"])
    as_map = {sid: i for i, sid in enumerate(shuffled["sample_id"])}
    by_map = PlanBatchSampler(plan, 1, as_map)
    assert list(by_list) == list(by_map)
    ids = shuffled["sample_id"].to_numpy()
    got = [ids[b].tolist() for b in by_list]
    mine = plan.table[plan.table["rank"] == 1]
    assert got == [g.tolist() for _, g in mine.groupby("step")["sample_id"]]
    with pytest.raises(ValueError, match="one epoch"):
        by_list.set_epoch(1)
    with pytest.raises(ValueError, match="rank 1 of 4"):
        PlanBatchSampler(plan, 0, ids).load_state_dict(by_list.state_dict())


def test_samples_per_step_counts_all_ranks(samples):
    plan = build_plan(samples, "adaptiveload", BUDGETS, WORLD, seed=4)
    sampler = PlanBatchSampler(plan, 0, samples["sample_id"])
    expect = plan.table.groupby("step").size().to_numpy()
    np.testing.assert_array_equal(sampler.samples_per_step, expect)


def test_from_manifest_needs_only_the_manifest():
    from adaptiveload.data.mixtures import synthesize

    manifest = synthesize("tiny-cpu", 300, seed=0)
    per_rank = [
        list(
            PlanBatchSampler.from_manifest(
                manifest, "adaptiveload", BUDGETS, 2, r, seed=0, grid="tiny"
            )
        )
        for r in range(2)
    ]
    sampler = PlanBatchSampler.from_manifest(
        manifest, "adaptiveload", BUDGETS, 2, 0, seed=0, grid="tiny"
    )
    assert len(per_rank[0]) == len(per_rank[1]) == len(sampler)
    covered = {i for batches in per_rank for b in batches for i in b}
    assert covered == set(range(len(sampler.samples)))


def test_bad_sample_index(samples):
    plan = build_plan(samples, "equal-token", BUDGETS, 2, seed=0)
    from adaptiveload.errors import UserError

    with pytest.raises(UserError, match="not in the dataset"):
        PlanBatchSampler(plan, 0, samples["sample_id"].iloc[:10])
    with pytest.raises(ValueError, match="rank 5"):
        PlanBatchSampler(plan, 5, samples["sample_id"])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 300),
    world_size=st.integers(1, 48),
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 2**31),
)
def test_rank_views_reassemble_the_plan(n, world_size, policy, seed):
    samples = bucketed(n, seed=seed % 1000)
    builder = PlanBuilder(samples, policy, BUDGETS, world_size, seed)
    table = builder(0).table
    ids = samples["sample_id"].to_numpy()
    views = [list(PlanBatchSampler(builder, r)) for r in range(world_size)]
    assert len({len(v) for v in views}) == 1  # every rank runs the same number of steps
    rebuilt = [i for step in zip(*views, strict=True) for b in step for i in ids[b]]
    assert rebuilt == table["sample_id"].tolist()


def test_all_ranks_view_is_step_major_and_resumes(samples):
    builder = PlanBuilder(samples, "adaptiveload-balanced", BUDGETS, WORLD, seed=6)
    per_rank = [list(PlanBatchSampler(builder, r)) for r in range(WORLD)]
    every = PlanBatchSampler(builder, None)
    assert len(every) == WORLD * len(per_rank[0])
    assert list(every) == [b for step in zip(*per_rank, strict=True) for b in step]
    state = every.state_dict(consumed_steps=2)
    assert state["rank"] is None and state["step"] == 2
    resumed = PlanBatchSampler(PlanBuilder(samples, "adaptiveload-balanced", BUDGETS, WORLD,
                                           seed=6), None)
    resumed.load_state_dict(state)
    assert list(resumed) == list(every)[2 * WORLD :]
    with pytest.raises(ValueError, match="consumed_steps"):
        every.state_dict(consumed_steps=len(per_rank[0]) + 1)


def test_accelerate_shards_the_all_ranks_view_into_the_rank_views(samples):
    """Accelerate's BatchSamplerShard (what `prepare` wraps a batch sampler in) deals process i
    every i-th batch: of the all-ranks view that is rank i's plan; of a per-rank sampler it
    would be half of that rank's batches (the double sharding docs/sampler.md warns about)."""
    shard = pytest.importorskip("accelerate.data_loader").BatchSamplerShard
    builder = PlanBuilder(samples, "adaptiveload", BUDGETS, 2, seed=7)
    for rank in range(2):
        mine = list(PlanBatchSampler(builder, rank))
        assert list(shard(PlanBatchSampler(builder, None), 2, rank)) == mine
        twice = list(shard(PlanBatchSampler(builder, rank), 2, rank))
        assert len(twice) < len(mine)


def test_resume_with_workers_counts_consumed_steps(samples):
    def make() -> PlanBatchSampler:
        return PlanBatchSampler(PlanBuilder(samples, "adaptiveload", BUDGETS, WORLD, seed=8), 1)

    sampler = make()
    loader = DataLoader(Shapes(samples), batch_sampler=sampler, num_workers=2)
    head = []
    for step, batch in enumerate(loader):
        head.append(batch["index"].tolist())
        if step + 1 == 2:
            state = sampler.state_dict(consumed_steps=2)
            ahead = sampler.state_dict()["step"]
            break
    assert ahead > 2  # the workers prefetched beyond what the loop consumed
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b["index"].tolist() for b in DataLoader(Shapes(samples), batch_sampler=resumed,
                                                    num_workers=2)]
    assert head + rest == list(make())
