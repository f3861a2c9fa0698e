"""`train.refine`: the closed loop in the trainer (docs/closed_loop.md).

The trainer already times every micro-batch; with ``train.refine`` set it also learns from
those times. After every timed step it hands the step's rows (every rank's: emulated ranks
have them in one process, under torchrun the loop's all-gather gives each process all of
them) to the run's `Replanner`. At each window's end (``epoch``: an epoch's last step;
``every: K``: every K timed steps and each epoch's last) it

1. measures how wrong the coefficients that planned the window were: per micro-batch
   |predicted - measured| / measured, its median and 90th percentile over the window;
2. refits the cost model from every row measured so far against the prior (the
   calibration's), identically on every rank (the same rows, a deterministic fit);
3. replans what the samplers have not handed out yet: the epoch's remaining samples, each
   once, in its remaining steps (or the next epoch, at an epoch's end);
4. writes the window's numbers on the step's rows (`REFINE_COLUMNS`: the error, the refitted
   coefficients, each rank's speed factor, how far the refit moved the window's predictions)
   and returns one progress line.

Warm-up steps (a first-step compile, caches filling) are neither observed nor counted in a
window. The rows and refits travel in the checkpoint (`state_dict`), so a resumed run
replans exactly as the uninterrupted one; `record()` is every refit's calibration, from which
`Replanner.switch` replays a run's plans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration, SequenceParallel
from adaptiveload.errors import UserError
from adaptiveload.planning.replan import ROW_COLUMNS, Refit, Replanner, Switch
from adaptiveload.planning.sampler import PlanBatchSampler, PlanBuilder
from adaptiveload.step_table import REFINE_COLUMNS, REFIT_COEFFICIENTS, SP_DEGREE

if TYPE_CHECKING:
    from adaptiveload.training.settings import TrainConfig

OFF, EPOCH = "off", "epoch"


def refine_mode(value: Any) -> str | int:
    """`train.refine` as the run holds it: "off", "epoch" or K (every K timed steps). YAML
    reads a bare ``off`` as false, which means off too."""
    if value is False or value == OFF:
        return OFF
    if value == EPOCH:
        return EPOCH
    every = value.get("every") if isinstance(value, Mapping) else value
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise UserError(
            f"train.refine {value!r}: expected off, epoch or {{every: K}} with K >= 1 steps"
        )
    return int(every)


def check_refine(cfg: TrainConfig, calibration: Any) -> None:
    """UserError unless the run can close its loop: a refit needs a calibration (the prior)."""
    if cfg.refine != OFF and not isinstance(calibration, Calibration):
        raise UserError(
            f"train.refine {cfg.refine!r}: the closed loop refits a calibration and this run "
            "has none; give calibration.file (or --calibration), or set refine: off"
        )


def speed_factors(calibration: Calibration, world_size: int) -> np.ndarray:
    """Each rank's speed factor in `calibration` (`Calibration.rank_speeds`: a rank's time is
    the model's over its factor; 1 where the calibration has none)."""
    speeds = calibration.rank_speeds
    out = np.ones(world_size)
    if speeds:
        out[: min(len(speeds), world_size)] = speeds[:world_size]
    return out


def predicted_s(calibration: Calibration, rows: pd.DataFrame) -> np.ndarray:
    """The calibration's compute time of each measured row's micro-batch on its rank (rows of
    a micro-batch's samples: a group's first rank; at degree d with the group's all-to-alls,
    `SequenceParallel.cost_at`)."""
    n, s, s2 = (rows[c].to_numpy(np.float64) for c in ("samples", "tokens", "tokens_sq"))
    degree = rows[SP_DEGREE].to_numpy(np.int64)
    out = np.empty(len(rows))
    for d in np.unique(degree):
        at = degree == d
        cost = calibration.cost
        if d > 1:
            cost = SequenceParallel.of(calibration).cost_at(cost, int(d))
        out[at] = cost.pack_time(n[at], s[at], s2[at])
    ranks = rows["rank"].to_numpy(np.int64)
    return out / speed_factors(calibration, int(ranks.max()) + 1)[ranks]


def model_error(calibration: Calibration, rows: pd.DataFrame) -> tuple[float, float]:
    """(median, 90th percentile) of |predicted - measured| / measured over the micro-batches
    of `rows` (a group's on its first rank's row)."""
    rows = rows[rows["samples"].to_numpy() > 0]
    measured = rows["compute_s"].to_numpy(np.float64)
    err = np.abs(predicted_s(calibration, rows) - measured) / measured
    return float(np.median(err)), float(np.percentile(err, 90))


class ClosedLoop:
    """The run's closed loop: its Replanner (the samplers' plan source) and its windows."""

    def __init__(
        self, mode: str | int, builder: PlanBuilder, warmup_steps: int, refit: Refit | None = None
    ) -> None:
        self.mode, self.warmup_steps = mode, warmup_steps
        self.plans = Replanner(builder, refit)
        self.window_from = warmup_steps  # the run step the current window began at

    @classmethod
    def of(
        cls, cfg: TrainConfig, builder: PlanBuilder, refit: Refit | None = None
    ) -> ClosedLoop | None:
        """The run's closed loop; None with ``train.refine: off``."""
        check_refine(cfg, builder.cost_model)
        if cfg.refine == OFF:
            return None
        return cls(cfg.refine, builder, cfg.warmup_steps, refit)

    def after_step(
        self, step: int, rows: list[dict[str, Any]], samplers: Sequence[PlanBatchSampler]
    ) -> str | None:
        """Observe run step `step`'s rows (one per rank, every rank's); at a window's end,
        refit and replan (module docstring) and write the window on the rows. Returns the
        progress line of a refit, else None."""
        for row in rows:
            row.update(dict.fromkeys(REFINE_COLUMNS))
        if step < self.warmup_steps:
            return None
        frame = pd.DataFrame(rows)
        if SP_DEGREE not in frame.columns:
            frame[SP_DEGREE] = 1
        self.plans.observe(frame[list(ROW_COLUMNS)])  # a group's other ranks' rows too
        position = samplers[0].state_dict()
        at_end = position["step"] == position["num_steps"]
        timed = step + 1 - self.warmup_steps
        if not (at_end or (self.mode != EPOCH and timed % int(self.mode) == 0)):
            return None
        return self._refit(step, rows, samplers)

    def _refit(
        self, step: int, rows: list[dict[str, Any]], samplers: Sequence[PlanBatchSampler]
    ) -> str:
        observed = self.plans.rows
        window = observed[observed["step"].to_numpy() >= self.window_from]
        epoch = samplers[0].epoch
        before = self.plans.calibration_at(epoch, samplers[0].state_dict()["step"])
        error = model_error(before, window)
        made: Switch = samplers[0].refine()
        for sampler in samplers[1:]:  # emulated ranks: the same refit, each follows it
            sampler.refine()
        samplers[0].check_ranks()  # torchrun: every process replanned alike (else it stops)
        after = made.calibration
        residual = model_error(after, window)
        lead = window[window["samples"].to_numpy() > 0]
        old, new = predicted_s(before, lead), predicted_s(after, lead)
        moved = float(np.median(np.abs(new - old) / old))
        compute = window.pivot_table(index="step", columns="rank", values="compute_s")
        imbalance = metrics.imbalance_rate(compute.to_numpy())
        factors = speed_factors(after, len(rows))
        coefficients = {k: float(getattr(after.cost, k)) for k in REFIT_COEFFICIENTS}
        for row in rows:
            row.update(
                refit=1.0,
                model_error_median=error[0],
                model_error_p90=error[1],
                refit_moved=moved,
                window_imbalance=imbalance,
                speed_factor=float(factors[row["rank"]]),
                **{f"refit_{k}": v for k, v in coefficients.items()},
            )
        self.window_from = step + 1
        where = (
            f"epoch {made.epoch} from step {made.step}"
            if made.replanned
            else f"epoch {made.epoch} kept its plan (its step count), later epochs"
        )
        slow = int(np.argmin(factors))
        return (
            f"refit after step {step} on {len(observed)} micro-batches: model error median "
            f"{error[0]:.1%} p90 {error[1]:.1%} -> {residual[0]:.1%} / {residual[1]:.1%} "
            f"(measured, this window); predictions moved {moved:.1%}; slowest rank {slow} at "
            f"{factors[slow]:.2f}x; window imbalance {imbalance:.1%}; replanned {where}"
        )

    def record(self) -> list[dict[str, Any]]:
        """Every refit: where it took effect, the rows it used and its calibration (what
        `Replanner.switch` replays a run's plans from)."""
        return [s.to_dict() for s in self.plans.switches]

    def state_dict(self) -> dict[str, Any]:
        return {**self.plans.state_dict(), "window_from": self.window_from}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.plans.load_state_dict(state)
        self.window_from = int(state["window_from"])
