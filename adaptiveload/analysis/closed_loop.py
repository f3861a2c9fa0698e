"""What the closed loop buys and what it cannot, from its committed benchmarks: the README's
generated block and one figure (imbalance and model error against step, open vs closed loop).

- `results/benchmarks/closed_loop_model.json` (`adaptiveload closed-loop --config
  experiments/closed_loop/model.yaml`): the simulator with a true device unlike the planner's
  prior, open loop, closed loop and the oracle, at paper scale (the data grows with N); model.
  `closed_loop_model_holdout.json` is the same on seeds the committed result does not use,
  `closed_loop_short_epochs.json` the same setups with 20,000 samples at every N (epochs of a
  few steps at N = 1,024).
- `results/benchmarks/closed_loop_cpu.json` (tests/bench/bench_closed_loop.py): `train.refine`
  on this CPU, (a) planned from another device's cost model, (b) a straggler; measured.

Every number in the block is read from those files (docs/closed_loop.md has the full tables).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np

MODEL_BENCHMARK = Path("results/benchmarks/closed_loop_model.json")
HOLDOUT_BENCHMARK = Path("results/benchmarks/closed_loop_model_holdout.json")
SHORT_EPOCHS_BENCHMARK = Path("results/benchmarks/closed_loop_short_epochs.json")
CPU_BENCHMARK = Path("results/benchmarks/closed_loop_cpu.json")
# where `figure` is written (the pipeline's results folders are not committed)
FIGURE = Path("results/closed_loop/figures/closed_loop.png")
# the model target: closed loop's time after its first window within this of the oracle's
MODEL_TARGET = 1.03
ARMS = ("open", "closed", "oracle")


def model_ratios(model: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per run of the model benchmark: after the closed loop's first window, closed and open
    over the oracle's time of the same samples; over the whole epoch, the same."""
    rows = model["rows"]
    after = [r["after_first_window"] for r in rows]
    return {
        "closed_after": np.array([a["closed_s"] / a["oracle_s"] for a in after]),
        "open_after": np.array([a["open_s"] / a["oracle_s"] for a in after]),
        "closed_epoch": np.array([r["closed_s"] / r["oracle_s"] for r in rows]),
        "open_epoch": np.array([r["open_s"] / r["oracle_s"] for r in rows]),
    }


def wrong_model_words(wrong: dict[str, Any]) -> str:
    """What a measured (a) run was planned from, in words (its record's `wrong_model`)."""
    if "p_shift" in wrong:
        return (f"a stale calibration of this CPU: its fit with p {wrong['p_shift']:+} and c0 "
                f"×{wrong['c0_scale']}, with this CPU's budgets")
    if "device" in wrong:
        return f"the cost model of another device ({wrong['device']}), with this CPU's budgets"
    return "the CPU calibration with its fixed cost and exponent perturbed"


def met(model: dict[str, Any]) -> int:
    """How many runs of a model benchmark meet MODEL_TARGET after the first window."""
    return int((model_ratios(model)["closed_after"] <= MODEL_TARGET).sum())


def scale(spec: dict[str, Any]) -> str:
    """The data's size of a model benchmark in words (`planning.closed_loop.sample_count`)."""
    if "samples_per_rank" in spec:
        return f"{spec['samples_per_rank']:,} samples per rank (the data grows with N)"
    return f"{spec['num_samples']:,} samples at every N"


def _mean(runs: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in runs]))


def readme_block(
    model: dict[str, Any], holdout: dict[str, Any], short: dict[str, Any], cpu: dict[str, Any]
) -> str:
    """The README's lines: the model benchmark's ratios to the oracle (median and worst over
    runs, how many meet MODEL_TARGET, on the holdout seeds too), the same on epochs of a few
    steps (`short`), and the measured runs' paired effects."""
    spec, ratios = model["spec"], model_ratios(model)
    runs = len(model["rows"])
    seeds = len(spec["seeds"])
    sizes = ", ".join(f"{n:,}" for n in spec["world_sizes"])
    device = spec["device"]
    held = ", ".join(map(str, holdout["spec"]["seeds"]))
    short_ratios = model_ratios(short)
    short_sizes = " and ".join(f"{n:,}" for n in short["spec"]["world_sizes"])
    steps = [r["window_steps"] for r in short["rows"]]
    lines = [
        f"- **Model** (`{MODEL_BENCHMARK.as_posix()}`): a planner whose prior has p off by ±0.3 "
        f"and c0 ×2 or ×0.5, on a true device with one rank in {device['slow_every']} at "
        f"{device['slow_speed']}× and {device['noise']:.0%} timing noise; "
        f"{', '.join(spec['calibrations'])}; {', '.join(spec['mixtures'])}; N = {sizes}, "
        f"{scale(spec)}; {runs // seeds} setups × {seeds} seeds. After the closed loop's first "
        f"window, the rest of the epoch takes ×{np.median(ratios['closed_after']):.3f} the "
        f"oracle's time (median over runs; worst ×{ratios['closed_after'].max():.3f}), the "
        f"open loop's ×{np.median(ratios['open_after']):.3f} (worst "
        f"×{ratios['open_after'].max():.3f}); {met(model)} of {runs} runs within "
        f"×{MODEL_TARGET} (seeds {held}, held out: {met(holdout)} of {len(holdout['rows'])}). "
        f"The whole epoch, its first window on the prior included: closed "
        f"×{np.median(ratios['closed_epoch']):.3f}, open ×{np.median(ratios['open_epoch']):.3f}.",
        f"- **Model, epochs of a few steps** (`{SHORT_EPOCHS_BENCHMARK.as_posix()}`): the same "
        f"at N = {short_sizes} with {scale(short['spec'])}, windows of {min(steps)}–"
        f"{max(steps)} steps: closed ×{np.median(short_ratios['closed_after']):.3f} the "
        f"oracle's time after the first window (worst ×{short_ratios['closed_after'].max():.3f}"
        f"), open ×{np.median(short_ratios['open_after']):.3f}; {met(short)} of "
        f"{len(short['rows'])} runs within ×{MODEL_TARGET}.",
    ]
    a = cpu.get("a_wrong_model")
    if a:
        s, arm = a["setup"], a["runs"]
        sps = a["effects"]["samples_per_s: closed / open"]
        errors = [r["model_error_median_by_window"] for r in arm["closed"]]
        device = a.get("device", cpu["device"])  # a part run alone keeps the file's others
        lines.append(
            f"- **Measured** (`{CPU_BENCHMARK.as_posix()}`, {device}, {s['timer']}, "
            f"{len(arm['closed'])} seeds): `train.refine` ({s['policy']}) on "
            f"{s['world_size']} emulated ranks, planned from "
            f"{wrong_model_words(s['wrong_model'])}: "
            f"samples/s closed / open ×{sps['ratio']:.3f} (95% CI {sps['ci95'][0]:.3f}–"
            f"{sps['ci95'][1]:.3f}); imbalance after the first refit "
            f"{_mean(arm['closed'], 'imbalance_after_first_refit'):.1%} against "
            f"{_mean(arm['open'], 'imbalance_after_first_refit'):.1%} open and "
            f"{_mean(arm['oracle'], 'imbalance_after_first_refit'):.1%} for the oracle (this "
            f"CPU's calibration); model error median "
            f"{np.mean([e[0] for e in errors]):.0%} → {np.mean([e[-1] for e in errors]):.0%}."
            + (f" What there was to gain, model (the same samples and budgets, this CPU's "
               f"calibration as the true device): the wrong model's plan takes "
               f"×{np.mean(a['model']['open_over_oracle']):.3f} the oracle's epoch."
               if "model" in a else "")
        )
    b = cpu.get("b_straggler")
    if b:
        st = b["effects"]["step_time_after_first_refit_s: closed / open"]
        lines.append(
            f"- **Measured**, a straggler ({b.get('device', cpu['device'])}, "
            f"{b['setup']['launch']}, "
            f"{b['setup']['straggler']}, {b['setup']['timer']}): step time after the first "
            f"refit closed / open ×{st['ratio']:.3f} (95% CI {st['ci95'][0]:.3f}–"
            f"{st['ci95'][1]:.3f})."
        )
    return "\n".join(lines) + "\n"


def _mean_by_step(series: list[list[float]]) -> np.ndarray:
    """The mean over seeds at each step all of them ran (a seed whose plan has a step more
    leaves it out)."""
    steps = min(len(s) for s in series)
    return np.mean([s[:steps] for s in series], axis=0)


def figure(cpu: dict[str, Any]) -> Any:
    """Imbalance (each step's) and model error (median |predicted − measured| / measured per
    micro-batch: each step's for the arms planned from one model, each window's for the
    closed loop) against step, open vs closed loop vs oracle, means over seeds; the closed
    loop's refits marked. Measured: (a) of the CPU benchmark."""
    import matplotlib.pyplot as plt

    from adaptiveload.analysis.figures import OTHER_COLOR, policy_color

    a = cpu["a_wrong_model"]
    s, runs = a["setup"], a["runs"]
    color = {"open": OTHER_COLOR, "closed": policy_color(s["policy"]), "oracle": (0, 0, 0)}
    style = {"open": "-", "closed": "-", "oracle": ":"}
    first = s["warmup_steps"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, layout="constrained")
    for arm in ARMS:
        by_step = _mean_by_step([r["imbalance_by_step"] for r in runs[arm]])
        steps = first + np.arange(by_step.size)
        top.plot(
            steps,
            100 * by_step,
            style[arm],
            color=color[arm],
            label=f"{arm} loop" if arm != "oracle" else "oracle (this CPU's calibration)",
        )
        if arm != "closed" and "model_error_median_by_step" in runs[arm][0]:
            err = _mean_by_step([r["model_error_median_by_step"] for r in runs[arm]])
            bottom.plot(steps, 100 * err, style[arm], color=color[arm])
    for run in runs["closed"]:  # each seed's windows (a policy's refits may fall apart)
        ends = np.array(run["window_end_steps"])
        starts = np.concatenate([[first], ends[:-1] + 1])
        bottom.hlines(100 * np.array(run["model_error_median_by_window"]), starts, ends,
                      color=color["closed"], lw=2, alpha=0.6)
        for ax in (top, bottom):
            for step in ends[:-1]:
                ax.axvline(step + 0.5, color=color["closed"], lw=0.6, alpha=0.25)
    top.set_title(
        textwrap.fill(
            f"measured ({s['timer']}, {a.get('device', cpu['device'])}): train.refine "
            f"({s['policy']}) planned "
            f"from {wrong_model_words(s['wrong_model'])}; {s['world_size']} emulated ranks, "
            f"{len(runs['closed'])} seeds (mean; the closed loop's windows per seed); thin "
            "lines: its refits",
            90,
        ),
        fontsize=9,
    )
    top.set_ylabel("imbalance per step (%)")
    top.legend(fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylabel("model error, median per\nmicro-batch (%, log)")
    bottom.set_xlabel("step (after the warm-up)")
    return fig
