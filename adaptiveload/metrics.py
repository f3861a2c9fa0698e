"""The metric formulas of docs/definitions.md, in one place: used by training, the simulator
and the analysis.

Inputs are per-step, per-rank arrays shaped ``[steps, ranks]`` (compute seconds or peak
bytes). Callers drop warm-up steps before calling; nothing here knows about warm-up.
The paper does not define its metrics, so every common variant is computed and named.
The per-step formulas (`step_imbalance`, `step_idle`, `throughput`) also take the columns of
a per-step table (analysis), elementwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np

# a number, a numpy array or a pandas Series: the per-step formulas work elementwise on each
Values = TypeVar("Values")


def _as_steps_by_ranks(t: np.ndarray) -> np.ndarray:
    arr = np.asarray(t, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"expected a non-empty [steps, ranks] array, got shape {arr.shape}")
    return arr


def step_imbalance(tmax: Values, tmin: Values) -> Values:
    """One step's imbalance from its slowest and fastest rank: (max_r t - min_r t) / max_r t."""
    return (tmax - tmin) / tmax


def step_idle(tmax: Values, tmean: Values) -> Values:
    """One step's (max_r t - mean_r t) / max_r t: the share of the step's rank-time spent
    waiting for the slowest rank (its idle fraction, and VideoSys' imbalance form)."""
    return (tmax - tmean) / tmax


def throughput(samples: Values, tokens: Values, seconds: Values) -> tuple[Values, Values]:
    """(samples/s, tokens/s) of steps that trained on `samples` real samples holding `tokens`
    tokens in `seconds` (the sum of their step times: the run's timer, or the wall clock
    beside it). Real: each sample of the data once, padding repeats left out
    (`step_table.real_counts`); they are reported beside it (`padding_fraction`)."""
    return samples / seconds, tokens / seconds


def padding_fraction(padding_samples: float, real_samples: float) -> float:
    """Share of the samples the ranks processed that were padding repeats:
    padding / (real + padding); 0 for a window that processed nothing."""
    total = padding_samples + real_samples
    return float(padding_samples / total) if total > 0 else 0.0


def batch_spread(samples_per_step: np.ndarray, tokens_per_step: np.ndarray) -> dict[str, float]:
    """The global batch of the window's optimizer steps: mean, population std (ddof 0), min
    and max over steps of the real samples and real tokens each step trained on (all ranks
    together). Two policies with different batches change the training recipe, not only its
    speed: these say by how much."""
    out = {}
    for name, values in (("samples", samples_per_step), ("tokens", tokens_per_step)):
        v = np.asarray(values, dtype=np.float64)
        out[f"{name}_per_step_mean"] = float(v.mean())
        out[f"{name}_per_step_std"] = float(v.std())
        out[f"{name}_per_step_min"] = float(v.min())
        out[f"{name}_per_step_max"] = float(v.max())
    return out


def imbalance_rate(t: np.ndarray) -> float:
    """Primary imbalance: mean over steps of (max_r t - min_r t) / max_r t."""
    arr = _as_steps_by_ranks(t)
    return float(np.mean(step_imbalance(arr.max(axis=1), arr.min(axis=1))))


def imbalance_rate_mean(t: np.ndarray) -> float:
    """Variant: mean over steps of (max_r t - mean_r t) / max_r t (VideoSys' form)."""
    arr = _as_steps_by_ranks(t)
    return float(np.mean(step_idle(arr.max(axis=1), arr.mean(axis=1))))


def idle_fraction(t: np.ndarray) -> float:
    """Share of rank-time spent waiting for the slowest rank: sum(T_s - t_sr) / (N * sum T_s)."""
    arr = _as_steps_by_ranks(t)
    tmax = arr.max(axis=1)
    return float((tmax[:, None] - arr).sum() / (arr.shape[1] * tmax.sum()))


def imbalance_cv(t: np.ndarray) -> float:
    """Variant: mean over steps of the coefficient of variation std_r t / mean_r t (population
    std over the ranks of a step; 0 = balanced)."""
    arr = _as_steps_by_ranks(t)
    return float(np.mean(arr.std(axis=1) / arr.mean(axis=1)))


def max_over_mean(t: np.ndarray) -> float:
    """Mean over steps of max_r t / mean_r t (1.0 = perfectly balanced)."""
    arr = _as_steps_by_ranks(t)
    return float(np.mean(arr.max(axis=1) / arr.mean(axis=1)))


# Every candidate definition of the paper's "computational imbalance rate" (it defines none),
# by the name sweeps and figures use; all read the same [steps, ranks] compute times.
IMBALANCE_DEFINITIONS = {
    "range": ("(max - min) / max per step", imbalance_rate),
    "max-mean": ("(max - mean) / max per step", imbalance_rate_mean),
    "cv": ("std / mean per step", imbalance_cv),
    "idle": ("idle fraction of rank-time", idle_fraction),
}


def vram_utilization(peak_bytes: np.ndarray, capacity_bytes: float) -> tuple[float, float]:
    """(mean, max) over rank-steps of peak bytes / device capacity. Mean is the efficiency."""
    if capacity_bytes <= 0:
        raise ValueError("capacity_bytes must be positive")
    u = _as_steps_by_ranks(peak_bytes) / capacity_bytes
    return float(u.mean()), float(u.max())


@dataclass(frozen=True)
class StepMetrics:
    """The summary of a timed window of steps; keys are the stable names logged everywhere.
    Throughput counts real samples; `padding_samples` the repeats beside them."""

    imbalance_rate: float
    imbalance_rate_mean: float
    idle_fraction: float
    max_over_mean: float
    samples_per_s: float
    tokens_per_s: float
    padding_samples: int
    padding_fraction: float
    steps: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(
    compute_s: np.ndarray,
    samples: float,
    tokens: float,
    wall_s: float,
    padding_samples: float = 0,
) -> StepMetrics:
    """All balance metrics of `compute_s` [steps, ranks] plus throughput over `wall_s` of the
    `samples` real samples (`tokens` real tokens), beside the `padding_samples` repeats."""
    if wall_s <= 0:
        raise ValueError("wall_s must be positive")
    arr = _as_steps_by_ranks(compute_s)
    samples_per_s, tokens_per_s = throughput(samples, tokens, wall_s)
    return StepMetrics(
        imbalance_rate=imbalance_rate(arr),
        imbalance_rate_mean=imbalance_rate_mean(arr),
        idle_fraction=idle_fraction(arr),
        max_over_mean=max_over_mean(arr),
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        padding_samples=int(padding_samples),
        padding_fraction=padding_fraction(padding_samples, samples),
        steps=arr.shape[0],
    )


@dataclass(frozen=True)
class StepCounts:
    """What each optimizer step of a window trained on, all ranks together [steps]: its real
    samples and real tokens, and its padding repeats."""

    samples: np.ndarray
    tokens: np.ndarray
    padding_samples: np.ndarray


def window_metrics(
    compute_s: np.ndarray,
    counts: StepCounts,
    seconds: float,
    peak_bytes: np.ndarray | None = None,
    capacity_bytes: float | None = None,
) -> dict[str, float]:
    """A timed window's run-summary metrics, as measured runs and simulations report them:
    `summarize` of the real samples, their per-step spread (`batch_spread`), plus VRAM
    utilization where peaks [steps, ranks] and a capacity are known."""
    out: dict[str, float] = summarize(
        compute_s,
        samples=float(counts.samples.sum()),
        tokens=float(counts.tokens.sum()),
        wall_s=seconds,
        padding_samples=float(counts.padding_samples.sum()),
    ).as_dict()
    out.update(batch_spread(counts.samples, counts.tokens))
    if capacity_bytes and peak_bytes is not None:
        out["vram_utilization_mean"], out["vram_utilization_max"] = vram_utilization(
            peak_bytes, capacity_bytes
        )
    return out
