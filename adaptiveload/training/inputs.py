"""From an experiment dict to what the loop consumes: bucketed samples, plan builder, dataset."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
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
from adaptiveload.planning.sampler import PlanBuilder, PlanWarning
from adaptiveload.provenance import code_version
from adaptiveload.training.finetune import check_calibration
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
    check_calibration(cfg.lora, calibration)  # a LoRA run planned with full training's costs
    data = exp["data"]
    manifest = manifest or data["manifest"]
    frame = (
        load_manifest(manifest)
        if manifest
        else synthesize(data["mixture"], data["num_samples"], DATA_SEED)
    )
    frame, held_out = split_holdout(frame, data["val_split"], manifest, cfg.val_every)
    bucketed = bucketize(
        frame, mode=data["bucketing"], grid=data["grid"], max_frames=data["max_frames"],
        short_clips=data["short_clips"],
    )
    samples = bucketed.samples.reset_index(drop=True)
    check_cached_shapes(samples, manifest)
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
    cached = builder.samples["latent_path"].notna().any()
    if cfg.val_every > 0 and cached and held_out is None:
        raise UserError(
            f"train.val_every: {cfg.val_every} on {manifest}, a manifest of cached latents, "
            "without data.val_split: the held-out samples would be synthetic, not of your "
            "data; name the manifest's held-out split in data.val_split (adaptiveload "
            "manifest import --val-fraction makes one), or set train.val_every: 0"
        )

    def dataset_of(frame: pd.DataFrame, dropout: float = 0.0) -> LatentDataset:
        return LatentDataset(
            frame,
            latent_channels=mcfg.in_dim,
            text_len=mcfg.text_len,
            text_dim=mcfg.text_dim,
            seed=DATA_SEED,
            content=data["content"],
            root=root,
            caption_dropout=dropout,
            empty_text=data["empty_text"],
        )

    validation = None
    if cfg.val_every > 0:  # the user's held-out split, or the synthetic set of the mixture
        held = (
            holdout(builder.samples, cfg.val_per_class) if held_out is None
            else _bucketed_holdout(held_out, data, manifest)
        )
        validation = Validator(dataset_of(held), cfg.objective)
    # without the samples over the device's capacity (the builder took them out)
    return TrainData(
        builder, dataset_of(builder.samples, data["caption_dropout"]), calibration, validation
    )


def split_holdout(
    frame: pd.DataFrame, split: str | None, manifest: Path | str | None, val_every: int | None
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(the rows to train on, the held-out rows of `split` or None): `data.val_split` names
    a value of the manifest's `split` column; its rows are never trained on. `val_every`
    None: the caller scores nothing (`adaptiveload plan`), so no warning that nothing will."""
    if split is None:
        return frame, None
    if "split" not in frame.columns:
        raise UserError(
            f"{manifest}: data.val_split is {split!r} but the manifest has no split column; "
            "import the cache with --val-fraction, or add a split column"
        )
    held = (frame["split"].astype("str") == split).to_numpy()
    if not held.any() or held.all():
        what = "no" if not held.any() else "every"
        raise UserError(
            f"{manifest}: data.val_split {split!r} matches {what} row of the split column "
            f"(values: {', '.join(map(str, sorted(frame['split'].dropna().unique())))}); "
            "name the held-out split"
        )
    if val_every == 0:
        warnings.warn(
            f"data.val_split {split!r}: {int(held.sum())} samples are held out but "
            "train.val_every is 0, so nothing scores them", PlanWarning, stacklevel=2,
        )
    return frame[~held].reset_index(drop=True), frame[held].reset_index(drop=True)


def _bucketed_holdout(
    held: pd.DataFrame, data: dict[str, Any], manifest: Path | str | None
) -> pd.DataFrame:
    out = bucketize(held, mode=data["bucketing"], grid=data["grid"],
                    max_frames=data["max_frames"]).samples.reset_index(drop=True)
    if out.empty:
        raise UserError(f"{manifest}: no sample of data.val_split {data['val_split']!r} fits a "
                        "bucket; hold out other samples")
    check_cached_shapes(out, manifest)
    return out


def check_cached_shapes(samples: pd.DataFrame, manifest: Path | str | None) -> None:
    """UserError unless every cached sample's bucket shape is its own shape: a cached latent
    cannot be resized, so a bucket that is not its shape fails when it is read (mid-run)."""
    if "latent_path" not in samples.columns or samples["latent_path"].isna().all():
        return
    own = samples[["num_frames", "height", "width"]].to_numpy()
    bucket = samples[["bucket_frames", "bucket_height", "bucket_width"]].to_numpy()
    bad = np.flatnonzero((own != bucket).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise UserError(
            f"{manifest}: cached sample {samples['sample_id'].iloc[i]!r} of shape "
            f"{own[i].tolist()} (frames, height, width) lands in bucket {bucket[i].tolist()} "
            f"({bad.size} such samples); a cached latent cannot be resized: set data.bucketing: "
            "exact and data.max_frames at least the longest clip"
        )


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
