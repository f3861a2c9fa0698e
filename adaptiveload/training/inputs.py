"""From an experiment dict to what the loop consumes: bucketed samples, plan builder, dataset."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd

from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.dataset import LatentDataset
from adaptiveload.data.manifest import load_manifest
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.io import read_json
from adaptiveload.model.architectures import get_config
from adaptiveload.planning.plan import plan_difference
from adaptiveload.planning.policies import Budgets
from adaptiveload.planning.sampler import PlanBuilder
from adaptiveload.provenance import code_version
from adaptiveload.training.loop import TrainData
from adaptiveload.training.settings import TrainConfig
from adaptiveload.training.validation import Validator, holdout

DATA_SEED = 0  # the dataset is fixed per experiment; the run seed varies plan, init and noise


def prepare_data(
    exp: dict[str, Any],
    cfg: TrainConfig,
    calibration: Calibration | None = None,
    manifest: Path | None = None,
    plan: Path | None = None,
) -> TrainData:
    """A user manifest (or the experiment's named mixture), bucketized and planned; with
    `plan` (a plan summary JSON), checked to be the plan that file describes."""
    data = exp["data"]
    manifest = manifest or data["manifest"]
    frame = (
        load_manifest(manifest)
        if manifest
        else synthesize(data["mixture"], data["num_samples"], DATA_SEED)
    )
    bucketed = bucketize(
        frame, mode=data["bucketing"], grid=data["grid"], max_frames=data["max_frames"],
        short_clips=data["short_clips"],
    )
    samples = bucketed.samples.reset_index(drop=True)
    budgets = Budgets.resolve(**exp["budgets"], calibration=calibration)
    builder = PlanBuilder(
        samples, cfg.policy, budgets, cfg.world_size, cfg.seed, cost_model=calibration,
        steps_per_epoch=exp["plan"]["steps_per_epoch"], num_excluded=int(bucketed.num_excluded),
        excluded_ids=bucketed.excluded_ids.tolist(),
    )
    epoch0 = builder(0)  # plan epoch 0 now: a missing or bad budget fails before any output
    if plan is not None:
        check_plan(plan, epoch0.summary)
    mcfg = get_config(cfg.model)
    root = data["root"] or (Path(manifest).parent if manifest else None)
    if cfg.val_every > 0 and builder.samples["latent_path"].notna().any():
        raise UserError(
            f"train.val_every: {cfg.val_every} on {manifest}, a manifest of cached latents: its "
            f"held-out samples would be synthetic ({data['content']}), not of your data; set "
            "train.val_every: 0 (a held-out split of a manifest is not supported yet)"
        )

    def dataset_of(frame: pd.DataFrame) -> LatentDataset:
        return LatentDataset(
            frame,
            latent_channels=mcfg.in_dim,
            text_len=mcfg.text_len,
            text_dim=mcfg.text_dim,
            seed=DATA_SEED,
            content=data["content"],
            root=root,
        )

    validation = (
        Validator(dataset_of(holdout(builder.samples, cfg.val_per_class)), cfg.objective)
        if cfg.val_every > 0
        else None
    )
    # without the samples over the device's capacity (the builder took them out)
    return TrainData(builder, dataset_of(builder.samples), calibration, validation)


def check_plan(path: Path, planned: dict[str, Any]) -> None:
    """UserError unless `path` (the summary JSON of `adaptiveload plan`, as the pipeline
    writes it) describes the epoch-0 plan this run made (`planned`, its summary): same
    `plan_digest`. Planning is deterministic, so the trainer plans again and compares rather
    than reading the table; a plan of other inputs (calibration, budgets, world size, data)
    would otherwise be reported beside measurements of another."""
    given = read_json(path, "plan summary")
    if not isinstance(given, dict) or "plan_digest" not in given:
        raise UserError(
            f"{path}: no field plan_digest; pass the --summary JSON of `adaptiveload plan`"
        )
    if given["plan_digest"] == planned["plan_digest"]:
        return
    field, theirs, ours = plan_difference(given, planned)
    raise UserError(
        f"{path}: field {field} is {theirs!r} but this run plans {ours!r} "
        "(another calibration, config, manifest or world size); plan again with this run's "
        "inputs, or train without --plan"
    )


def check_layout(plan: pd.DataFrame, cfg: TrainConfig, origin: str | Path) -> None:
    """UserError unless the run's batch layout can hold the plan's micro-batches: a dense
    micro-batch is one [B, C, T', H', W'] tensor, so a cell of several bucket shapes needs
    the packed layout (`origin`: the experiment file, named in the message)."""
    if cfg.execution.packed or plan.empty:
        return
    # two shapes differ in frames, height or width: a cell mixes shapes iff a column varies
    varies = plan.groupby(["step", "rank"])[["frames", "height", "width"]].nunique().max(axis=1)
    if varies.max() > 1:
        step, rank = varies.idxmax()
        raise UserError(
            f"{origin}: field model.batch_layout is 'dense' but policy {cfg.policy} plans "
            f"micro-batches of several bucket shapes (the first at step {step}, rank {rank}); "
            "set model.batch_layout: packed"
        )


def run_identity(cfg: TrainConfig, data: TrainData) -> dict[str, str]:
    """Everything that determines a run's results, each part hashed; `identity` hashes them
    all. A checkpoint is resumed only by a run of the same identity, so a changed budget,
    calibration, manifest, plan or code version reruns from step 0 instead of re-emitting
    the old run's numbers. (`steps` is left out: a longer run continues a shorter one.)"""
    calibration = data.calibration.to_dict() if data.calibration else None
    samples = pd.util.hash_pandas_object(data.builder.samples, index=False).to_numpy()
    parts = {
        "config": cfg.fingerprint(),
        "budgets": _sha(json.dumps(data.builder.budgets.as_dict(), sort_keys=True)),
        "calibration": _sha(json.dumps(calibration, sort_keys=True, default=str)),
        "data": _sha(samples.tobytes() + data.dataset.content.encode()),
        "plan": str(data.builder(0).summary["plan_digest"]),
        "code": code_version(),
    }
    return {**parts, "identity": _sha(json.dumps(parts, sort_keys=True))}


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]
