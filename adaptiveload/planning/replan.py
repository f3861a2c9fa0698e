"""Plans that follow the run: the rest of an epoch replanned from a cost model refitted on
what the run measured (the closed loop, docs/closed_loop.md).

A `Replanner` is a plan source like a `PlanBuilder` (``replanner(epoch)`` is that epoch's
plan, on any rank) that also keeps the run's measured micro-batch rows (``observe``) and its
refits (``refine``). A refit at step k of epoch e fits the cost model from ALL rows observed
so far against the prior (the builder's calibration; the fit itself is the `refit` callable,
by default `adaptiveload.costmodel.refit.refine`), so each refit is a pure function of the prior and
the rows: every rank that holds the same rows computes the same coefficients, and a run that
resumes from a checkpoint holding the rows replans exactly as it would have.

How an epoch is replanned (``splice``):
- the steps before k keep their micro-batches: their real samples are consumed;
- the samples not yet consumed (the rest of the epoch's set: each exactly once) are planned
  with the refitted model for the K - k steps left, K the open-loop plan's step count, so
  the epoch keeps its length (the run's step count, its learning-rate schedule and the
  comparison of policies at equal steps are unchanged);
- the plan of steps k.. is that plan, shifted to begin at step k.
A refit at an epoch's end plans the next epoch whole from step 0 with it; later epochs are
planned with the latest refit (still at the open-loop plan's step count). A policy that
cannot keep the step count for the rest (its plan of the remaining samples has another count)
keeps its current plan for the rest of the epoch, and the refit says so (``replanned``).

A replanned epoch's summary names what it was planned with: ``refits`` lists each switch
(step, ``cost_digest`` of the coefficients) and its ``plan_digest`` chains the switches, so
two runs with the same digest ran the same plans; a rerun that replays the logged
calibrations with ``switch`` reproduces every plan.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload.costmodel import Calibration
from adaptiveload.costmodel.refit import refine
from adaptiveload.errors import UserError
from adaptiveload.planning.plan import PREDICTED, Plan
from adaptiveload.planning.sampler import PlanBuilder, PlanWarning, _outside_the_package
from adaptiveload.step_table import SP_DEGREE

# the columns of a measured micro-batch row a refit reads (the per-step table's names)
ROW_COLUMNS = ("step", "rank", "compute_s", "samples", "tokens", "tokens_sq", SP_DEGREE)
# a refit: (prior calibration, measured rows with ROW_COLUMNS) -> refitted calibration
Refit = Callable[[Calibration, pd.DataFrame], Calibration]


def cost_digest(calibration: Calibration | None) -> str | None:
    """A short hash of everything a plan reads from a calibration (its coefficients, budgets,
    capacity and any per-rank speed factors): plans built from two calibrations with one
    digest are the same."""
    if calibration is None:
        return None
    text = json.dumps(_canonical(calibration.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _canonical(value: Any) -> Any:
    """Numbers as floats (a file's 40000 and a fit's 40000.0 are one coefficient)."""
    if isinstance(value, Mapping):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return float(value)
    return value


@dataclass(frozen=True)
class Switch:
    """A refit taking effect: from step `step` of epoch `epoch` on, plans use `calibration`;
    fitted on the first `rows` observed rows (None: given, not fitted: a replay)."""

    epoch: int
    step: int
    calibration: Calibration
    rows: int | None = None
    replanned: bool = True  # False: the policy could not keep the step count; plan kept

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (a checkpoint is read with weights_only)."""
        out = asdict(self)
        out["calibration"] = self.calibration.to_dict()
        out["cost_digest"] = cost_digest(self.calibration)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Switch:
        cal = Calibration.from_dict(dict(data["calibration"]), origin="closed-loop state")
        return cls(int(data["epoch"]), int(data["step"]), cal, data["rows"], data["replanned"])


class Replanner:
    """Epoch -> Plan, like its `builder`, whose plans follow the refits (module docstring).

    Shared by every sampler of one process (emulated ranks): a refit asked for again at the
    same point with no new rows is the one already made."""

    def __init__(self, builder: PlanBuilder, refit: Refit | None = None) -> None:
        if not isinstance(builder.cost_model, Calibration):
            raise ValueError(
                "a closed loop refits a calibration: build the PlanBuilder with "
                "cost_model=Calibration (a CostModel alone has no budgets to keep)"
            )
        self.builder = builder
        self.refit = refit or partial(refine, world_size=builder.world_size)
        self.switches: list[Switch] = []
        self._rows: list[pd.DataFrame] = []
        self._cache: dict[int, Plan] = {}

    # what a sampler reads of a PlanBuilder
    @property
    def samples(self) -> pd.DataFrame:
        return self.builder.samples

    @property
    def world_size(self) -> int:
        return self.builder.world_size

    @property
    def steps_per_epoch(self) -> str | int:
        return self.builder.steps_per_epoch

    @property
    def prior(self) -> Calibration:
        return self.builder.cost_model

    @property
    def rows(self) -> pd.DataFrame:
        """Every measured row observed so far, in the order observed."""
        if not self._rows:
            return pd.DataFrame(columns=list(ROW_COLUMNS))
        if len(self._rows) > 1:
            self._rows = [pd.concat(self._rows, ignore_index=True)]
        return self._rows[0]

    def calibration_at(self, epoch: int, step: int = 0) -> Calibration:
        """The calibration plans use at step `step` of `epoch`: the latest switch at or
        before it, else the prior."""
        current = self.prior
        for s in self.switches:
            if (s.epoch, s.step) <= (epoch, step):
                current = s.calibration
        return current

    def observe(self, rows: pd.DataFrame | Iterable[Mapping[str, Any]]) -> None:
        """Add measured micro-batch rows (every rank's, in the same order on every rank):
        columns ROW_COLUMNS (``sp_degree`` may be left out: 1), one row per (step, rank)."""
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        if SP_DEGREE not in frame.columns:
            frame = frame.assign(**{SP_DEGREE: 1})
        missing = [c for c in ROW_COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"observe: rows lack column(s) {', '.join(missing)}")
        frame = frame[list(ROW_COLUMNS)].astype({"compute_s": np.float64, SP_DEGREE: np.int64})
        if len(frame):
            self._rows.append(frame.reset_index(drop=True))

    def refine(self, epoch: int, step: int) -> Switch:
        """Refit from every row observed so far and replan from step `step` of `epoch` on
        (`step` the first step not yet handed out; the epoch's step count: the next epoch
        from its step 0)."""
        epoch, step = self._normalise(epoch, step)
        n = len(self.rows)
        last = self.switches[-1] if self.switches else None
        if last is not None and (last.epoch, last.step, last.rows) == (epoch, step, n):
            return last
        if n == 0:
            raise ValueError("refine: no rows observed; call observe(rows) after each step")
        return self.switch(epoch, step, self.refit(self.prior, self.rows), rows=n)

    def switch(
        self, epoch: int, step: int, calibration: Calibration, rows: int | None = None
    ) -> Switch:
        """Plan with `calibration` from step `step` of `epoch` on (what `refine` does with its
        fit; given the logged calibrations, a replay of a run's plans)."""
        epoch, step = self._normalise(epoch, step)
        last = self.switches[-1] if self.switches else None
        if last is not None and (epoch, step) < (last.epoch, last.step):
            raise ValueError(
                f"refine at epoch {epoch} step {step}: before the last refit's (epoch "
                f"{last.epoch} step {last.step}); a plan's steps run forward"
            )
        before = self(epoch).summary["plan_digest"] if step else None
        made = Switch(epoch, step, calibration, rows)
        self.switches.append(made)
        self._cache.pop(epoch, None)
        if before is not None and self(epoch).summary["plan_digest"] == before:
            made = replace(made, replanned=False)  # the rest kept its plan (`splice`)
            self.switches[-1] = made
        return made

    def _normalise(self, epoch: int, step: int) -> tuple[int, int]:
        """(epoch, step) with an epoch's end as the next epoch's start."""
        if step >= len_steps(self.builder(epoch)):
            return epoch + 1, 0
        return epoch, step

    def __call__(self, epoch: int) -> Plan:
        if epoch not in self._cache:
            self._cache.clear()  # the latest epoch only, like a PlanBuilder
            self._cache[epoch] = self._plan(epoch)
        return self._cache[epoch]

    def _plan(self, epoch: int) -> Plan:
        open_loop = self.builder(epoch)
        plan = open_loop
        start = self.calibration_at(epoch, 0)
        if start is not self.prior:
            plan = splice(self.builder, open_loop, 0, start, epoch)
        for s in self.switches:
            if s.epoch == epoch and s.step > 0 and s.replanned:
                plan = splice(self.builder, plan, s.step, s.calibration, epoch)
        return plan

    def state_dict(self) -> dict[str, Any]:
        """The rows and the switches (plain types): what a resumed run needs to plan exactly
        as the uninterrupted one."""
        rows = self.rows
        return {
            "rows": {c: rows[c].tolist() for c in ROW_COLUMNS},
            "switches": [s.to_dict() for s in self.switches],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s rows and switches; each switch fitted from rows is fitted
        again from the restored rows and must give the recorded coefficients (the refit is
        deterministic: a difference means another refit, and is refused)."""
        self._rows, self.switches, self._cache = [], [], {}
        self.observe(pd.DataFrame(dict(state["rows"])))
        for data in state["switches"]:
            saved = Switch.from_dict(data)
            if saved.rows is None:
                self.switch(saved.epoch, saved.step, saved.calibration)
                continue
            again = self.refit(self.prior, self.rows.iloc[: saved.rows])
            if cost_digest(again) != data["cost_digest"]:
                raise ValueError(
                    f"closed-loop state: the refit at epoch {saved.epoch} step {saved.step} "
                    "gives other coefficients from the same rows than the saved run's; the "
                    "refit changed: start the run afresh"
                )
            self.switch(saved.epoch, saved.step, again, rows=saved.rows)


def len_steps(plan: Plan) -> int:
    """A plan's optimizer steps."""
    return int(plan.table["step"].iat[-1]) + 1


def splice(
    builder: PlanBuilder, plan: Plan, step: int, calibration: Calibration, epoch: int
) -> Plan:
    """`plan` up to `step`, then the samples it has not yet run planned with `calibration`
    for its remaining steps (module docstring). `plan` itself when the policy cannot plan
    them in exactly those steps (a PlanWarning says so)."""
    table = plan.table
    steps = len_steps(plan)
    before = table[table["step"].to_numpy() < step]
    consumed = before.loc[~before["is_padding"].to_numpy(bool), "sample_id"]
    rest = builder.samples[~builder.samples["sample_id"].isin(consumed)]
    if rest.empty:  # the steps left only repeat (padding): nothing to replan
        return plan
    config = replace(builder.config(epoch), cost_model=calibration, steps_per_epoch=steps - step)
    tokens = rest["tokens"].to_numpy(np.float64)
    if not np.all(calibration.cost.per_sample_time(tokens) > 0):
        # `refine` keeps every term the prior has (above a floor); a calibration handed to
        # `switch` may still have none, and cannot price a sample
        why = "it prices a sample at 0 s: it has no per-sample cost term"
    else:
        try:
            part = config.plan(
                rest.reset_index(drop=True), builder.num_excluded, builder.num_over_capacity
            )
            why = "" if len_steps(part) == steps - step else f"it plans {len_steps(part)}"
        except UserError as err:  # the policy refuses the step count asked for
            why = str(err)
    if why:
        warnings.warn(
            f"closed loop ({plan.summary['policy']}): the rest of epoch {epoch} from step "
            f"{step} cannot be planned in its {steps - step} steps with the refit ({why}); "
            "the epoch keeps its plan, later epochs use the refit",
            PlanWarning,
            stacklevel=_outside_the_package(),
        )
        return plan
    later = part.table.copy()
    later["step"] += step
    later["batch_id"] += int(table["batch_id"].max()) + 1
    if SP_DEGREE in table.columns or SP_DEGREE in later.columns:
        before = before.assign(**{SP_DEGREE: before.get(SP_DEGREE, 1)})
        later = later.assign(**{SP_DEGREE: later.get(SP_DEGREE, 1)})
    spliced = pd.concat([before, later], ignore_index=True)
    summary = {
        k: v
        for k, v in plan.summary.items()
        if not k.startswith("predicted_") and k not in PREDICTED
    }
    digest = cost_digest(calibration)
    refits = [*plan.summary.get("refits", []), {"step": step, "cost_digest": digest}]
    chain = hashlib.sha256(
        f"{plan.summary['plan_digest']}|{step}|{digest}|{part.summary['plan_digest']}".encode()
    ).hexdigest()[:16]
    real = ~spliced["is_padding"].to_numpy(bool)
    summary.update(
        refits=refits,
        plan_digest=chain,
        num_padding=int((~real).sum()),
        duplicates=int(spliced.loc[real, "sample_id"].duplicated().sum()),
    )
    spliced.attrs["plan"] = dict(summary)
    return Plan(table=spliced, summary=summary)
