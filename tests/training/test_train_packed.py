"""Packed micro-batches in the trainer: a plan whose cells mix bucket shapes trains, each row
reports its cell (samples = segments, tokens = sum S_i, the largest sample's shape,
peak_bytes_model = pack_memory), the step's gradient is the mean over all its samples; under
`adaptiveload train` the packed layout trains like the dense one (emulated and torchrun with
gloo, eager and fused); a dense run refuses mixed cells."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from training_setup import write_experiment

from adaptiveload import experiment as experiment_config
from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.data.packed import collate
from adaptiveload.errors import UserError
from adaptiveload.planning.plan import Plan
from adaptiveload.planning.policies import POLICIES
from adaptiveload.planning.sampler import PlanBuilder
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import check_layout, prepare_data
from adaptiveload.training.loop import TrainData, Trainer
from adaptiveload.training.objective import per_sample_loss, step_generator
from adaptiveload.training.session import run_tags
from adaptiveload.training.settings import from_experiment

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
