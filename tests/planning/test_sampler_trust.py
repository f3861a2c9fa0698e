"""The sampler in a user's own trainer: paths that used to give wrong results silently.

Each test names the wrong result it rules out: a bad manifest row planned into some bucket,
the resume state of another plan accepted, `set_epoch` dropping a resume, a loss normaliser
indexed by the loop's count, dataset indices off by the excluded rows, ranks that planned
differently, padding batches that cannot be told apart.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from repo_paths import H200_PRIOR
from torch.utils.data import DataLoader, Dataset

from adaptiveload.costmodel import Calibration
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.planning.policies import Budgets
from adaptiveload.planning.sampler import (
    BatchInfo,
    BatchInfoDataset,
    PlanBatchSampler,
    PlanWarning,
)

BUDGETS = Budgets(m_tok=4096, m_mem=6144, m_comp=4096**1.2, p=1.2)
WORLD = 2


@pytest.fixture(scope="module")
def manifest() -> pd.DataFrame:
    return synthesize("tiny-cpu", 303, seed=0)


def make(manifest: pd.DataFrame, rank: int | None = 0, **kw) -> PlanBatchSampler:
    args = {"policy": "adaptiveload", "seed": 0, **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return PlanBatchSampler.from_manifest(
            manifest, args.pop("policy"), BUDGETS, WORLD, rank, args.pop("seed"), grid="tiny",
            **args,
        )


class Rows(Dataset):
    """Item i -> the sample_id of row i of `frame` (a user's dataset over their own rows)."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.ids = frame["sample_id"].tolist()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"sample_id": self.ids[i], "x": torch.zeros(1)}


# --- 1. one validator for every manifest entry -------------------------------------------


@pytest.mark.parametrize(
    ("column", "value", "expect"),
    [
        ("num_frames", 0, "column 'num_frames'"),  # used to land in the largest bucket
        ("num_frames", -5, "column 'num_frames'"),
        ("num_frames", np.nan, "the cell is empty"),
        ("height", 0, "column 'height'"),  # used to drop the row without a word
        ("height", -3, "column 'height'"),
    ],
)
def test_from_manifest_refuses_bad_sizes(manifest, column, value, expect):
    bad = manifest.head(40).copy()
    bad[column] = bad[column].astype(float)
    bad.loc[7, column] = value
    with pytest.raises(UserError, match=expect) as err:
        make(bad)
    assert "position 7" in str(err.value)  # the row, as the user's df.iloc[7]


def test_from_manifest_missing_column_and_int64_na(manifest):
    with pytest.raises(UserError, match=r"missing column.*height"):
        make(manifest.drop(columns="height"))
    nullable = manifest.head(20).astype({"num_frames": "Int64"})
    nullable.loc[3, "num_frames"] = pd.NA
    with pytest.raises(UserError, match=r"num_frames.*position 3 \(empty\)"):
        make(nullable)


def test_duplicate_ids_are_named(manifest):
    bad = manifest.head(30).copy()
    bad.loc[[4, 9], "sample_id"] = "clip-a"
    bad.loc[[5, 6], "sample_id"] = "clip-b"
    with pytest.raises(UserError, match="4 rows share 2 id") as err:
        make(bad)
    assert "'clip-a' (positions 4, 9)" in str(err.value)
    assert "'clip-b' (positions 5, 6)" in str(err.value)


# --- 2. resume states carry the plan's digests ---------------------------------------------


@pytest.mark.parametrize(
    ("other", "field"),
    [
        ({"seed": 1}, "seed is 1 in the state, 0 here"),
        ({"policy": "adaptiveload-balanced"}, "policy is 'adaptiveload-balanced' in the state"),
        ({"rows": 303}, "num_samples is 303 in the state, 300 here"),
        ({"reverse": True}, "data_digest (other samples, or the same ones in another row order)"),
    ],
)
def test_load_state_dict_refuses_another_plan(manifest, other, field):
    """Every case has the same number of steps, which was all a state used to be checked by:
    resuming after such a state trained some samples twice and others never that epoch."""
    base = manifest.iloc[:300]
    rows = manifest.iloc[: other.pop("rows", 300)]
    if other.pop("reverse", False):
        rows = rows.iloc[::-1]
    saved = make(rows, **other)
    here = make(base)
    assert len(saved) == len(here)  # the old check could not tell them apart
    state = saved.state_dict(consumed_steps=10)
    with pytest.raises(ValueError, match="state is of another plan") as err:
        here.load_state_dict(state)
    assert field in str(err.value)
    make(base).load_state_dict(make(base).state_dict(consumed_steps=10))  # the same plan: fine


def test_set_epoch_of_the_resumed_epoch_keeps_the_offset(manifest):
    full = {e: [list(b) for b in _epoch(make(manifest), e)] for e in (2, 3)}
    before = make(manifest)
    before.set_epoch(2)
    state = before.state_dict(consumed_steps=4)

    resumed = make(manifest)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full[2]) - 4  # len says what the pass will yield
    got = {}
    for epoch in (2, 3):  # the usual loop, set_epoch at the top of every epoch
        resumed.set_epoch(epoch)
        got[epoch] = [list(b) for b in DataLoader(Rows(resumed.samples), batch_sampler=resumed,
                                                  collate_fn=lambda items: items)]
    assert [b for b in _epoch(make(manifest), 2)][4:] == list(map(_ids(resumed), got[2]))
    assert len(got[2]) == len(full[2]) - 4 and len(got[3]) == len(full[3])
    resumed.set_epoch(3)  # a second pass of an epoch already begun starts at step 0
    assert [list(b) for b in resumed] == full[3]


def _epoch(sampler: PlanBatchSampler, epoch: int) -> list:
    sampler.set_epoch(epoch)
    return list(sampler)


def _ids(sampler: PlanBatchSampler):
    """Map collated items back to the dataset indices they came from."""
    index = {sid: i for i, sid in enumerate(sampler.samples["sample_id"])}
    return lambda items: [index[item["sample_id"]] for item in items]


# --- 3. every batch tells its step, padding and normaliser ---------------------------------


def test_batch_info_after_resume_with_workers(manifest):
    """The DDP fragment used to index samples_per_step with the loop's enumerate count: after a
    resume most steps got another step's normaliser. The info travels with the batch."""
    sampler = make(manifest, rank=1)
    table = sampler._builder(0).table
    mine = table[table["rank"] == 1]
    resumed = make(manifest, rank=1)
    resumed.load_state_dict(sampler.state_dict(consumed_steps=7))
    data = BatchInfoDataset(Rows(resumed.samples))
    loader = DataLoader(data, batch_sampler=resumed, collate_fn=data.collate, num_workers=2)
    seen = []
    for count, (batch, info) in enumerate(loader):
        assert isinstance(info, BatchInfo) and info.rank == 1 and info.epoch == 0
        expect = mine[mine["step"] == info.step]
        assert list(batch["sample_id"]) == expect["sample_id"].tolist()
        assert info.step_samples == int((table["step"] == info.step).sum())
        assert info.is_padding == bool(expect["is_padding"].iat[0])
        assert info.num_samples == len(expect) and info.num_steps == sampler.num_steps
        seen.append((count, info.step))
    assert [step for _, step in seen] == list(range(7, sampler.num_steps))
    assert any(count != step for count, step in seen)  # enumerate would have been wrong


def test_padding_batches_are_flagged():
    small = synthesize("tiny-cpu", 12, seed=3)  # 9 batches on 2 ranks: one padding repeat
    sampler = make(small, rank=None)
    infos = [b.info for b in sampler]
    table = sampler._builder(0).table
    padded = table.groupby(["step", "rank"])["is_padding"].first()
    assert [i.is_padding for i in infos] == padded.tolist()
    assert any(i.is_padding for i in infos)


def test_batch_info_dataset_refuses_a_plain_sampler_and_a_missing_collate(manifest):
    data = BatchInfoDataset(Rows(manifest))
    with pytest.raises(TypeError, match="carries no BatchInfo"):
        next(iter(DataLoader(data, batch_size=2, collate_fn=data.collate)))
    with pytest.raises(TypeError, match=r"collate_fn=dataset\.collate"):
        next(iter(DataLoader(data, batch_sampler=make(manifest))))


# --- 4. the user's own indexing; excluded and oversize samples said once --------------------


def test_sample_index_keeps_the_users_manifest_rows(manifest):
    """sampler.samples leaves out excluded rows: a dataset over the manifest's own rows got
    other samples' indices. With sample_index=manifest['sample_id'] it gets its own rows."""
    rows = manifest.head(60).copy()
    rows.loc[[3, 11, 40], ["height", "width"]] = 8  # fit no bucket of the grid: excluded
    with pytest.warns(PlanWarning) as caught:
        sampler = PlanBatchSampler.from_manifest(
            rows, "adaptiveload", BUDGETS, WORLD, 0, seed=0, grid="tiny",
            sample_index=rows["sample_id"],
        )
    assert len(caught) == 1  # one line, once
    line = str(caught[0].message)
    assert "\n" not in line and "3 of 60 samples excluded" in line
    assert repr(rows["sample_id"].iat[3]) in line
    table = sampler._builder(0).table
    mine = table[table["rank"] == 0]
    ids = rows["sample_id"].to_numpy()
    got = [ids[b].tolist() for b in sampler]
    assert got == [g.tolist() for _, g in mine.groupby("step")["sample_id"]]
    sampler.check_ranks()  # without a process group: a no-op
    summary = sampler.summary
    assert summary["num_excluded"] == 3
    assert summary["excluded_ids"] == ids[[3, 11, 40]].tolist()
    for key in ("plan_digest", "data_digest", "m_mem", "m_comp", "p", "num_oversize", "steps"):
        assert key in summary


def test_oversize_warning_and_predicted_metrics(manifest):
    cal = Calibration.load(H200_PRIOR)
    tight = Budgets(m_tok=10, m_mem=6144, m_comp=4096**1.2, p=1.2)
    with pytest.warns(PlanWarning, match="every sample exceeds the equal-token budget m_tok=10"):
        sampler = PlanBatchSampler.from_manifest(
            manifest, "equal-token", tight, WORLD, 0, seed=0, grid="tiny", cost_model=cal
        )
    summary = sampler.summary
    assert summary["num_oversize"] == summary["num_planned"]
    assert 0 <= summary["predicted_imbalance_rate"] <= 1


# --- 6. loaders that drive epochs through batch_sampler.sampler ---------------------------


def test_accelerate_set_epoch_and_len_after_resume(manifest):
    """Accelerate's loader.set_epoch never reached the sampler, and after a resume len(loader)
    counted the whole epoch."""
    accel = pytest.importorskip("accelerate.data_loader")
    sampler = make(manifest, rank=None)
    shard = accel.BatchSamplerShard(sampler, num_processes=WORLD, process_index=1)
    loader = accel.DataLoaderShard(Rows(sampler.samples), batch_sampler=shard,
                                   collate_fn=lambda items: items)
    loader.set_epoch(3)
    assert sampler.epoch == 3
    state = sampler.state_dict(consumed_steps=5)
    resumed = make(manifest, rank=None)
    resumed.load_state_dict(state)
    shard = accel.BatchSamplerShard(resumed, num_processes=WORLD, process_index=1)
    loader = accel.DataLoaderShard(Rows(resumed.samples), batch_sampler=shard,
                                   collate_fn=lambda items: items)
    loader.set_epoch(3)  # iterating sets the loader's epoch again: the resume must survive
    expect = len(loader)
    got = list(loader)
    assert expect == len(got) == resumed.num_steps - 5
    mine = make(manifest, rank=1)
    mine.set_epoch(3)
    assert list(map(_ids(resumed), got)) == [list(b) for b in mine][5:]


def test_digests_of_ids_read_in_chunks(manifest):
    """Ids read from Parquet come as chunked Arrow columns: their digest is that of the same
    ids in one chunk (it used to stop with an AttributeError on such a column)."""
    import pyarrow as pa

    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.planning.plan import build_plan

    samples = bucketize(manifest, grid="tiny").samples
    chunked = samples.copy()
    halves = pa.chunked_array([samples["sample_id"].iloc[:100], samples["sample_id"].iloc[100:]])
    chunked["sample_id"] = pd.Series(pd.arrays.ArrowExtensionArray(halves))
    a = build_plan(samples, "adaptiveload", BUDGETS, WORLD, 0).summary
    b = build_plan(chunked, "adaptiveload", BUDGETS, WORLD, 0).summary
    assert (a["data_digest"], a["plan_digest"]) == (b["data_digest"], b["plan_digest"])


# --- round 2: the sampler inside frameworks, and what it says -------------------------------


def test_set_epoch_never_drops_a_pending_epoch(manifest):
    """`set_epoch(other epoch)` after `load_state_dict` discarded the resume without a word
    (Accelerate's prepared loader does it on every pass: it replayed epoch 0's whole plan)."""
    saved = make(manifest)
    saved.set_epoch(1)
    state = saved.state_dict(consumed_steps=4)
    resumed = make(manifest)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=r"set_epoch\(0\): epoch 1 was set to start at step 4"):
        resumed.set_epoch(0)
    assert len(resumed) == resumed.num_steps - 4  # still pending, untouched
    resumed.set_epoch(1)  # the same epoch keeps it
    assert [list(b) for b in resumed] == [list(b) for b in _epoch(make(manifest), 1)][4:]
    resumed.set_epoch(2)  # once run, any epoch may follow
    fresh = make(manifest)
    fresh.set_epoch(3)
    with pytest.raises(ValueError, match="has not run yet") as exc:
        fresh.set_epoch(0)  # a framework's own count would replace the epoch set
    assert "Accelerate" not in str(exc.value)  # a plain loop's mistake: no framework's fix
    fresh.set_epoch(0, step=0)  # explicit: start epoch 0 afresh
    assert fresh.epoch == 0 and len(fresh) == fresh.num_steps


def test_an_epoch_set_again_while_a_loader_with_workers_draws_it_runs_on(manifest):
    """Lightning's order with a plain DataLoader of workers: the loader's iterator starts
    drawing batches (its workers prefetch), then Lightning sets the same epoch again, then
    the next epoch. Setting the running epoch again left it pending, so epoch 1 was refused
    as if epoch 0 had never run."""
    sampler = make(manifest, rank=0)
    loader = DataLoader(Rows(sampler.samples), batch_sampler=sampler, num_workers=1,
                        collate_fn=lambda items: items)
    ids = _ids(sampler)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        sampler.set_epoch(epoch)  # again, once the workers have begun
        assert [ids(b) for b in batches] == [list(b) for b in _epoch(make(manifest), epoch)]


def test_accelerate_prepare_counts_passes_from_the_samplers_epoch(manifest):
    """A loader prepared after a resume of epoch 1, or afresh each epoch, set epoch 0 on its
    first pass: `integrations.accelerate.prepare` starts its count at the sampler's epoch."""
    accelerate = pytest.importorskip("accelerate")
    from adaptiveload.integrations.accelerate import prepare

    accelerator = accelerate.Accelerator(cpu=True)
    whole = {e: [list(b) for b in _epoch(make(manifest, rank=None), e)] for e in (1, 2)}

    def loader(sampler):
        return DataLoader(Rows(sampler.samples), batch_sampler=sampler,
                          collate_fn=lambda items: items)

    saved = make(manifest, rank=None)
    saved.set_epoch(1)
    resumed = make(manifest, rank=None)
    resumed.load_state_dict(saved.state_dict(consumed_steps=3))
    with pytest.raises(ValueError, match="has not run yet"):  # accelerator.prepare alone
        list(accelerator.prepare(loader(resumed)))
    prepared = prepare(accelerator, loader(resumed))
    ids = _ids(resumed)
    assert [ids(b) for b in prepared] == whole[1][3 * WORLD :]  # epoch 1's rest, not epoch 0
    assert [ids(b) for b in prepared] == whole[2]  # the next pass: the next epoch
    fresh = make(manifest, rank=None)
    fresh.set_epoch(2)  # a fresh prepared loader per epoch
    assert [ids(b) for b in prepare(accelerator, loader(fresh))] == whole[2]
    with pytest.raises(ValueError, match="rank=None"):
        prepare(accelerator, loader(make(manifest, rank=0)))


def test_lightning_loader_length_and_state_of_any_rank(manifest):
    """Lightning ends an epoch when its own count reaches len(loader), taken once per fit:
    the resumed length ended the epoch early and every later one too. PlanDataLoader's length
    is the whole epoch, and its state (saved by rank 0 only) resumes every rank."""
    pytest.importorskip("lightning")
    from adaptiveload.integrations.lightning import PlanDataLoader

    zero = PlanDataLoader(Rows(make(manifest, rank=0).samples), make(manifest, rank=0))
    for count, _ in enumerate(zero):
        if count == 6:
            break
    state = zero.state_dict()
    assert "rank" not in state and (state["epoch"], state["step"]) == (0, 7)
    one = make(manifest, rank=1)
    loader = PlanDataLoader(Rows(one.samples), one)
    loader.load_state_dict(state)  # rank 0's state, on rank 1
    assert len(loader) == one.num_steps  # the whole epoch, as Lightning counts
    steps = [info.step for _, info in loader]
    assert steps == list(range(7, one.num_steps))
    assert loader.state_dict()["step"] == one.num_steps


def test_plan_digest_covers_the_world_size():
    """Plans of 2 and of 4 ranks that deal the same slots had one digest: a rank that believed
    it was one of 4 passed check_ranks beside ranks of 2 (128 against 64 batches)."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.planning.plan import build_plan, plan_difference

    samples = bucketize(synthesize("tiny-cpu", 40, seed=0), grid="tiny").samples
    two, four = (build_plan(samples, "equal-token", BUDGETS, n, 0).summary for n in (2, 4))
    assert two["steps"] == 2 * four["steps"]  # the same 24 slots, one padding repeat in each
    assert two["plan_digest"] != four["plan_digest"]
    assert plan_difference(four, two)[:3] == ("world_size", 4, 2)


def test_over_capacity_samples_are_excluded_and_named(manifest):
    """They stayed in sampler.samples, never yielded, and excluded_ids named only the rows
    bucketing dropped (92 excluded, excluded_ids == ['1'])."""
    cal = Calibration.load("h200-wan2.1-t2v-1.3b")
    rows = synthesize("paper-mixed", 200, seed=1)
    rows["height"], rows["width"] = rows["height"].clip(upper=480), rows["width"].clip(upper=832)
    rows.loc[[5, 50], ["num_frames", "height", "width"]] = [81, 2160, 3840]
    rows.loc[9, ["height", "width"]] = 8  # fits no bucket
    with pytest.warns(PlanWarning) as caught:
        sampler = PlanBatchSampler.from_manifest(
            rows, "adaptiveload", Budgets.resolve(calibration=cal), WORLD, 0, seed=0,
            mode="exact", cost_model=cal,
        )
    ids = rows["sample_id"]
    summary = sampler.summary
    assert summary["num_over_capacity"] == 2 and summary["num_excluded"] == 3
    assert set(summary["excluded_ids"]) == set(ids[[5, 9, 50]])
    assert not set(ids[[5, 50]]) & set(sampler.samples["sample_id"])
    assert len(sampler.samples) == 197
    assert "3 of 200 samples excluded (never trained, 2 of them over" in str(caught[0].message)


def test_len_after_a_broken_off_resumed_pass(manifest):
    """It said the resumed rest (78) while the next pass yielded the whole epoch (128)."""
    sampler = make(manifest)
    sampler.load_state_dict(make(manifest).state_dict(consumed_steps=5))
    assert len(sampler) == sampler.num_steps - 5
    for count, _ in enumerate(DataLoader(Rows(sampler.samples), batch_sampler=sampler,
                                         collate_fn=lambda items: items, num_workers=1)):
        assert len(sampler) == sampler.num_steps - 5  # the pass in progress
        if count == 2:
            break
    assert len(sampler) == sampler.num_steps == len(list(sampler))


def test_clips_cut_to_their_bucket_are_said():
    """A 1,200-frame 4K clip became an 81-frame 720p bucket without a message."""
    rows = synthesize("video-only", 40, seed=0)
    rows.loc[3, ["num_frames", "height", "width"]] = [1200, 2160, 3840]
    rows.loc[3, "sample_id"] = "long-4k"
    with pytest.warns(PlanWarning, match=r"'long-4k' \(1200 -> 81 frames\)") as caught:
        sampler = PlanBatchSampler.from_manifest(rows, "adaptiveload", BUDGETS, 1, 0, seed=0)
    assert len(caught) == 1 and "cut to fewer than half their frames" in str(caught[0].message)
    row = sampler.samples[sampler.samples["sample_id"] == "long-4k"].iloc[0]
    assert (row.bucket_frames, row.bucket_height, row.bucket_width) == (81, 720, 1280)


def test_short_clips_train_as_video_where_chosen():
    """Short clips on a ladder whose first video rung is above them: stills by default (the
    schema's data.short_clips), said in one PlanWarning; short_clips='video' keeps each as a
    clip of its own 4k+1 frames, without it."""
    rows = synthesize("video-only", 40, seed=0)
    rows.loc[:9, "num_frames"] = 12
    with pytest.warns(PlanWarning, match=r"10 of 40 samples are clips of 12-12 frames"):
        still = PlanBatchSampler.from_manifest(rows, "adaptiveload", BUDGETS, 1, 0, seed=0)
    assert (still.samples["bucket_frames"].iloc[:10] == 1).all()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        video = PlanBatchSampler.from_manifest(rows, "adaptiveload", BUDGETS, 1, 0, seed=0,
                                               short_clips="video")
    assert (video.samples["bucket_frames"].iloc[:10] == 9).all()
    assert not any("stills" in str(w.message) for w in caught)


def test_messages_that_name_the_fix(manifest, tmp_path):
    """ids read as NaN by pd.read_csv were refused as '(empty)' without a hint; a `tokens`
    column was overwritten silently; True passed as a frame count; Budgets(m_tok="6144")
    raised a bare TypeError."""
    csv = tmp_path / "m.csv"
    rows = manifest.head(20)[["sample_id", "num_frames", "height", "width"]].copy()
    rows.loc[4, "sample_id"] = "null"
    rows.to_csv(csv, index=False)
    with pytest.raises(UserError, match=r"keep_default_na=False") as err:
        make(pd.read_csv(csv))
    assert "load_manifest" in str(err.value) and "\n" not in str(err.value)
    assert make(pd.read_csv(csv, dtype={"sample_id": str}, keep_default_na=False))
    own = manifest.head(20).assign(tokens=7)
    with pytest.raises(UserError, match=r"column 'tokens' is the manifest's own"):
        make(own)
    flags = manifest.head(20).astype({"num_frames": object})
    flags.loc[2, "num_frames"] = True
    with pytest.raises(UserError, match=r"num_frames.*position 2 \(True\)"):
        make(flags)
    with pytest.raises(UserError, match=r"budget m_tok='6144': must be a number, not str"):
        Budgets(m_tok="6144")
