"""The figures stand alone: drawn from a tiny synthetic experiment (a measured setup and three
simulated ones), each keeps measured and modelled numbers apart, says "model estimate" where
it models, stays within 3:1, and gives each policy the same colour everywhere."""

from __future__ import annotations

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
from analysis_synth import write_run

from adaptiveload.analysis import figures
from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.analysis.landing import PAPER_SPEEDUP
from adaptiveload.analysis.stats import compare

POLICIES = {"equal-token": 1.0, "adaptiveload": 1.2, "adaptiveload-balanced": 1.4}
# each policy's step count in the measured setup: their panels must each show all of them
TRAIN_STEPS = {"equal-token": 12, "adaptiveload": 10, "adaptiveload-balanced": 9}
SIMS = ("sim/a", "sim/b", "sim/c")
WIDE = 50.0  # an interval end far beyond every estimate


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> figures.FigureInputs:
    root, index = tmp_path_factory.mktemp("runs"), []
    for seed in (0, 1):
        for policy, speedup in POLICIES.items():
            index.append(write_run(root, policy, seed, speedup=speedup,
                                   steps=TRAIN_STEPS[policy]))
            for sim in SIMS:
                index.append(write_run(root, policy, seed, setup=sim, speedup=speedup,
                                       kernel="none", source="model", device="H200", steps=6))
    agg = aggregate(parse_index(index))
    stats = compare(agg.runs, seed=0)
    # one interval that runs far past the estimates: the axis must not stretch to it
    wide = (stats["metric"] == "samples_per_s ratio") & (stats["setup"] == "train")
    stats.loc[wide & stats["ci_high"].notna(), "ci_high"] = WIDE
    # the simulations' rows without an interval, as the statistics give them
    stats.loc[stats["setup"].str.startswith("sim/"), ["ci_low", "ci_high"]] = np.nan
    return figures.FigureInputs(agg.runs, agg.steps, stats)


def _rgb(color) -> tuple:
    return tuple(np.round(matplotlib.colors.to_rgb(color), 3))


@pytest.mark.parametrize("name", ["compute_heatmap", "imbalance_distribution", "throughput",
                                  "vram_utilization"])
def test_each_figure_is_at_most_three_times_as_wide_as_high(inputs, tmp_path, name):
    path = figures.render(name, inputs, tmp_path / f"{name}.png")
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width <= figures.MAX_ASPECT * height, f"{name}: {width}x{height} px"


def test_throughput_is_a_speedup_axis_measured_apart_from_model(inputs):
    fig = figures.throughput(inputs)
    measured, model = fig.axes
    assert measured.get_title(loc="left").startswith("measured")
    assert model.get_title(loc="left").startswith("model estimate")
    lo, hi = measured.get_xlim()
    assert lo < 1.0 < PAPER_SPEEDUP < hi < WIDE  # the wide interval is clipped
    for ax in (measured, model):
        verticals = {round(line.get_xdata()[0], 3) for line in ax.lines
                     if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2
                     and line.get_ydata()[0] != line.get_ydata()[1]}
        assert {1.0, round(PAPER_SPEEDUP, 3)} <= verticals
    arrows = [line for line in measured.lines if line.get_marker() == ">"]
    assert arrows and all(line.get_xdata()[0] == hi for line in arrows)
    spreads = [line for line in model.lines if len(line.get_xdata()) == 2
               and line.get_ydata()[0] == line.get_ydata()[1]]
    assert len(spreads) == len(SIMS) * (len(POLICIES) - 1)  # the seeds' min-max, no CI
    fig.canvas.draw()
    assert all(t.get_text().startswith("×") for t in model.get_xticklabels() if t.get_text())
    assert "×" in model.get_xlabel() and "1.0 = baseline" in model.get_xlabel()
    dots = {line.get_label(): _rgb(line.get_color()) for line in measured.lines
            if line.get_marker() == "o"}
    assert dots == {p: _rgb(figures.policy_color(p)) for p in POLICIES if p != "equal-token"}
    figures.plt.close("all")


def test_compute_heatmap_shows_every_step_of_every_policy_relative_to_the_slowest(inputs):
    fig = figures.compute_heatmap(inputs)
    panels = [ax for ax in fig.axes if ax.images and ax.get_title(loc="left")]
    assert len(panels) == len(POLICIES)
    for ax, policy in zip(panels, POLICIES, strict=True):
        image = ax.images[0]
        left, right = image.get_extent()[:2]
        assert (left, right) == (-0.5, TRAIN_STEPS[policy] - 0.5)  # every step, its own
        shares = np.asarray(image.get_array())
        np.testing.assert_allclose(shares.max(axis=0), 1.0)  # the slowest rank of each step
        title = ax.get_title(loc="left")
        assert title.startswith(policy) and "2 warm-up" in title
        assert _rgb(ax._left_title.get_color()) == _rgb(figures.policy_color(policy))
        warm = [p for p in ax.patches if p.get_hatch()]
        assert len(warm) == 1 and warm[0].get_x() == -0.5 and warm[0].get_width() == 2
    assert "(measured)" in fig.get_suptitle()
    figures.plt.close("all")


def test_box_panels_keep_model_apart_and_wrap(inputs):
    fig = figures.imbalance_distribution(inputs)
    assert len(fig.axes) == 1 + len(SIMS)
    rows = {ax.get_subplotspec().rowspan.start for ax in fig.axes}
    assert rows == {0, 1}  # four 4.8-inch panels wrap instead of a 19-inch strip
    train, *sims = fig.axes
    assert "(measured)" in train.get_title() and not any(p.get_hatch() for p in train.patches)
    for ax in sims:
        assert "(model estimate)" in ax.get_title()
        assert all(p.get_hatch() == "//" for p in ax.patches)
    boxes = [p for p in train.patches if p.get_hatch() is None]
    assert {_rgb(p.get_facecolor()) for p in boxes} == {
        _rgb(figures.policy_color(p)) for p in POLICIES}  # the palette's colour, unfaded
    paper = {round(line.get_ydata()[0], 1) for line in train.lines if line.get_linestyle() == "--"}
    assert paper == {39.0, 18.9}
    fig = figures.vram_utilization(inputs)
    assert all(ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 100 for ax in fig.axes)
    assert "model estimate" in fig.get_suptitle()
    figures.plt.close("all")
