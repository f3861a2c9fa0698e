"""The held-out validation set and its score: what a run has learned, not how fast it ran.

The set is fixed per experiment: for every shape class of the training samples
(`tokens.SHAPE_CLASSES`: images, short clips, long clips) `per_class` samples at bucket shapes
drawn from that class's training samples (so each class's shape mix follows the data), under
ids no training sample has, so their content (`data.content`) is new to the model. Each is
scored by the training objective (`objective.per_sample_loss`) with noise and noise level
drawn from a generator seeded by its id alone: every run, policy and seed scores the same
samples at the same noise, so validation losses compare run to run without sampling noise of
their own. The loss of the set is the mean over its samples; per class the mean over the
class's (each class weighs `per_class` samples, whatever its share of the training data).

Scoring is forward-only, outside the timed spans of a step (`loop.Trainer` calls it between
steps). Emulated ranks score the whole set in the one process; distributed processes split it
(the same count each, so FSDP2's collectives line up) and gather the losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import pandas as pd
import torch

from adaptiveload.data.dataset import LatentDataset, sample_seed
from adaptiveload.data.packed import collate
from adaptiveload.errors import UserError
from adaptiveload.step_table import VAL_COLUMNS
from adaptiveload.tokens import SHAPE_CLASSES, shape_class
from adaptiveload.training import distributed as dd
from adaptiveload.training.objective import per_sample_loss
from adaptiveload.training.settings import ObjectiveConfig

VAL_SEED = 0  # the held-out set and its noise are the same for every run of an experiment
VAL_PREFIX = "val/"  # held-out ids: val/<shape class>/<i>
_BUCKET = ("bucket_frames", "bucket_height", "bucket_width")


def holdout(samples: pd.DataFrame, per_class: int) -> pd.DataFrame:
    """The held-out samples (sample_id and bucket shape columns, the input `LatentDataset`
    takes) for the bucketed training `samples`: `per_class` per shape class present."""
    rng = np.random.default_rng(VAL_SEED)
    classes = samples["bucket_frames"].map(shape_class)
    parts = []
    for name in SHAPE_CLASSES:
        pool = samples.loc[classes == name, list(_BUCKET)]
        if pool.empty:
            continue
        picked = pool.iloc[rng.integers(0, len(pool), per_class)].reset_index(drop=True)
        ids = [f"{VAL_PREFIX}{name}/{i}" for i in range(per_class)]
        parts.append(picked.assign(sample_id=ids))
    held = pd.concat(parts, ignore_index=True)
    clash = set(held["sample_id"]) & set(samples["sample_id"].astype(str))
    if clash:
        raise UserError(
            f"manifest: sample_id {sorted(clash)[0]!r} is a held-out validation id; "
            f"rename the samples whose ids start with {VAL_PREFIX!r}, or set train.val_every: 0"
        )
    return held[["sample_id", *_BUCKET]]


class Validator:
    """Scores one held-out set (`holdout`, as a LatentDataset of the run's content)."""

    def __init__(self, dataset: LatentDataset, objective: ObjectiveConfig) -> None:
        self.dataset, self.objective = dataset, objective
        self.classes = [shape_class(int(frames)) for frames, _, _ in dataset.shapes]

    def _loss(
        self, model: torch.nn.Module, index: int, device: torch.device, packed: bool
    ) -> float:
        item = self.dataset[index]
        batch = collate([item]).to(device, next(model.parameters()).dtype)
        gen = torch.Generator().manual_seed(sample_seed(item["sample_id"], VAL_SEED, "val"))
        x0 = batch.inputs(packed)  # one sample: the same loss in either layout
        return float(per_sample_loss(model, x0, batch.context, self.objective, gen)[0])

    def score(
        self,
        model: torch.nn.Module,
        ranks: dd.Ranks,
        device: torch.device,
        autocast: Callable[[], AbstractContextManager],
        packed: bool,
    ) -> dict[str, float | None]:
        """The `VAL_COLUMNS` of the model as it is now: the set's mean loss and each shape
        class's (None for a class the data lack). `packed`: the run's layout, which the
        model takes (`Execution.packed`)."""
        n = len(self.dataset)
        procs = ranks.world_size if ranks.distributed else 1
        share = math.ceil(n / procs)  # the same count on every process (the last repeats)
        first = ranks.process_rank * share
        mine = [min(i, n - 1) for i in range(first, first + share)]
        net = model if dd.is_fsdp(model) else dd.unwrap(model)
        with torch.no_grad(), autocast():
            local = {i: self._loss(net, i, device, packed) for i in mine}
        losses: dict[int, float] = {}
        for part in dd.all_gather(local, ranks):
            losses.update(part)
        values = np.array([losses[i] for i in range(n)])
        classes = np.array(self.classes)
        out: dict[str, float | None] = {VAL_COLUMNS[0]: float(values.mean())}
        for name, column in zip(SHAPE_CLASSES, VAL_COLUMNS[1:], strict=True):
            own = values[classes == name]
            out[column] = float(own.mean()) if own.size else None
        return out
