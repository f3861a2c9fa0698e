"""What-if on your data: every policy's plan of one manifest through one cost model, side by side.

A user deciding whether to adopt a policy needs its predicted effect on *their* data before
training: on a mix with few long clips AdaptiveLoad alone can be worse than equal-token on
imbalance while balanced dealing helps. `compare_policies` plans the same bucketed samples
under every policy of the registry (``policies.POLICIES``, so a new policy appears by itself)
with the budgets of one calibration, and returns each plan's summary: counts, budgets and the
``predicted_*`` metrics of the simulator (all `model`, through that calibration). samples/s
counts each real sample once (padding repeats beside it, as ``padding``); ``samples/step``
and ``tokens/step`` are the mean and population std over the epoch's optimizer steps of the
real samples and tokens each trains on (policies with other step counts train with other
global batches); ``largest micro-batch`` and ``beyond measured memory`` say whether the plan's
memory rests on what the calibration measured.
`comparison_rows` turns them into the table `adaptiveload compare` prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import Bucketed
from adaptiveload.planning.dealing import DEFAULT_WINDOW_STEPS
from adaptiveload.planning.plan import FREE, PlanConfig
from adaptiveload.planning.policies import POLICIES, Budgets

# (summary key, column title, format) of the printed table; a key no summary has (a metric
# a newer planner adds, such as the distance to the lower bound) is left out
COLUMNS = (
    ("policy", "policy", "{}"),
    ("predicted_imbalance_rate", "imbalance", "{:.1%}"),
    ("predicted_idle_fraction", "idle", "{:.1%}"),
    ("predicted_vram_utilization_mean", "VRAM mean", "{:.1%}"),
    ("predicted_vram_utilization_max", "VRAM max", "{:.1%}"),
    ("predicted_samples_per_s", "samples/s", "{:.4g}"),
    ("samples_per_s_vs_first", "vs {first}", "{:+.1%}"),
    ("predicted_padding_fraction", "padding", "{:.1%}"),
    ("predicted_vs_lower_bound", "x lower bound", "{:.3f}"),
    ("predicted_vs_epoch_lower_bound", "x epoch bound", "{:.3f}"),
    ("steps", "steps", "{}"),
    ("min_steps_per_epoch", "K_min", "{}"),
    ("samples_per_step_mean", "samples/step", "{:.4g}"),
    ("samples_per_step_std", "± std", "{:.3g}"),
    ("tokens_per_step_mean", "tokens/step", "{:.4g}"),
    ("tokens_per_step_std", "± std", "{:.3g}"),
    ("batches", "batches", "{}"),
    ("num_oversize", "oversize", "{}"),
    ("max_micro_batch_tokens", "largest micro-batch", "{:,}"),
    ("micro_batches_beyond_measured_memory", "beyond measured memory", "{}"),
)


@dataclass(frozen=True)
class CompareConfig:
    """What a comparison is made from, the samples aside: one calibration (the cost model and
    the budgets every policy plans with), the ranks and seed, the policies (None: every
    registered one, in registry order, the field's methods included), the cost-aware deal's
    window and the step count (free, match or K: `PlanConfig.steps_per_epoch`). Each policy's
    plan is made from the ``PlanConfig`` `adaptiveload plan` would build from the same
    inputs."""

    calibration: Calibration
    world_size: int
    seed: int = 0
    policies: Sequence[str] | None = None
    window_steps: int | None = DEFAULT_WINDOW_STEPS
    steps_per_epoch: str | int = FREE

    @property
    def max_degree(self) -> int:
        """The largest sequence-parallel degree any compared policy may plan: samples over the
        capacity there are left out of every plan (`plan.without_over_capacity`); those over
        it at a policy's own are excluded by that policy's plan."""
        return max(config.max_degree for config in self.plan_configs())

    def plan_configs(self) -> list[PlanConfig]:
        budgets = Budgets.resolve(calibration=self.calibration)
        cal, n, seed, window = self.calibration, self.world_size, self.seed, self.window_steps
        return [
            PlanConfig(name, budgets, n, seed, cost_model=cal, window_steps=window,
                       steps_per_epoch=self.steps_per_epoch)
            for name in self.policies or list(POLICIES)
        ]


def compare_policies(bucketed: Bucketed, config: CompareConfig) -> list[dict[str, Any]]:
    """One plan summary per policy of `config` for `bucketed`; each has
    ``samples_per_s_vs_first``, its predicted samples/s relative to the first's."""
    rows = [dict(plan_config.plan(bucketed).summary) for plan_config in config.plan_configs()]
    first = rows[0].get("predicted_samples_per_s", math.nan)
    for row in rows:
        row["samples_per_s_vs_first"] = row.get("predicted_samples_per_s", math.nan) / first - 1
    return rows


def comparison_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    """The table of `summaries`: a header row, then one row of formatted cells per policy
    (the columns of COLUMNS that some summary has)."""
    cols = [c for c in COLUMNS if any(c[0] in s for s in summaries)]
    table = [[title.format(first=summaries[0]["policy"]) for _, title, _ in cols]]
    for s in summaries:
        table.append([_cell(s.get(key), fmt) for key, _, fmt in cols])
    return table


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)
