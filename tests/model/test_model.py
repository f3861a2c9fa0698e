"""Wan 2.1 model: configs, parameter counts, shapes, gradients, switches."""

from __future__ import annotations

import pytest
import torch

from adaptiveload.errors import UserError
from adaptiveload.model import modulate
from adaptiveload.model.architectures import CONFIGS, get_config
from adaptiveload.model.wan import WanModel, build_on_meta, count_parameters

torch.set_num_threads(2)


@pytest.mark.parametrize(
    ("name", "expected"), [("wan2.1-t2v-1.3b", 1.419e9), ("wan2.1-t2v-14b", 14.29e9)]
)
def test_parameter_counts_of_released_configs(name, expected):
    params = count_parameters(build_on_meta(get_config(name)))
    assert abs(params / expected - 1) <= 0.01, params


def test_released_config_facts():
    small, big = get_config("wan2.1-t2v-1.3b"), get_config("wan2.1-t2v-14b")
    assert (small.dim, small.ffn_dim, small.num_heads, small.num_layers) == (1536, 8960, 12, 30)
    assert (big.dim, big.ffn_dim, big.num_heads, big.num_layers) == (5120, 13824, 40, 40)
    for cfg in (small, big):
        assert cfg.head_dim == 128 and cfg.rope_split == (44, 42, 42)
        assert (cfg.text_len, cfg.text_dim, cfg.freq_dim, cfg.eps) == (512, 4096, 256, 1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rope_split_covers_the_head(name):
    cfg = get_config(name)
    assert sum(cfg.rope_split) == cfg.head_dim
    assert all(d > 0 and d % 2 == 0 for d in cfg.rope_split)


def test_unknown_config_is_a_user_error():
    with pytest.raises(UserError, match=r"wan2\.1-tiny"):
        get_config("wan2.1-huge")


def _inputs(cfg, batch=2, grid=(2, 4, 6), seed=0):
    gen = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(batch, cfg.in_dim, f, 2 * h, 2 * w, generator=gen)
    t = torch.rand(batch, generator=gen) * 1000
    context = torch.randn(batch, cfg.text_len, cfg.text_dim, generator=gen)
    return x, t, context


def _model(cfg, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = WanModel(cfg, **kwargs)
    with torch.no_grad():  # Wan zero-inits the head, which would hide every upstream gradient
        model.head.head.weight.normal_(std=0.02)
    return model


def test_forward_shape_dtype_and_every_parameter_gets_a_gradient():
    cfg = get_config("wan2.1-micro")
    model = _model(cfg)
    x, t, context = _inputs(cfg)
    out = model(x, t, context)
    assert out.shape == x.shape and out.dtype == torch.float32
    out.square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_init_is_deterministic_and_head_starts_at_zero():
    cfg = get_config("wan2.1-micro")
    torch.manual_seed(3)
    a = WanModel(cfg)
    torch.manual_seed(3)
    b = WanModel(cfg)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    x, t, context = _inputs(cfg)
    assert not a(x, t, context).any()


def test_samples_are_independent_within_a_batch():
    cfg = get_config("wan2.1-micro")
    model = _model(cfg).eval()
    x, t, context = _inputs(cfg, batch=3)
    with torch.no_grad():
        full = model(x, t, context)
        one = model(x[1:2], t[1:2], context[1:2])
    torch.testing.assert_close(full[1:2], one, rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_gives_the_same_gradients():
    cfg = get_config("wan2.1-micro")
    grads = []
    for ckpt in (False, True):
        model = _model(cfg, activation_checkpointing=ckpt)
        x, t, context = _inputs(cfg)
        model(x, t, context).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_ln_modulate_switch():
    cfg = get_config("wan2.1-micro")
    model = _model(cfg)
    sites = [m for m in model.modules() if isinstance(m, modulate.LnModulate)]
    assert len(sites) == 2 * cfg.num_layers + 1
    with pytest.raises(ValueError, match="unknown ln_modulate_impl"):
        model.set_ln_modulate_impl("triton")
    x, t, context = _inputs(cfg)
    with torch.no_grad():
        eager = model(x, t, context)
    model.set_ln_modulate_impl("fused")  # the fused op: reference math where not built / CPU
    assert all(site.impl == "fused" for site in sites)
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, context), eager, rtol=1e-4, atol=1e-5)


def test_bad_latent_shape_is_rejected():
    cfg = get_config("wan2.1-micro")
    model = _model(cfg)
    x, t, context = _inputs(cfg)
    with pytest.raises(ValueError, match="not divisible by patch"):
        model(x[..., :-1], t, context)
