"""Tables and figures from synthetic run tables, through the real CLI commands."""

import json

import pandas as pd
from analysis_synth import planted_runs, write_run
from repo_paths import H200_MEASURED


def test_kernel_table_and_figure_from_a_benchmark_csv(tmp_path):
    """Rows shaped like `adaptiveload kernel bench` output: measured, and the CPU skip record."""
    from adaptiveload.analysis.figures import FigureInputs, kernel_bandwidth
    from adaptiveload.analysis.tables import kernel_table

    rows = [dict(source="measured", device="NVIDIA H200", S=s, D=1536, phase=ph, impl=impl,
                 median_us=10.0, gbps=g)
            for s in (8192, 16384) for ph, impl, g in
            (("fwd", "fused", 3900.0), ("fwd", "eager", 900.0), ("bwd", "fused", 3500.0),
             ("copy", "copy", 4300.0))]
    bench = tmp_path / "bench.csv"
    pd.DataFrame(rows).to_csv(bench, index=False)
    assert len(kernel_table(bench).numbers) == len(rows)
    empty = pd.DataFrame(columns=["setup", "variant", "kernel", "policy", "seed"])
    fig = kernel_bandwidth(FigureInputs(runs=empty, steps=_empty_steps(), stats=empty,
                                        kernel_bench=bench))
    assert len(fig.axes) == 2  # fwd and bwd panels for D=1536
    skipped = tmp_path / "skip.csv"
    pd.DataFrame([dict(source="skipped", note="no CUDA device")]).to_csv(skipped, index=False)
    assert kernel_table(skipped).numbers.reason.iloc[0] == "no CUDA device"


def _empty_steps():
    cols = ["setup", "variant", "policy", "kernel", "seed", "source", "label", "timed_window",
            "step", "rank", "compute_s", "samples", "tokens", "step_time_s", "step_wall_s",
            "peak_bytes", "peak_bytes_model", "capacity_bytes", "timed", "padding_samples",
            "padding_tokens"]
    return pd.DataFrame(columns=cols).astype({"timed": bool})


def test_calibration_fit_plots_the_cost_models_prediction():
    """Points timed exactly as the full cost model says (c_seq > 0) lie on the y = x line."""
    from types import SimpleNamespace

    import numpy as np

    from adaptiveload.analysis.figures import calibration_fit

    c0, a, b, c_seq = 0.01, 1e-4, 1e-8, 0.05
    points = [{"batch": n, "tokens": s, "time_s": c0 + n * (c_seq + a * s + b * s * s)}
              for n in (1, 2, 4) for s in (100, 1000, 4000)]
    points.append({"batch": 1, "tokens": 50, "time_s": None})  # a grid point that did not run
    cal = {"model": "m", "device": "d", "source": "measured", "p": 1.2, "points": points,
           "cost": {"c0": c0, "a": a, "b": b, "c_seq": c_seq}}
    fig = calibration_fit(SimpleNamespace(calibration=cal))
    xy = fig.axes[0].collections[0].get_offsets()
    assert len(xy) == 9
    np.testing.assert_allclose(xy[:, 0], xy[:, 1], rtol=1e-9)


def test_calibration_fit_marks_the_held_out_packs():
    """The mixed packs (the file's `additivity`) are plotted at (predicted, measured) beside
    the grid points; a pack that ran out of memory is not; the title gives median and worst."""
    from types import SimpleNamespace

    import numpy as np

    from adaptiveload.analysis.figures import calibration_fit
    from adaptiveload.calibration.additivity import held_out
    from adaptiveload.costmodel import CostModel

    cost = CostModel(c0=0.01, a=1e-4, b=1e-8)
    points = [{"batch": n, "tokens": s, "time_s": float(cost.step_time(n, s))}
              for n in (1, 2) for s in (100, 1000, 4000)]
    packs = [{"pack": "a", "tokens": [1000, 100], "samples": 2, "sum_tokens": 1100,
              "status": "ok", "time_s": 1.25 * cost.set_time([1000, 100])},
             {"pack": "b", "tokens": [4000, 4000, 100], "samples": 3, "sum_tokens": 8100,
              "status": "oom", "time_s": None}]
    cal = {"model": "m", "device": "d", "source": "measured", "p": 1.2, "points": points,
           "cost": {"c0": 0.01, "a": 1e-4, "b": 1e-8},
           "additivity": held_out(cost, packs, memory_measured=False, timer="cpu")}
    ax = calibration_fit(SimpleNamespace(calibration=cal)).axes[0]
    crosses = [c for c in ax.collections if c.get_label() == "mixed packs (held out)"]
    assert len(crosses) == 1
    np.testing.assert_allclose(crosses[0].get_offsets(),
                               [[cost.set_time([1000, 100]), packs[0]["time_s"]]])
    assert "mixed packs held out (1): median 20.0%, worst 20.0%" in ax.get_title()


def test_figure_layouts_name_things_and_do_not_collide(tmp_path):
    """Each panel labelled once, panel titles apart, the legend off the bars, no "/ none"
    for simulations (no kernel), the mixture named."""
    from adaptiveload.analysis import figures
    from adaptiveload.analysis.aggregate import aggregate, parse_index
    from adaptiveload.analysis.stats import compare

    index = planted_runs(tmp_path / "runs", planted=True, seeds=(0, 1))
    for seed in (0, 1):
        for policy in ("equal-token", "adaptiveload"):
            index.append(write_run(tmp_path / "runs", policy, seed, setup="sim/h200-1.3b",
                                   kernel="none", source="model", device="NVIDIA H200 (prior)",
                                   steps=12))
    agg = aggregate(parse_index(index))
    stats = compare(agg.runs)
    describe = {"manifest": "x/manifest.parquet", "num_samples": 3, "num_excluded": 0,
                "buckets": [{"tokens": t, "count": 1} for t in (100, 400, 1600)]}
    inputs = figures.FigureInputs(agg.runs, agg.steps, stats, describe=describe,
                                  mixture="paper-mixed")

    def boxes(artists, fig):
        fig.canvas.draw()
        return [a.get_window_extent(fig.canvas.get_renderer()) for a in artists]

    for name in ("imbalance_distribution", "vram_utilization"):
        fig = figures.FIGURES[name](inputs)
        axes = fig.axes
        assert len(axes) == 2 and axes[0].get_ylabel() and not axes[1].get_ylabel(), name
        left, right = boxes([axes[0].title, axes[1].title], fig)
        assert left.x1 < right.x0, f"{name}: panel titles overlap"
        assert boxes([axes[0].yaxis.label], fig)[0].x0 >= 0

    fig = figures.throughput(inputs)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0].startswith("train / eager") and labels[1].startswith("sim/h200-1.3b\n")
    assert not any("/ none" in t for t in labels)
    legend, plot = boxes([ax.get_legend(), ax], fig)
    assert legend.x0 >= plot.x1, "the legend lies over the bars and their error bars"

    assert "Mixture paper-mixed" in figures.mixture_tokens(inputs).axes[0].get_title()
    figures.plt.close("all")


def test_labels_say_which_clock_measured_and_which_calibration_predicted(tmp_path):
    """A simulation through a measured calibration says so; a measured run keeps its own
    clock and device, whatever calibration planned it; a prior stays a plain model."""
    from adaptiveload.analysis.aggregate import aggregate, parse_index

    runs = tmp_path / "runs"
    index = [
        write_run(runs, "equal-token", 0, calibration="measured (cpu:EPYC)"),
        write_run(runs, "equal-token", 0, setup="sim/measured", kernel="none", source="model",
                  device="cuda:NVIDIA H200", calibration="measured (cuda:NVIDIA H200)"),
        write_run(runs, "equal-token", 0, setup="sim/prior", kernel="none", source="model",
                  device="NVIDIA H200 (analytic prior)",
                  calibration="model (NVIDIA H200 (analytic prior))"),
    ]
    labels = aggregate(parse_index(index)).runs.set_index("setup")["label"]
    assert labels["train"] == "measured (cpu)"
    assert labels["sim/measured"] == "model (measured calibration, cuda:NVIDIA H200)"
    assert labels["sim/prior"] == "model (NVIDIA H200 (analytic prior))"


def test_load_vs_lower_bound_draws_each_policy_at_16_and_256_ranks(tmp_path):
    """The figure of per-rank predicted load against the step bound, from real simulations:
    one panel per policy at N = 16 and at N = 256 (a simulation of each N, first seed)."""
    from planning_data import bucketed

    from adaptiveload.analysis.aggregate import aggregate, parse_index
    from adaptiveload.analysis.figures import FigureInputs, load_vs_lower_bound
    from adaptiveload.costmodel import Calibration
    from adaptiveload.planning.plan import build_plan
    from adaptiveload.planning.policies import Budgets
    from adaptiveload.planning.simulate import simulate

    cal = Calibration.load(H200_MEASURED)
    samples, index = bucketed(6_000, seed=1), []
    for n in (16, 256):
        for policy in ("adaptiveload-balanced", "adaptiveload-packed"):
            plan = build_plan(samples, policy, Budgets.resolve(calibration=cal), n, 0,
                              cost_model=cal)
            sim = simulate(plan.table, cal)
            out = tmp_path / f"n{n}" / policy
            out.mkdir(parents=True)
            sim.steps.to_parquet(out / "steps.parquet")
            summary = {**sim.summary, "experiment": "t", "policy": policy, "seed": 0,
                       "kernel": "none"}
            (out / "summary.json").write_text(json.dumps(summary, default=float))
            index.append({"setup": f"sim/n{n}", "summary": str(out / "summary.json"),
                          "steps": str(out / "steps.parquet")})
    agg = aggregate(parse_index(index))
    empty = pd.DataFrame()
    fig = load_vs_lower_bound(FigureInputs(runs=agg.runs, steps=agg.steps, stats=empty))
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 4
    assert sum("N = 16:" in t for t in titles) == sum("N = 256:" in t for t in titles) == 2
    assert all("x the bound" in t for t in titles)
