"""The per-step table and its timed window: what a training run and a simulation both write
and which of its steps every metric is computed over.

One row per (step, rank). The trainer (`training.loop`) and the simulator
(`planning.simulate`) write it, the run summary (`training.summary`, the simulator's) and the
analysis (`analysis.aggregate`) read it; this module sits below all of them so that none has
to import another to know the columns or the window.

The timed window is the steps from `warmup_steps` on. With ``train.steps: epoch``
(`WHOLE_EPOCH`) the warm-up replays the epoch's first batches and the window is exactly one
whole epoch, so every policy's window processes the same samples (docs/measurement.md).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from adaptiveload.errors import UserError
from adaptiveload.tokens import SHAPE_CLASSES

# Learning, on a measured run's rows: samples_seen, the real samples (padding repeats left out,
# by the plan's `is_padding`) of all ranks up to and including the step; val_loss, the
# flow-matching loss of the fixed held-out set after the step's update (every
# `train.val_every` steps and at each epoch's end, outside the timed window; empty
# otherwise), over all of it and per shape class (`tokens.SHAPE_CLASSES`)
VAL_COLUMNS = ("val_loss", *(f"val_loss_{name}" for name in SHAPE_CLASSES))
# compute_s / step_time_s: by the run's timer (a prediction in a simulation); compute_wall_s /
# step_wall_s: by the wall clock beside it (measured runs only, empty in a simulation).
# samples, tokens, tokens_sq: n, sum S and sum S^2 of the rank's micro-batch (what its cost
# depends on); frames, height, width: the bucket shape of its largest sample (of all of them
# unless the micro-batch is a pack of several shapes); lower_bound_s: the step's compute lower
# bound (`CostModel.step_lower_bound` of its samples; a simulation's, empty in a measured run);
# padding_samples, padding_tokens: how many of the micro-batch's samples (and their tokens) are
# padding repeats (plan.py, step 4), so that throughput counts each real sample once
# (`real_counts`): samples - padding_samples are the real ones
# host_load_1m: the host's 1-minute load average at the step's end (measured runs; empty in a
# simulation): how busy the machine was, which moves even thread CPU time a little
# (docs/measurement.md), so that the analysis can show how much an effect depends on it
STEP_COLUMNS = (
    "step", "rank", "compute_s", "compute_wall_s", "wait_s", "samples", "tokens", "tokens_sq",
    "frames", "height", "width", "peak_bytes", "peak_bytes_model", "loss", "step_time_s",
    "step_wall_s", "lower_bound_s", "padding_samples", "padding_tokens", "samples_seen",
    "host_load_1m", *VAL_COLUMNS,
)
# a measured run's load of each micro-batch (training.reader), on the run's timer: load_s the
# fetch's own time (the worker's where it was prefetched) and the copy to the device;
# load_exposed_s the part the step waited for, which it adds to the rank's compute (the rest
# was hidden behind compute). Trainer tables only: a simulation loads nothing
LOAD_COLUMNS = ("load_s", "load_exposed_s")
# the column of the sequence-parallel degree of a micro-batch's group (planning.groups,
# docs/sequence_parallel.md): in a plan table a row's micro-batch runs on ranks rank ..
# rank + sp_degree - 1 of its step, `rank` the group's first rank; in a per-step table each
# rank's row carries its group's degree, and a group's samples, tokens and loss count once,
# on its first rank's row (its other ranks' rows hold their own times and no samples).
# Present only where some group has d > 1, so tables without groups are as they were
SP_DEGREE = "sp_degree"
# the closed loop's columns (`training.refine`, train.refine not off), on the rows of the step
# that ends a window (empty on the others): refit 1.0; model_error_median / _p90 of
# |predicted - measured| / measured over the window's micro-batches by the coefficients that
# planned it (measured times against the model); window_imbalance, the mean over the
# window's steps of imbalance_rate (measured); refit_moved, the median relative change of the
# window's predictions by the refit (model); speed_factor, the rank's refitted speed (its time
# is the model's over it); refit_<c>, the refitted time coefficients (REFIT_COEFFICIENTS)
REFIT_COEFFICIENTS = ("c0", "c_seq", "a", "b", "t_floor")
REFINE_COLUMNS = (
    "refit", "model_error_median", "model_error_p90", "window_imbalance", "refit_moved",
    "speed_factor", *(f"refit_{c}" for c in REFIT_COEFFICIENTS),
)
# the columns a table must have to be analysed; a producer may leave the others out
REQUIRED_STEP_COLUMNS = (
    "step",
    "rank",
    "compute_s",
    "samples",
    "tokens",
    "step_time_s",
    "padding_samples",
    "padding_tokens",
)

# `train.steps: epoch`: after the warm-up, time exactly one whole epoch
WHOLE_EPOCH = "epoch"


def run_steps(steps: int | str, warmup_steps: int, epoch_steps: int) -> int:
    """The steps a training run executes: `steps` itself, or for ``steps: epoch`` the warm-up
    (which replays the epoch's first batches) followed by all `epoch_steps` steps of the
    whole epochs it trains (epoch 0 on, `train.epochs` of them).

    Whole epochs make the policies comparable sample for sample: each one's timed window
    processes the same samples (the whole dataset), in however many steps its plan needs.
    """
    if steps == WHOLE_EPOCH:
        return warmup_steps + epoch_steps
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise UserError(f"train.steps {steps!r}: expected a step count or '{WHOLE_EPOCH}'")
    return steps


def window_kind(steps: int | str) -> str:
    """The run summary's `timed_window`: "epoch" when the timed steps are one whole epoch
    (every policy then processes the same samples), "steps" for a fixed number of steps."""
    return WHOLE_EPOCH if steps == WHOLE_EPOCH else "steps"


# the per-step MLflow metric of training runs and simulations that tells warm-up steps (1.0)
# from the timed window (0.0): a chart of it beside any other per-step chart shows which is which
WARMUP_KEY = "warmup"


def timed(step: pd.Series | np.ndarray, warmup_steps: int) -> pd.Series | np.ndarray:
    """Which rows (or step indices) lie in the timed window: the steps from `warmup_steps` on."""
    return step >= warmup_steps


def real_counts(table: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(real samples, real tokens) of each row of a per-step table: what its micro-batch held
    less its padding repeats. Throughput counts these (docs/definitions.md): a repeat is work
    the ranks do, not data they train on."""
    return (
        table["samples"] - table["padding_samples"],
        table["tokens"] - table["padding_tokens"],
    )
