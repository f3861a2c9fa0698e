"""From an experiment dict to what the loop consumes: bucketed samples, plan builder, dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.dataset import LatentDataset
from adaptiveload.data.manifest import load_manifest
from adaptiveload.data.mixtures import synthesize
from adaptiveload.model.configs import get_config
from adaptiveload.planning.policies import Budgets
from adaptiveload.planning.sampler import PlanBuilder
from adaptiveload.training.config import TrainConfig
from adaptiveload.training.loop import TrainData

DATA_SEED = 0  # the dataset is fixed per experiment; the run seed varies plan, init and noise


def prepare_data(
    exp: dict[str, Any],
    cfg: TrainConfig,
    calibration: Calibration | None = None,
    manifest: Path | None = None,
) -> TrainData:
    """A user manifest (or the experiment's named mixture), bucketized and planned."""
    data = exp["data"]
    manifest = manifest or data["manifest"]
    frame = (
        load_manifest(manifest)
        if manifest
        else synthesize(data["mixture"], data["num_samples"], DATA_SEED)
    )
    bucketed = bucketize(
        frame, mode=data["bucketing"], grid=data["grid"], max_frames=data["max_frames"]
    )
    samples = bucketed.samples.reset_index(drop=True)
    budgets = Budgets.resolve(**exp["budgets"], calibration=calibration)
    builder = PlanBuilder(
        samples, cfg.policy, budgets, cfg.world_size, cfg.seed, cost_model=calibration,
        num_excluded=int(bucketed.num_excluded),
    )  # fmt: skip
    builder(0)  # plan epoch 0 now: a missing or bad budget fails before any output
    mcfg = get_config(cfg.model)
    dataset = LatentDataset(
        samples,
        latent_channels=mcfg.in_dim,
        text_len=mcfg.text_len,
        text_dim=mcfg.text_dim,
        seed=DATA_SEED,
    )
    return TrainData(builder=builder, dataset=dataset, calibration=calibration)
