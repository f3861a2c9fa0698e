"""Cost model: fit recovers known coefficients; exponent; budget rules; analytic counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaptiveload.calibration.fit import fit
from adaptiveload.costmodel import (
    Calibration,
    CostModel,
    capacity_for,
    derive_budgets,
    local_exponent,
    reference_tokens,
)
from adaptiveload.errors import UserError
from adaptiveload.model import analytic
from adaptiveload.model.architectures import get_config
from adaptiveload.model.wan import build_on_meta, count_parameters

TRUE = CostModel(
    c0=0.02, a=3e-6, b=2e-10, m_static=2e9, m_tok=3e5, m_seq=4e6, c_seq=1e-4
)


def _grid():
    B, S = np.meshgrid([1, 2, 4, 8], [256, 1024, 4096, 16384, 32768])
    return B.ravel(), S.ravel()


def test_fit_recovers_known_coefficients_exactly():
    B, S = _grid()
    cost, stats = fit(B, S, TRUE.step_time(B, S), TRUE.memory(B, S))
    for name in ("c0", "a", "b", "c_seq", "m_static", "m_tok", "m_seq"):
        assert getattr(cost, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert stats.r2 == pytest.approx(1.0) and stats.max_rel_err < 1e-6
    assert stats.mem_r2 == pytest.approx(1.0) and stats.num_points == B.size


def test_fit_with_noise_is_close_and_reports_the_error():
    B, S = _grid()
    rng = np.random.default_rng(0)
    times = TRUE.step_time(B, S) * (1 + 0.03 * rng.standard_normal(B.size))
    cost, stats = fit(B, S, times)
    assert cost.b == pytest.approx(TRUE.b, rel=0.1)
    assert cost.a == pytest.approx(TRUE.a, rel=0.2)
    assert 0.95 < stats.r2 < 1.0
    assert 0.01 < stats.max_rel_err < 0.2


def test_fit_is_non_negative_and_three_term_form_pins_c_seq():
    B, S = _grid()
    times = 0.05 + B * 1e-6 * S  # purely linear: b must come out 0, not negative
    cost, _ = fit(B, S, times, per_sample=False)
    assert cost.b >= 0 and cost.c_seq == 0 and cost.a == pytest.approx(1e-6, rel=1e-6)


@pytest.mark.parametrize(
    "args",
    [
        ([1, 2], [16, 64], [0.1, 0.2]),  # too few points
        ([1, 2, 4], [64, 64, 64], [0.1, 0.2, 0.4]),  # one token count: b not identifiable
        ([1, 2, 4], [16, 64, 256], [0.1, 0.0, 0.4]),  # a zero time
    ],
)
def test_fit_rejects_unfittable_input(args):
    with pytest.raises(ValueError):
        fit(*args)


def test_effective_exponent_limits():
    linear = CostModel(c0=0, a=1.0, b=0.0)
    quadratic = CostModel(c0=0, a=0.0, b=1.0)
    assert linear.effective_exponent(10, 1000) == pytest.approx(1.0)
    assert quadratic.effective_exponent(10, 1000) == pytest.approx(2.0)
    mixed = CostModel(c0=0, a=1.0, b=1e-3)  # attention = linear at S* = 1000
    assert 1.0 < mixed.effective_exponent(100, 10_000) < 2.0
    assert local_exponent(mixed, 1000) == pytest.approx(1.5)


def test_budgets_follow_the_documented_rules():
    tokens = np.array([256] * 50 + [1024] * 30 + [4096] * 20)
    budgets = derive_budgets(TRUE, tokens, capacity_bytes=80e9, headroom=0.1)
    s_lo, s_hi = np.percentile(tokens, [5, 95])
    assert budgets.p == pytest.approx(TRUE.effective_exponent(s_lo, s_hi))
    # M_mem: the largest B*S under capacity at the smallest S, and B = M_mem/S really fits
    usable = 80e9 * 0.9
    assert TRUE.memory(budgets.m_mem / 256, 256) == pytest.approx(usable)
    for s in (256, 1024, 4096):
        assert TRUE.memory(np.floor(budgets.m_mem / s), s) <= usable
    # reference batch: the heaviest bucket (4096, not the most common 256) at its
    # memory-limited batch; equal-token equalises tokens to it, AdaptiveLoad compute
    assert budgets.ref_tokens == 4096 and budgets.ref_batch == int(budgets.m_mem // 4096) == 54
    assert budgets.m_tok == 54 * 4096 < budgets.m_mem
    assert budgets.m_comp == pytest.approx(54 * 4096**budgets.p)
    assert budgets.max_fits
    override = derive_budgets(TRUE, tokens, 80e9, 0.1, ref_tokens=1024, ref_batch=2)
    assert (override.ref_tokens, override.ref_batch) == (1024, 2)
    assert override.m_tok == 2048 and override.m_comp == pytest.approx(2 * 1024**override.p)
    assert override.m_mem == budgets.m_mem


def test_capacity_for_inverts_the_memory_budget():
    """A pretend capacity sized for an M_mem gives that M_mem back, and its reference batch
    is the bucket M_mem was sized to (the rounding of the round trip is allowed for)."""
    tokens = np.array([256] * 50 + [1024] * 30 + [4096] * 20)
    capacity = capacity_for(TRUE, 4096.0, headroom=0.1, s_min=256.0)
    budgets = derive_budgets(TRUE, tokens, capacity, headroom=0.1)
    assert budgets.m_mem == pytest.approx(4096.0, rel=1e-12)
    assert (budgets.ref_tokens, budgets.ref_batch, budgets.m_tok) == (4096, 1, 4096)
    with pytest.raises(UserError, match="headroom"):
        capacity_for(TRUE, 4096.0, headroom=1.0, s_min=256.0)


def test_m_comp_follows_p_along_the_reference_batch_and_scales():
    tokens = np.array([256] * 50 + [1024] * 30 + [4096] * 20)
    d = derive_budgets(TRUE, tokens, capacity_bytes=80e9, headroom=0.1)
    cal = Calibration(model="m", device="d", source="model", cost=TRUE, p=d.p, m_mem=d.m_mem,
                      m_comp=d.m_comp, m_tok=d.m_tok, extra={"budgets": d.to_dict()})
    assert cal.m_comp_at() == cal.m_comp_at(d.p) == d.m_comp
    assert cal.m_comp_at(1.8) == d.ref_batch * 4096**1.8
    assert cal.m_comp_at(1.8, scale=0.5) == 0.5 * cal.m_comp_at(1.8)
    assert cal.m_comp_at(scale=4.0) == 4.0 * d.m_comp
    legacy = Calibration(model="m", device="d", source="model", cost=TRUE, p=d.p,
                         m_mem=d.m_mem, m_comp=d.m_comp)
    assert legacy.m_comp_at(d.p, 2.0) == 2.0 * d.m_comp  # its own p needs no reference
    with pytest.raises(UserError, match="no reference batch"):
        legacy.m_comp_at(1.8)


def test_reference_skips_buckets_that_do_not_fit_alone():
    tokens = [256] * 5 + [1024] * 3 + [4096] * 2
    # 3 GB: one 4096-token sample needs 3.23 GB > 2.7 GB usable -> the next bucket, 1024
    small = derive_budgets(TRUE, tokens, capacity_bytes=3e9, headroom=0.1)
    assert TRUE.memory(1, 4096) > 3e9 * 0.9 and not small.max_fits
    assert 1024 <= small.m_mem < 4096
    assert (small.ref_tokens, small.ref_batch) == (1024, int(small.m_mem // 1024))
    assert small.m_tok == small.ref_batch * 1024 <= small.m_mem
    assert small.m_comp == pytest.approx(small.ref_batch * 1024**small.p)
    # 4096 fits alone physically here, but lies above M_mem (bound at the 16-token images):
    # AdaptiveLoad treats it as oversize, so it cannot be the reference both policies share
    images = [16] * 5 + [1024] * 3 + [4096] * 2
    tight = derive_budgets(TRUE, images, capacity_bytes=4.4e9, headroom=0.1)
    assert TRUE.memory(1, 4096) <= 4.4e9 * 0.9 and tight.max_fits and tight.m_mem < 4096
    assert tight.ref_tokens == 1024 and tight.m_tok == tight.ref_batch * 1024 <= tight.m_mem


def test_adaptiveload_never_batches_fewer_than_equal_token_below_the_reference():
    from adaptiveload.planning.policies import Budgets, batch_size

    tokens = np.array([256, 512, 1024, 2048, 4096] * 3)
    d = derive_budgets(TRUE, tokens, capacity_bytes=13.5e9, headroom=0.1)  # M_mem ~ 7.8 x 4096
    budgets = Budgets(m_tok=d.m_tok, m_mem=d.m_mem, m_comp=d.m_comp, p=d.p)
    s = np.unique(tokens)
    equal, adaptive = batch_size("equal-token", s, budgets), batch_size("adaptiveload", s, budgets)
    assert d.ref_tokens == 4096 and equal[-1] == adaptive[-1] == d.ref_batch
    assert np.all(adaptive >= equal) and np.any(adaptive > equal)
    assert np.all(adaptive * s <= d.m_mem)


def test_budgets_reject_bad_input():
    with pytest.raises(UserError, match="no samples"):
        derive_budgets(TRUE, [], 80e9)
    with pytest.raises(UserError, match="static memory"):
        derive_budgets(TRUE, [256, 1024], capacity_bytes=1e9)
    with pytest.raises(UserError, match="no sample fits the memory budget on its own"):
        derive_budgets(TRUE, [4096, 8192], capacity_bytes=3e9)


def test_p_is_clamped_to_1_2_and_the_raw_value_kept():
    flat = CostModel(c0=0.0, a=1e-9, b=0.0, m_tok=1.0, c_seq=1.0)  # per-sample cost ~constant
    budgets = derive_budgets(flat, [16, 64, 256, 1024], 1e9)
    assert budgets.p == 1.0 and budgets.p_unclamped < 0.1


def test_single_bucket_uses_the_local_exponent():
    budgets = derive_budgets(TRUE, [1024] * 10, 80e9)
    assert budgets.p == pytest.approx(local_exponent(TRUE, 1024))


def test_analytic_flops_match_the_hand_count():
    """The forward FLOPs per token, per token^2 and per sample counted by hand from the model
    shapes (docs/calibration.md, "Analytic FLOPs of a sample")."""
    small = analytic.flop_terms(get_config("wan2.1-t2v-1.3b"))
    assert small.linear == pytest.approx(2.60e9, rel=0.01)
    assert small.attention == pytest.approx(1.84e5, rel=0.01)
    assert small.per_sample == pytest.approx(0.145e12, rel=0.07)
    big = analytic.flop_terms(get_config("wan2.1-t2v-14b"))
    assert big.linear == pytest.approx(24.3e9, rel=0.01)
    assert big.per_sample == pytest.approx(2.15e12, rel=0.03)
    cfg = get_config("wan2.1-t2v-1.3b")
    assert analytic.training_flops(cfg, 2, 1000) == pytest.approx(6 * small.forward(1000))


@pytest.mark.parametrize("compute_bytes", [4, 2])
def test_activation_count_matches_autograd_saved_tensors(compute_bytes):
    """The per-token byte count of a block against what autograd really saves: fp32, and bf16
    autocast (on CPU, the same casts as on CUDA)."""
    import torch

    from adaptiveload.model.wan import WanModel

    cfg = get_config("wan2.1-micro")
    setup = analytic.TrainingSetup(compute_bytes=compute_bytes, activation_checkpointing=False)
    autocast = compute_bytes == 2
    block = WanModel(cfg).blocks[0]

    def saved_bytes(tokens: int) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            if t.requires_grad or t.grad_fn is not None or t.numel() > cfg.dim:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, tokens, cfg.dim, requires_grad=True)
        e0 = torch.randn(1, 6, cfg.dim)
        context = torch.randn(1, cfg.text_len, cfg.dim)
        cos, sin = torch.ones(tokens, cfg.head_dim // 2), torch.zeros(tokens, cfg.head_dim // 2)
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            block(x, e0, context, (cos, sin))
        return sum(seen.values())

    measured = (saved_bytes(512) - saved_bytes(256)) / 256
    predicted = analytic.activation_bytes_per_token_block(cfg, setup)
    assert predicted == pytest.approx(measured, rel=0.1)


def test_memory_terms_shard_the_static_state():
    cfg = get_config("wan2.1-t2v-14b")
    params = count_parameters(build_on_meta(cfg))
    one = analytic.memory_terms(cfg, params, analytic.TrainingSetup())
    sixteen = analytic.memory_terms(cfg, params, analytic.TrainingSetup(shard_world_size=16))
    assert one[0] == pytest.approx(16 * sixteen[0]) and one[1:] == sixteen[1:]
    assert one[0] > 141e9  # why the 14B prior assumes a sharded optimizer state


def test_reference_rules_pick_the_heaviest_most_common_or_median_fitting_bucket():
    tok = np.array([100.0] + [300.0] * 4 + [500.0] * 3 + [900.0] * 3 + [5000.0])
    m_mem = 1000.0  # 5000 does not fit alone and is never the reference
    assert reference_tokens(tok, m_mem) == 900.0
    assert reference_tokens(tok, m_mem, "most-common") == 300.0
    assert reference_tokens(tok, m_mem, "median") == 500.0  # 6th of 11 fitting samples
    ties = np.array([100.0, 100.0, 700.0, 700.0])
    assert reference_tokens(ties, m_mem, "most-common") == 700.0
    with pytest.raises(UserError, match="reference rule"):
        reference_tokens(tok, m_mem, "lightest")


def test_floor_holds_small_batches_and_leaves_large_ones_alone():
    floored = CostModel(c0=0.05, a=4e-5, b=1.4e-9, t_floor=0.28)
    assert floored.step_time(1, 1560) == pytest.approx(0.28)
    assert floored.step_time(2, 1560) == pytest.approx(0.28)  # no slower than B = 1 there
    big = CostModel(c0=0.05, a=4e-5, b=1.4e-9)
    assert floored.step_time(2, 32760) == pytest.approx(big.step_time(2, 32760))
    # p is a property of the per-sample cost: the floor does not change it
    assert floored.effective_exponent(1530, 75600) == big.effective_exponent(1530, 75600)


def test_fit_measured_recovers_a_floored_model():
    from adaptiveload.calibration.fit import fit_measured

    true = CostModel(c0=0.06, a=4e-5, b=1.4e-9, t_floor=0.28)
    S = np.array([1560, 3120, 7200, 16380, 32760, 50400, 75600, 1560, 3120, 7200, 16380])
    B = np.array([1] * 7 + [2] * 4)
    cost, stats = fit_measured(B, S, true.step_time(B, S))
    assert stats.form == "floored" and stats.loo_max < 1e-3
    for name in ("t_floor", "c0", "a", "b"):
        assert getattr(cost, name) == pytest.approx(getattr(true, name), rel=1e-3), name


def test_samples_over_the_device_capacity_are_excluded_and_counted():
    import pandas as pd

    from adaptiveload.costmodel import Calibration
    from adaptiveload.planning.plan import build_plan
    from adaptiveload.planning.policies import Budgets

    tokens = np.array([256] * 40 + [1024] * 20 + [4096] * 6)
    frame = pd.DataFrame(
        {
            "sample_id": np.arange(tokens.size),
            "bucket_frames": 1,
            "bucket_height": 16,
            "bucket_width": tokens,
            "tokens": tokens,
        }
    )
    cal = Calibration(model="m", device="d", source="model", cost=TRUE, p=1.5, m_mem=8192,
                      m_comp=8192**1.5, m_tok=8192, capacity_bytes=3e9)
    assert TRUE.memory(1, 4096) > 3e9 > TRUE.memory(1, 1024)
    plan = build_plan(frame, "adaptiveload", Budgets.resolve(calibration=cal), 4, 0,
                      cost_model=cal)
    real = plan.table[~plan.table["is_padding"]]
    assert plan.summary["num_over_capacity"] == 6 and plan.summary["num_excluded"] == 6
    assert plan.summary["num_samples"] == 66 and plan.summary["num_planned"] == 60
    assert real["tokens"].max() == 1024


def test_cost_of_a_set_is_additive_and_equals_the_batch_form_for_one_shape():
    floored = CostModel(**{**TRUE.__dict__, "t_floor": 0.05})
    for batch, tokens in zip(*_grid(), strict=True):
        same = [tokens] * batch
        assert floored.set_time(same) == pytest.approx(float(floored.step_time(batch, tokens)))
        assert TRUE.set_memory(same) == pytest.approx(float(TRUE.memory(batch, tokens)))
    mixed = [1560, 1560, 7200, 32760]
    by_sample = TRUE.c0 + sum(float(TRUE.per_sample_time(s)) for s in mixed)
    assert TRUE.set_time(mixed) == pytest.approx(by_sample)
    # attention is per sample: a pack costs sum S_i^2, far below one sample of sum S_i
    assert TRUE.set_time(mixed) < float(TRUE.step_time(1, sum(mixed)))
    assert TRUE.set_memory(mixed) == pytest.approx(
        TRUE.m_static + sum(TRUE.m_tok * s + TRUE.m_seq for s in mixed)
    )
    # vectorised over packs by their sufficient statistics; an empty pack costs nothing
    n, s1 = np.array([0, 4]), np.array([0, sum(mixed)])
    s2 = np.array([0, sum(s * s for s in mixed)])
    assert floored.pack_time(n, s1, s2)[0] == 0.0
    assert floored.pack_time(n, s1, s2)[1] == pytest.approx(floored.set_time(mixed))
    assert floored.set_time([1560]) == pytest.approx(0.05)  # the floor holds a small pack too


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("cost.m_static", -1e9, "field 'cost.m_static' is -1000000000.0; must be >= 0"),
        ("cost.c0", -100, "field 'cost.c0' is -100; must be >= 0"),
        ("cost.a", -1, "field 'cost.a' is -1; must be >= 0"),
        ("p", 0.5, "field 'p' is 0.5; must be >= 1"),
        ("m_comp", -5.0, "field 'm_comp' is -5.0; must be a positive number"),
        ("capacity_bytes", 0, "field 'capacity_bytes' is 0; must be a positive number"),
        ("comm.links", [{"degree": 2, "latency_s": 1e-5, "bytes_per_s": -1.0}],
         "field 'comm.links[0].bytes_per_s' must be a positive number"),
    ],
)
def test_a_calibration_file_is_validated_on_load(tmp_path, field, value, says):
    """Signs and finiteness of a calibration file, checked when it is read: a negative
    memory or time term planned with exit 0 before (a predicted VRAM utilization of -195)."""
    data = {"model": "wan2.1-micro", "device": "cpu", "source": "measured", "p": 1.5,
            "m_mem": 1e9, "m_comp": 1e6, "capacity_bytes": 2e9,
            "cost": {"c0": 0.01, "a": 1e-5, "b": 1e-9, "m_static": 1e8, "m_tok": 1e4},
            "comm": {"source": "model", "backend": "nccl", "device": "x", "dtype_bytes": 2,
                     "links": [{"degree": 2, "latency_s": 1e-5, "bytes_per_s": 1e11}]}}
    Calibration.load(_write(tmp_path / "ok.json", data))
    *sections, last = field.split(".")
    target = data
    for name in sections:
        target = target[name]
    target[last] = value
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(UserError) as exc:
        Calibration.load(path)
    assert str(exc.value).startswith(f"{path}: ") and says in str(exc.value)
    assert "\n" not in str(exc.value)


def _write(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)
