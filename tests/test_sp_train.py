"""Sequence-parallel groups in the trainer (docs/sequence_parallel.md, Training).

Without processes: each rank of a group loads its group's pack (`PlanBatchSampler`) and the
first ranks' packs are every sample of the epoch once; a micro-batch's placement
(`sp_plan.PlanGroups`: degree, first rank, its number in the step, G counting each sample
once); with one rank per micro-batch the number is the rank; the refusals (emulated ranks,
the dense layout, a degree that is no power of two dividing the world or does not divide the
heads, overlapping groups); a step's logged loss counts a group once; `adaptiveload train`
refuses adaptiveload-sp's groups on emulated ranks before writing anything.
Under torchrun with gloo (slow; one launch of 4 processes, `sp_train_worker.py`): steps of
groups {1, 1, 2} and {2, 1, 1} train, under DDP and FSDP2, to the parameters one process
reaches training the same micro-batches (an emulated world of 3 ranks, fp32, relative
<= 1e-5), every sample once in the epoch; stopped after 2 steps and resumed from the
checkpoint, the run ends where the uninterrupted one does (measured on CPU: worst 1.1e-6
against the one process, FSDP2). And `adaptiveload train` under torchrun trains
adaptiveload-sp's own plan, recording each rank's degree in the table and MLflow.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from training_setup import ROOT, GroupedSteps, adaptiveload, cli_env, free_port, write_experiment

from adaptiveload import experiment
from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.errors import UserError
from adaptiveload.io import write_json
from adaptiveload.planning.plan import Plan
from adaptiveload.planning.sampler import PlanBatchSampler
from adaptiveload.step_table import SP_DEGREE, VAL_COLUMNS
from adaptiveload.training import checkpoint, session
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import TrainData, Trainer, step_metrics
from adaptiveload.training.session import Request
from adaptiveload.training.settings import from_experiment
from adaptiveload.training.sp_plan import Placement, PlanGroups, check_groups

TORCHRUN = Path(sys.executable).parent / "torchrun"
WORKER = Path(__file__).resolve().parent / "sp_train_worker.py"
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


def test_a_step_logs_a_group_s_loss_once_and_each_rank_s_degree():
    def row(rank, samples, loss, degree):
        return {"rank": rank, "compute_s": 1.0, "samples": samples, "tokens": 10 * samples,
                "tokens_sq": 0, "loss": loss, "padding_samples": 0, "padding_tokens": 0,
                "step_time_s": 2.0, "step_wall_s": 2.0, "samples_seen": 5, SP_DEGREE: degree,
                **dict.fromkeys(VAL_COLUMNS)}
    rows = [row(0, 2, 1.0, 1), row(1, 1, 4.0, 1), row(2, 2, 2.0, 2), row(3, 0, None, 2)]
    logged = step_metrics(rows, None)
    assert logged["loss"] == pytest.approx((2 * 1.0 + 4.0 + 2 * 2.0) / 5)
    assert [logged[f"rank{r}/{SP_DEGREE}"] for r in range(4)] == [1, 1, 2, 2]
    assert logged["samples_per_s"] == pytest.approx(5 / 2.0)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.norm()
    return float((got - want).norm() / scale) if scale > 0 else float(got.norm())


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.mark.slow
def test_torchrun_groups_of_degrees_1_and_2_train_like_one_process(tmp_path):
    path = _experiment(tmp_path, warmup_steps=1, checkpoint_every=100)
    exp = experiment.load(path)
    cfg = from_experiment(exp, POLICY, 0, launch_mode="emulated", world_size=3)
    base = prepare_data(exp, cfg)
    steps = int(base.builder(0).table["step"].max()) + 1
    reference = Trainer(replace(cfg, steps=steps), base, tmp_path / "reference", Ranks.emulated(3),
                        progress=False, identity="sp-test")
    try:
        want_rows = reference.run().steps
    finally:
        reference.close()
    out = tmp_path / "runs"
    run = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(WORKER), str(path), str(out)],
        env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    want = _weights(checkpoint.path_for(tmp_path / "reference", steps))
    for name in ("ddp", "fsdp", "resumed"):
        got = _weights(checkpoint.path_for(out / name / "checkpoints", steps))
        worst = max(_rel(got[k], w) for k, w in want.items())
        assert worst <= RTOL, (name, worst)
        table = pd.read_parquet(out / name / "steps.parquet")
        assert len(table) == 4 * steps and SP_DEGREE in table
        lead = table[table["samples"] > 0]
        assert lead["samples"].sum() == len(base.builder.samples)  # every sample once
        assert (lead["padding_samples"] == 0).all()
        assert lead.groupby("step").size().tolist() == [3] * steps  # 3 micro-batches a step
        degrees = table.pivot(index="step", columns="rank", values=SP_DEGREE).to_numpy()
        assert (degrees == [[1, 1, 2, 2], [2, 2, 1, 1]] * (steps // 2)).all()
        # each micro-batch's loss is the one process's for the same samples and noise
        got_loss = lead.sort_values(["step", "rank"])["loss"].to_numpy(np.float64)
        want_loss = want_rows.sort_values(["step", "rank"])["loss"].to_numpy(np.float64)
        np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    # resumed ends where the uninterrupted run does; not bit for bit: a new DDP wrapper
    # reduces its first step in other buckets (measured on CPU: 2.3e-7)
    resumed = _weights(checkpoint.path_for(out / "resumed" / "checkpoints", steps))
    ddp = _weights(checkpoint.path_for(out / "ddp" / "checkpoints", steps))
    assert max(_rel(resumed[k], w) for k, w in ddp.items()) <= RTOL


# a micro-model calibration whose pretend device holds tiny-cpu's longest clip (3,740
# tokens: 12.3 MB by this cost) on two ranks only: adaptiveload-sp then plans groups of 2
SP_COST = CostModel(c0=0.01, a=1e-5, b=1e-9, m_static=1e6, m_tok=3e3, m_seq=5e4)


def _sp_calibration(tmp_path: Path) -> Path:
    path = tmp_path / "sp_calibration.json"
    write_json(path, Calibration("wan2.1-micro", "cpu", "model", SP_COST, p=1.4, m_mem=1e4,
                                 m_comp=1e6, capacity_bytes=10e6).to_dict())
    return path


def test_adaptiveload_train_refuses_the_sp_policy_on_emulated_ranks(tmp_path):
    req = Request(_experiment(tmp_path), "adaptiveload-sp", 0, emulate_world_size=4,
                  calibration=_sp_calibration(tmp_path), out=tmp_path / "run", progress=False)
    with pytest.raises(UserError, match="torchrun --nproc-per-node 4"):
        session.train(req)
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow
def test_torchrun_trains_the_sp_policy_and_records_its_degrees(tmp_path):
    """`adaptiveload train` under torchrun on adaptiveload-sp's own plan (groups of 2 for the
    longest clips beside single ranks): it trains, the table and MLflow record each rank's
    degree, and every sample of the epoch counts once."""
    path = _experiment(tmp_path, steps="epoch", warmup_steps=1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = cli_env(uri)
    assert adaptiveload("tracking", "init", env=env, cwd=ROOT).returncode == 0
    run = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "adaptiveload", "train", "--config",
         str(path), "--policy", "adaptiveload-sp", "--seed", "0", "--kernel", "eager",
         "--calibration", str(_sp_calibration(tmp_path)), "--out", str(tmp_path / "sp")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    table = pd.read_parquet(tmp_path / "sp" / "steps.parquet")
    timed = table[table["step"] >= 1]  # the whole epoch after the replayed warm-up step
    assert (timed["samples"] - timed["padding_samples"]).sum() == 24
    assert set(table[SP_DEGREE]) == {1, 2} and np.isfinite(timed["loss"].dropna()).all()
    members = table[(table[SP_DEGREE] == 2) & (table["rank"] % 2 == 1)]
    assert len(members) and (members["samples"] == 0).all() and members["loss"].isna().all()
    assert (members["compute_s"] > 0).all()
    client = MlflowClient(uri)
    (mlrun,) = client.search_runs(client.get_experiment_by_name("t").experiment_id)
    history = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id,
                                                                  f"rank1/{SP_DEGREE}")}
    by_step = table[table["rank"] == 1].set_index("step")[SP_DEGREE]
    assert history == {int(s): float(d) for s, d in by_step.items()}
