"""Time to quality: the learnable source, the held-out set, the validation columns of a real
run, and the analysis (time to target, loss at equal samples seen) on synthetic curves."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from adaptiveload.analysis import figures
from adaptiveload.analysis.convergence import (
    LOSS_AT_SAMPLES,
    TIME_TO_COMMON,
    TIME_TO_TARGET,
    Settings,
    compare,
    curves,
    first_reach,
    verdicts,
)
from adaptiveload.data import learnable
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.dataset import LatentDataset, sample_seed
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.model.architectures import get_config
from adaptiveload.model.attention import Execution
from adaptiveload.model.wan import WanModel
from adaptiveload.step_table import VAL_COLUMNS
from adaptiveload.tokens import SHAPE_CLASSES, shape_class
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.loop import step_metrics
from adaptiveload.training.settings import ObjectiveConfig, OptimConfig
from adaptiveload.training.validation import VAL_PREFIX, Validator, holdout

torch.set_num_threads(1)
SAMPLES = bucketize(synthesize("tiny-cpu", 200, 0), grid="tiny").samples.reset_index(drop=True)


def test_learnable_scenes_have_the_noise_shapes_and_carry_their_class_in_the_context():
    noise = LatentDataset(SAMPLES.head(20), text_len=4, text_dim=8)
    scenes = LatentDataset(SAMPLES.head(20), text_len=4, text_dim=8, content="learnable")
    for i in range(20):
        assert scenes[i]["latent"].shape == noise[i]["latent"].shape
        assert scenes[i]["context"].shape == noise[i]["context"].shape
    item = scenes[3]
    assert torch.equal(item["latent"], scenes[3]["latent"])  # regenerated from its id
    assert 0.5 < item["latent"].pow(2).mean() < 1.5  # unit mean square, like the noise
    assert torch.count_nonzero(item["context"][learnable.CONTEXT_TOKENS :]) == 0  # padded
    # the context is a function of (class, motion): same attributes, same context
    by_attrs: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(20):
        k, m, _ = learnable.scene_attributes(sample_seed(scenes.sample_ids[i], 0, "scene"))
        ctx = scenes[i]["context"]
        if (k, m) in by_attrs:
            assert torch.equal(by_attrs[(k, m)], ctx)
        else:
            assert all(not torch.equal(c, ctx) for c in by_attrs.values())
            by_attrs[(k, m)] = ctx
    assert len(by_attrs) > 3
    with pytest.raises(UserError, match=r"data\.content"):
        LatentDataset(SAMPLES, content="pictures")


def test_holdout_covers_every_shape_class_with_new_ids_and_training_shapes():
    held = holdout(SAMPLES, per_class=5)
    classes = held["bucket_frames"].map(shape_class)
    assert classes.value_counts().to_dict() == dict.fromkeys(SHAPE_CLASSES, 5)
    assert held["sample_id"].str.startswith(VAL_PREFIX).all()
    train_shapes = set(
        map(tuple, SAMPLES[["bucket_frames", "bucket_height", "bucket_width"]].values)
    )
    assert set(map(tuple, held.iloc[:, 1:].values)) <= train_shapes
    pd.testing.assert_frame_equal(held, holdout(SAMPLES, per_class=5))  # fixed per experiment
    clash = SAMPLES.assign(sample_id=SAMPLES["sample_id"].where(SAMPLES.index != 0, "val/image/0"))
    with pytest.raises(UserError, match="held-out validation id"):
        holdout(clash, per_class=5)


def test_validation_scores_a_packed_run_as_a_dense_one():
    """A model that runs packed micro-batches refuses dense ones: the held-out set goes to it
    in the run's layout, and each sample's loss is the dense model's (same weights, noise)."""
    cfg = get_config("wan2.1-micro")
    held = holdout(SAMPLES, per_class=1)
    data = LatentDataset(held, cfg.in_dim, cfg.text_len, cfg.text_dim, content="learnable")
    validator = Validator(data, ObjectiveConfig())
    cpu, scores = torch.device("cpu"), {}
    for layout in ("dense", "packed"):
        torch.manual_seed(0)
        model = WanModel(cfg, execution=Execution.on(layout, cpu))
        torch.nn.init.normal_(model.head.head.weight, std=0.02)  # Wan's zero head: no signal
        scores[layout] = validator.score(
            model, Ranks.emulated(2), cpu, nullcontext, layout == "packed"
        )
    assert set(scores["packed"]) == set(VAL_COLUMNS)
    for column in VAL_COLUMNS:
        assert scores["packed"][column] == pytest.approx(scores["dense"][column], rel=1e-5)


def test_lr_warms_up_linearly_then_stays_constant():
    optim = OptimConfig(lr=1.0, lr_warmup_steps=3)
    assert [optim.lr_at(s, 6) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert OptimConfig(lr=2.0).lr_at(0, 6) == 2.0  # no warm-up by default


def test_lr_decays_linearly_over_the_last_fraction_of_each_runs_steps():
    optim = OptimConfig(lr=1.0, lr_warmup_steps=1, lr_decay_fraction=0.5)
    assert [optim.lr_at(s, 6) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    # a run of fewer steps anneals over fewer: its last step at lr / (D + 1)
    assert [optim.lr_at(s, 4) for s in range(4)] == [0.5, 1.0, 2 / 3, 1 / 3]


def test_step_metrics_log_validation_only_where_it_was_scored():
    row = {
        "step": 3,
        "rank": 0,
        "compute_s": 1.0,
        "samples": 2,
        "tokens": 10,
        "tokens_sq": 50,
        "loss": 1.0,
        "step_time_s": 1.0,
        "step_wall_s": 1.0,
        "samples_seen": 8,
        "padding_samples": 0,
        "padding_tokens": 0,
        **dict.fromkeys(VAL_COLUMNS),
    }
    assert "val_loss" not in step_metrics([row], None)
    scored = step_metrics([{**row, "val_loss": 0.5, "val_loss_image": 0.4}], None)
    assert scored["val_loss"] == 0.5 and scored["val_loss_image"] == 0.4
    assert "val_loss_long" not in scored and scored["samples_seen"] == 8


def test_first_reach_interpolates_between_evaluations():
    x, loss = np.array([0.0, 10.0, 20.0]), np.array([2.0, 1.0, 0.5])
    assert first_reach(x, loss, 1.5) == pytest.approx(5.0)
    assert first_reach(x, loss, 0.75) == pytest.approx(15.0)
    assert first_reach(x, loss, 2.5) == 0.0
    assert np.isnan(first_reach(x, loss, 0.1))


def _synthetic_curves(speed: dict[str, float], offset: dict[str, float]) -> pd.DataFrame:
    """Aggregated-step rows of runs whose loss is 2 * exp(-t / 50) + offset, t their clock at
    `speed` times the baseline's rate (a faster policy takes less time per step)."""
    rows = []
    for policy, factor in speed.items():
        for seed in range(4):
            jitter = 1 + 0.01 * (seed - 1.5)
            for step in range(40):
                t = (step + 1) * 2.0 * jitter / factor
                loss = 2 * np.exp(-(step + 1) / 8) + offset[policy] + 0.002 * seed
                rows.append(
                    {
                        "setup": "train",
                        "variant": "base",
                        "policy": policy,
                        "kernel": "eager",
                        "seed": seed,
                        "source": "measured",
                        "label": "measured (cpu thread time, test)",
                        "steps_per_epoch": "free",
                        "step": step,
                        "rank": 0,
                        "step_time_s": 2.0 * jitter / factor,
                        "samples_seen": 10 * (step + 1),
                        "val_loss": loss if step % 4 == 3 or step == 0 else np.nan,
                        **{c: loss for c in VAL_COLUMNS[1:]},
                        "_t": t,
                    }
                )
    return pd.DataFrame(rows).drop(columns="_t")


def test_analysis_resolves_a_faster_policy_and_calls_an_equal_one_unresolved():
    steps = _synthetic_curves(
        {"equal-token": 1.0, "adaptiveload": 1.25, "adaptiveload-packed": 1.0},
        {"equal-token": 0.1, "adaptiveload": 0.1, "adaptiveload-packed": 0.1},
    )
    curve = curves(steps)
    assert set(curve["step"]) == {0, *range(3, 40, 4)}
    table = compare(curve, Settings("equal-token", 0))
    fast = table[(table["policy"] == "adaptiveload") & (table["metric"] == TIME_TO_TARGET)]
    assert fast["estimate"].item() == pytest.approx(1 / 1.25, rel=1e-6)  # same steps, 1.25x rate
    # 4 of 4 seeds sooner: the CI excludes 1, p is the least 4 paired seeds can give
    assert fast["ci_high"].item() < 1 and fast["p_value"].item() == pytest.approx(2 / 2**4)
    same = table[(table["policy"] == "adaptiveload-packed") & (table["metric"] == LOSS_AT_SAMPLES)]
    assert same["ci_low"].item() <= 1 <= same["ci_high"].item()
    lines = verdicts(table)
    assert any(line.startswith("adaptiveload (") and "reaches it sooner" in line for line in lines)
    assert any(line.startswith("adaptiveload-packed") and "no difference" in line for line in lines)


def test_analysis_says_when_a_policy_never_reaches_the_target():
    steps = _synthetic_curves(
        {"equal-token": 1.0, "adaptiveload": 1.0}, {"equal-token": 0.1, "adaptiveload": 0.3}
    )
    table = compare(curves(steps), Settings("equal-token", 0))
    late = table[(table["policy"] == "adaptiveload") & (table["metric"] == TIME_TO_TARGET)]
    assert late["n_reached"].item() == 0 and np.isnan(late["estimate"].item())
    assert any("4 of 4 seeds never reached it" in line for line in verdicts(table))
    worse = table[(table["policy"] == "adaptiveload") & (table["metric"] == LOSS_AT_SAMPLES)]
    assert worse["ci_low"].item() > 1  # a higher loss at equal samples, resolved
    # the loss every run reaches: the policy's own worst final, timed for every seed
    common = table[(table["policy"] == "adaptiveload") & (table["metric"] == TIME_TO_COMMON)]
    assert common["n_reached"].item() == 4 and common["ci_low"].item() > 1


def test_the_figure_draws_a_panel_per_axis():
    steps = _synthetic_curves(
        {"equal-token": 1.0, "adaptiveload": 1.1}, {"equal-token": 0.1, "adaptiveload": 0.1}
    )
    # the figure reads the aggregated steps only
    unscored = SimpleNamespace(steps=steps.drop(columns=list(VAL_COLUMNS)))
    fig = figures.convergence(unscored)
    assert "not available" in fig.axes[0].texts[0].get_text()  # no validation: a placeholder
    fig = figures.convergence(SimpleNamespace(steps=steps))
    assert len(fig.axes) == 3 and all(len(ax.lines) == 2 for ax in fig.axes)
