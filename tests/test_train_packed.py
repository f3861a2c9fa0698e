"""Packed micro-batches in the trainer: a plan whose cells mix bucket shapes trains, each row
reports its cell (samples = segments, tokens = sum S_i, the largest sample's shape,
peak_bytes_model = pack_memory), the step's gradient is the mean over all its samples; under
`adaptiveload train` the packed layout trains like the dense one (emulated and torchrun with
gloo, eager and fused); a dense run refuses mixed cells."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from training_setup import ROOT, adaptiveload, cli_env, free_port, write_experiment

from adaptiveload import experiment as experiment_config
from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.data.packed import collate
from adaptiveload.errors import UserError
from adaptiveload.io import read_json
from adaptiveload.planning.plan import Plan
from adaptiveload.planning.policies import POLICIES
from adaptiveload.planning.sampler import PlanBuilder
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import check_layout, prepare_data
from adaptiveload.training.loop import TrainData, Trainer
from adaptiveload.training.objective import per_sample_loss, step_generator
from adaptiveload.training.session import run_tags
from adaptiveload.training.settings import from_experiment

TORCHRUN = Path(sys.executable).parent / "torchrun"
SAME = ["step", "rank", "samples", "tokens", "tokens_sq", "frames", "height", "width"]
COST = CostModel(c0=0.01, a=1e-5, b=1e-9, m_static=1e6, m_tok=3e3, m_seq=5e4)


@dataclass(frozen=True)
class MixedCells(PlanBuilder):
    """A stand-in for a packing planner: every epoch deals the samples, shuffled, `cell`
    at a time to (step, rank) cells, so most cells hold several bucket shapes."""

    cell: int = 3

    def __call__(self, epoch: int) -> Plan:
        rng = np.random.default_rng([self.seed, epoch])
        samples = self.samples.iloc[rng.permutation(len(self.samples))]
        k = len(samples) // (self.cell * self.world_size) * self.cell * self.world_size
        cell = np.arange(k) // self.cell
        table = pd.DataFrame({
            "step": cell // self.world_size,
            "rank": cell % self.world_size,
            "sample_id": samples["sample_id"].to_numpy()[:k],
            "frames": samples["bucket_frames"].to_numpy()[:k],
            "height": samples["bucket_height"].to_numpy()[:k],
            "width": samples["bucket_width"].to_numpy()[:k],
            "tokens": samples["tokens"].to_numpy()[:k],
            "batch_id": cell,
            "is_padding": False,
        })
        table.attrs["plan"] = {"world_size": self.world_size}
        return Plan(table=table, summary={"plan_digest": f"mixed-{epoch}"})


def _mixed_run(tmp_path: Path, kernel: str) -> tuple:
    exp = experiment_config.load(
        write_experiment(tmp_path, model={"batch_layout": "packed"}, steps=3)
    )
    cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=3,
                          kernel=kernel)
    base = prepare_data(exp, cfg)
    builder = MixedCells(base.builder.samples, cfg.policy, base.builder.budgets, 3, cfg.seed)
    calibration = Calibration("wan2.1-micro", "cpu", "model", COST, p=1.4, m_mem=1e4, m_comp=1e6)
    data = TrainData(builder=builder, dataset=base.dataset, calibration=calibration)
    return cfg, data, builder(0).table


@pytest.mark.parametrize("kernel", ["eager", "fused"])
def test_a_plan_of_mixed_cells_trains_and_each_row_reports_its_cell(tmp_path, kernel):
    torch.set_num_threads(1)
    cfg, data, plan = _mixed_run(tmp_path, kernel)
    shapes = plan.groupby(["step", "rank"])[["frames", "height", "width"]].nunique()
    assert (shapes.max(axis=1) > 1).mean() > 0.5  # the test's plan does mix shapes

    trainer = Trainer(cfg, data, None, Ranks.emulated(3), progress=False)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    steps = result.steps
    assert len(steps) == cfg.steps * 3 and np.isfinite(steps["loss"].astype(float)).all()
    for row in steps.itertuples():
        cell = plan[(plan["step"] == row.step) & (plan["rank"] == row.rank)]
        largest = cell.loc[cell["tokens"].idxmax()]
        assert (row.samples, row.tokens) == (len(cell), cell["tokens"].sum())
        assert row.tokens_sq == (cell["tokens"] ** 2).sum()
        assert (row.frames, row.height, row.width) == tuple(largest[["frames", "height", "width"]])
        assert row.peak_bytes_model == pytest.approx(COST.set_memory(cell["tokens"]))
        assert row.peak_bytes_model == pytest.approx(
            COST.pack_memory(len(cell), cell["tokens"].sum())
        )


def test_the_gradient_of_a_mixed_step_is_the_mean_over_all_its_samples(tmp_path):
    torch.set_num_threads(1)
    cfg, data, plan = _mixed_run(tmp_path, "eager")
    trainer = Trainer(cfg, data, None, Ranks.emulated(3), progress=False)
    try:
        trainer.forward_backward(0)
        emulated = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
        model = trainer.model
        position = {sid: i for i, sid in enumerate(data.builder.samples["sample_id"])}
        losses = []
        for r in range(3):
            ids = plan[(plan["step"] == 0) & (plan["rank"] == r)]["sample_id"]
            batch = collate([data.dataset[position[sid]] for sid in ids])
            gen = step_generator(cfg.seed, 0, r)
            losses.append(per_sample_loss(model, list(batch.latents), batch.context,
                                          cfg.objective, gen))
        model.zero_grad(set_to_none=True)
        torch.cat(losses).mean().backward()
        reference = torch.cat([p.grad.flatten() for p in model.parameters()])
    finally:
        trainer.close()
    torch.testing.assert_close(emulated, reference, rtol=1e-5, atol=1e-7)


def test_the_run_tags_name_the_layout_and_backend_the_model_ran(tmp_path):
    """The layout and attention backend are chosen once (`TrainConfig.execution`): in a
    trained step the model dispatched to the backend the run's tags record (CPU: SDPA), and
    it refuses a micro-batch of the other layout."""
    torch.set_num_threads(1)
    for layout, want in (("dense", "sdpa"), ("packed", "sdpa-runs")):
        path = write_experiment(tmp_path, name=layout, model={"batch_layout": layout}, steps=2)
        exp = experiment_config.load(path)
        cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=1)
        trainer = Trainer(cfg, prepare_data(exp, cfg), None, Ranks.emulated(1), progress=False)
        try:
            assert trainer.model.attention_ran is None
            trainer.forward_backward(0)
        finally:
            trainer.close()
        tags = run_tags(cfg)
        assert (tags["batch_layout"], tags["attention_backend"]) == (layout, want)
        assert trainer.model.attention_ran == tags["attention_backend"]
        batch = collate([trainer.data.dataset[0]])
        other = batch.dense() if layout == "packed" else batch.latents
        with pytest.raises(ValueError, match=f"to a model that runs {layout} ones"):
            trainer.model(other, torch.zeros(1), batch.context)


def test_a_dense_run_refuses_a_plan_of_mixed_cells(tmp_path):
    cfg, _, plan = _mixed_run(tmp_path, "eager")
    dense = from_experiment(
        experiment_config.load(write_experiment(tmp_path, name="dense")), "adaptiveload", 0,
        launch_mode="emulated", world_size=3,
    )
    check_layout(plan, cfg, "x.yaml")  # packed: fine
    with pytest.raises(UserError) as info:
        check_layout(plan, dense, "x.yaml")
    message = str(info.value)
    assert message.startswith("x.yaml: field model.batch_layout is 'dense'")
    assert "set model.batch_layout: packed" in message and "\n" not in message
    homogeneous = prepare_data(experiment_config.load(write_experiment(tmp_path)), dense)
    check_layout(homogeneous.builder(0).table, dense, "x.yaml")  # one shape per cell: fine


def test_auto_layout_is_packed_for_a_policy_that_plans_packs(tmp_path):
    exp = experiment_config.load(write_experiment(tmp_path))
    assert exp["model"]["batch_layout"] == "auto"
    for policy in POLICIES:
        cfg = from_experiment(exp, policy, 0, launch_mode="emulated", world_size=2)
        want = "packed" if POLICIES[policy].packed else "dense"
        assert cfg.batch_layout == want, policy
        assert cfg.fingerprint() == replace(cfg, batch_layout=want).fingerprint()
    forced = experiment_config.load(write_experiment(tmp_path, model={"batch_layout": "packed"}))
    cfg = from_experiment(forced, "equal-token", 0, launch_mode="emulated", world_size=2)
    assert cfg.batch_layout == "packed"


def _train(exp: Path, out: Path, kernel: str, env: dict, *extra: str, policy="adaptiveload"):
    return adaptiveload(
        "train", "--config", str(exp), "--policy", policy, "--seed", "0",
        "--kernel", kernel, "--emulate-world-size", "2", "--out", str(out), *extra,
        env=env, cwd=ROOT, timeout=600,
    )


@pytest.mark.slow
def test_adaptiveload_train_runs_the_packing_planners_packs(tmp_path):
    """Policy adaptiveload-packed under `adaptiveload train` (layout auto, so packed): every
    row is the cell the plan made, most cells mix shapes; a dense layout is refused in one
    line naming the file and field, before anything is written."""
    exp_path = write_experiment(tmp_path, world_size=2, steps=3, checkpoint_every=3)
    env = cli_env()
    done = _train(exp_path, tmp_path / "run", "fused", env, "--no-track",
                  policy="adaptiveload-packed")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    exp = experiment_config.load(exp_path)
    cfg = from_experiment(exp, "adaptiveload-packed", 0, launch_mode="emulated", world_size=2)
    plan = prepare_data(exp, cfg).builder(0).table
    plan = plan.assign(tokens_sq=plan["tokens"] ** 2)
    cells = plan.groupby(["step", "rank"]).agg(
        samples=("tokens", "size"), tokens=("tokens", "sum"), tokens_sq=("tokens_sq", "sum"),
        shapes=("frames", "nunique"),
    )
    got = steps.set_index(["step", "rank"])[["samples", "tokens", "tokens_sq"]]
    want = cells.loc[got.index, ["samples", "tokens", "tokens_sq"]]
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    assert (cells["shapes"] > 1).mean() > 0.5
    assert read_json(tmp_path / "run" / "summary.json")["batch_layout"] == "packed"

    dense = write_experiment(tmp_path, name="dense", model={"batch_layout": "dense"},
                             world_size=2, steps=3)
    refused = _train(dense, tmp_path / "refused", "eager", env, "--no-track",
                     policy="adaptiveload-packed")
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert str(dense) in line and "model.batch_layout" in line and "packed" in line
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())


@pytest.mark.slow
def test_adaptiveload_train_packed_equals_dense_and_records_its_backend(tmp_path):
    """Today's plans (one shape per cell) through the packed path: same batches, same losses;
    the layout and the attention backend are tagged and summarised."""
    train = {"world_size": 2, "steps": 3, "checkpoint_every": 3}
    dense = write_experiment(tmp_path, name="dense", **train)
    packed = write_experiment(tmp_path, name="packed", model={"batch_layout": "packed"}, **train)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = cli_env(uri)
    assert adaptiveload("tracking", "init", env=env, cwd=ROOT).returncode == 0
    runs = {}
    for name, exp in (("dense", dense), ("packed", packed)):
        done = _train(exp, tmp_path / name, "eager", env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = pd.read_parquet(tmp_path / name / "steps.parquet")
    pd.testing.assert_frame_equal(runs["dense"][SAME], runs["packed"][SAME])
    pd.testing.assert_series_equal(runs["dense"]["loss"], runs["packed"]["loss"], rtol=1e-5,
                                   atol=0)

    summary = read_json(tmp_path / "packed" / "summary.json")
    assert (summary["batch_layout"], summary["attention_backend"]) == ("packed", "sdpa-runs")
    client = MlflowClient(uri)
    for name, backend in (("dense", "sdpa"), ("packed", "sdpa-runs")):
        (run,) = client.search_runs(client.get_experiment_by_name(name).experiment_id)
        assert run.data.tags["batch_layout"] == name
        assert run.data.tags["attention_backend"] == backend


@pytest.mark.slow
def test_torchrun_gloo_trains_packed_batches_like_emulated_ranks(tmp_path):
    """2 gloo processes (DDP) on the packing planner's packs with the fused op's CPU path:
    the same batches, losses and weights as 2 emulated ranks."""
    exp = write_experiment(tmp_path, world_size=2, steps=3, checkpoint_every=3)
    env = cli_env()
    emu = _train(exp, tmp_path / "emu", "fused", env, "--no-track", policy="adaptiveload-packed")
    assert emu.returncode == 0, emu.stderr[-3000:]
    dist = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "adaptiveload", "train", "--config", str(exp),
         "--policy", "adaptiveload-packed", "--seed", "0", "--kernel", "fused", "--no-track",
         "--out", str(tmp_path / "ddp")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert dist.returncode == 0, dist.stderr[-3000:]
    a = pd.read_parquet(tmp_path / "emu" / "steps.parquet")
    b = pd.read_parquet(tmp_path / "ddp" / "steps.parquet")
    pd.testing.assert_frame_equal(a[SAME], b[SAME])
    pd.testing.assert_series_equal(a["loss"], b["loss"], rtol=1e-5, atol=0)
    wa = torch.load(tmp_path / "emu" / "checkpoints" / "ckpt-00000003.pt", weights_only=False)
    wb = torch.load(tmp_path / "ddp" / "checkpoints" / "ckpt-00000003.pt", weights_only=False)
    assert wb["config"]["batch_layout"] == "packed"
    for name, tensor in wa["model"].items():
        torch.testing.assert_close(wb["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
