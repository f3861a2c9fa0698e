"""Sequence-parallel groups in the trainer (docs/sequence_parallel.md, Training), without
processes: each rank of a group loads its group's pack (`PlanBatchSampler`) and the first
ranks' packs are every sample of the epoch once; a micro-batch's placement
(`sp_plan.PlanGroups`: degree, first rank, its number in the step, G counting each sample
once); with one rank per micro-batch the number is the rank; the refusals (emulated ranks,
the dense layout, a degree that is no power of two dividing the world or does not divide the
heads, overlapping groups); a step's logged loss counts a group once; `adaptiveload train`
refuses adaptiveload-sp's groups on emulated ranks before writing anything. The torchrun
runs are in tests/slow/training/test_sp_train_slow.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from training_setup import GroupedSteps, sp_calibration, write_experiment

from adaptiveload import experiment
from adaptiveload.errors import UserError
from adaptiveload.planning.plan import Plan
from adaptiveload.planning.sampler import PlanBatchSampler
from adaptiveload.step_table import SP_DEGREE, VAL_COLUMNS
from adaptiveload.training import session
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import TrainData, Trainer, step_metrics
from adaptiveload.training.session import Request
from adaptiveload.training.settings import from_experiment
from adaptiveload.training.sp_plan import Placement, PlanGroups, check_groups

POLICY = "adaptiveload-packed"
RTOL = 1e-5


def _experiment(tmp_path: Path, **train) -> Path:
    return write_experiment(tmp_path, model={"batch_layout": "packed"},
                            data={"num_samples": 24}, **train)


def _base(tmp_path: Path, world: int = 3) -> tuple:
    exp = experiment.load(_experiment(tmp_path))
    cfg = from_experiment(exp, POLICY, 0, launch_mode="emulated", world_size=world)
    return exp, cfg, prepare_data(exp, cfg)


def _grouped(base: TrainData, compositions=((1, 1, 2), (2, 1, 1))) -> GroupedSteps:
    b = base.builder
    world = sum(compositions[0])
    return GroupedSteps(b.samples, b.policy, b.budgets, world, b.seed, base=b,
                        compositions=compositions)


def _batches(builder: GroupedSteps, world: int) -> list[list]:
    """Every rank's batches of epoch 0 (a PlanBatchSampler per rank, as the trainer's)."""
    return [list(PlanBatchSampler(builder, r)) for r in range(world)]


def test_each_rank_of_a_group_loads_its_pack_and_the_first_ranks_hold_every_sample_once(
    tmp_path,
):
    _, _, base = _base(tmp_path)
    builder = _grouped(base)
    plans = PlanGroups(builder, 4)
    per_rank = _batches(builder, 4)
    reference = _batches(base.builder, 3)  # the 3 micro-batches of each step
    steps = len(per_rank[0])
    assert steps == len(reference[0]) >= 2
    trained = []
    for s in range(steps):
        groups = ((0, 1, 2), (0, 2, 3))[s % 2]  # first ranks of {1, 1, 2} and {2, 1, 1}
        degrees = ((1, 1, 2), (2, 1, 1))[s % 2]
        step_samples = sum(len(reference[j][s]) for j in range(3))
        for j, (first, d) in enumerate(zip(groups, degrees, strict=True)):
            for r in range(first, first + d):
                assert list(per_rank[r][s]) == list(reference[j][s])  # same samples, same order
                assert plans.at(per_rank[r][s].info, r) == Placement(d, first, j, step_samples)
            trained += list(per_rank[first][s])
    assert sorted(trained) == list(range(len(builder.samples)))  # every sample once
    assert plans.degrees(0) == (2,)
    assert not plans.at(per_rank[3][0].info, 3).leads(3)


def test_with_one_rank_per_micro_batch_each_is_its_rank_s(tmp_path):
    _, _, base = _base(tmp_path)
    plans = PlanGroups(base.builder, 3)
    assert plans.degrees(0) == ()
    for r, batches in enumerate(_batches(base.builder, 3)):
        for batch in batches:  # numbered by rank: the noise such runs always drew
            assert plans.at(batch.info, r) == Placement(1, r, r, batch.info.step_samples)


def test_groups_past_the_last_rank_or_overlapping_are_refused(tmp_path):
    _, _, base = _base(tmp_path)
    plan = _grouped(base)(0)
    past = plan.table.assign(**{SP_DEGREE: np.where(plan.table["rank"] == 3, 2, 1)})
    past.loc[past["rank"] == 2, SP_DEGREE] = 1
    with pytest.raises(ValueError, match="passes the last of 4 ranks"):
        PlanGroups(lambda e: Plan(past, plan.summary), 4).degrees(0)
    overlap = plan.table.copy()  # step 0 is {1, 1, 2}: a group of 2 from rank 0 takes rank 1's
    overlap.loc[(overlap["step"] == 0) & (overlap["rank"] == 0), SP_DEGREE] = 2
    with pytest.raises(ValueError, match="in two groups"):
        PlanGroups(lambda e: Plan(overlap, plan.summary), 4).degrees(0)


def test_the_run_refuses_groups_it_cannot_train(tmp_path):
    _, cfg, base = _base(tmp_path)
    table = _grouped(base)(0).table
    cfg4 = replace(cfg, world_size=4)
    with pytest.raises(UserError, match=r"emulated ranks cannot run.*torchrun --nproc-per-node 4"):
        check_groups(table, cfg4, False, "exp.yaml")
    data = replace(base, builder=_grouped(base))
    with pytest.raises(UserError, match=f"column {SP_DEGREE} 2 at step 0, rank 2"):
        Trainer(cfg4, data, None, Ranks.emulated(4), progress=False)
    dense = replace(cfg4, batch_layout="dense", launch_mode="distributed")
    with pytest.raises(UserError, match=r"model\.batch_layout: packed"):
        check_groups(table, dense, True, "exp.yaml")
    four = _grouped(base, ((4, 1, 1, 1, 1),))
    with pytest.raises(UserError, match="a power of two dividing the world size 6"):
        check_groups(four(0).table, replace(cfg4, launch_mode="distributed", world_size=6),
                     True, "exp.yaml")
    with pytest.raises(UserError, match=r"degree 4 does not divide the 2 heads of wan2\.1-micro"):
        check_groups(four(0).table, replace(cfg4, launch_mode="distributed", world_size=8),
                     True, "exp.yaml")
    check_groups(base.builder(0).table, cfg, False, "exp.yaml")  # no groups: nothing to refuse


def test_a_group_in_a_later_epoch_of_a_run_without_groups_is_refused(tmp_path):
    _, cfg, base = _base(tmp_path)
    trainer = Trainer(cfg, base, None, Ranks.emulated(3), progress=False)
    try:
        assert trainer.sp is None and trainer._group(0, Placement(1, 0, 0, 5)) is None
        with pytest.raises(UserError, match=r"degree 2 .*torchrun --nproc-per-node 3"):
            trainer._group(0, Placement(2, 0, 0, 5))
    finally:
        trainer.close()


def test_a_step_logs_a_group_s_loss_once_and_each_rank_s_degree():
    def row(rank, samples, loss, degree):
        return {"step": 0, "rank": rank, "compute_s": 1.0, "samples": samples,
                "tokens": 10 * samples, "tokens_sq": 0, "loss": loss, "padding_samples": 0,
                "padding_tokens": 0,
                "step_time_s": 2.0, "step_wall_s": 2.0, "samples_seen": 5, SP_DEGREE: degree,
                **dict.fromkeys(VAL_COLUMNS)}
    rows = [row(0, 2, 1.0, 1), row(1, 1, 4.0, 1), row(2, 2, 2.0, 2), row(3, 0, None, 2)]
    logged = step_metrics(rows, None)
    assert logged["loss"] == pytest.approx((2 * 1.0 + 4.0 + 2 * 2.0) / 5)
    assert [logged[f"rank{r}/{SP_DEGREE}"] for r in range(4)] == [1, 1, 2, 2]
    assert logged["samples_per_s"] == pytest.approx(5 / 2.0)


def test_adaptiveload_train_refuses_the_sp_policy_on_emulated_ranks(tmp_path):
    req = Request(_experiment(tmp_path), "adaptiveload-sp", 0, emulate_world_size=4,
                  calibration=sp_calibration(tmp_path), out=tmp_path / "run", progress=False)
    with pytest.raises(UserError, match="torchrun --nproc-per-node 4"):
        session.train(req)
    assert not (tmp_path / "run").exists()  # nothing written
