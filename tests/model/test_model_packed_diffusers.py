"""Packing for diffusers' unmodified WanTransformer3DModel (`model.diffusers_wan.PackedWan`) and
LoRA (peft) on both packed paths: a packed micro-batch gives what diffusers' own forward gives
each sample alone (outputs and every trainable gradient, fp32, relative <= 1e-5), at two
widths, with and without gradient checkpointing; LoRA gradients packed == per sample on
diffusers' model and on WanModel."""

from __future__ import annotations

import copy

import pytest
import torch

from adaptiveload.data.packed import collate
from adaptiveload.model.architectures import WanConfig, get_config
from adaptiveload.model.wan import WanModel
from adaptiveload.model.weights import layout_config

diffusers = pytest.importorskip("diffusers")
from adaptiveload.model.diffusers_wan import PackedWan  # noqa: E402

torch.set_num_threads(2)
RTOL = 1e-5
MICRO = get_config("wan2.1-micro")
# two widths: head dim 16 (RoPE 8/4/4) and 32 (12/10/10), two layers each
WIDTHS = [
    WanConfig("w32", dim=32, ffn_dim=64, num_heads=2, num_layers=2, freq_dim=32, text_len=8,
              text_dim=32),
    WanConfig("w96", dim=96, ffn_dim=128, num_heads=3, num_layers=2, freq_dim=32, text_len=8,
              text_dim=32),
]
# latent [T', H', W']: images and clips; (1, 8, 12) and (1, 12, 8) are 24 tokens on two grids
MIX = [(1, 8, 12), (3, 8, 8), (1, 12, 8), (1, 8, 12), (2, 6, 10), (5, 4, 4)]


def _diffusers(cfg: WanConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(**layout_config(cfg, "diffusers"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _batch(cfg: WanConfig, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    items = [{"sample_id": f"s{i}", "latent": torch.randn(cfg.in_dim, *shape, generator=gen),
              "context": torch.randn(cfg.text_len, cfg.text_dim, generator=gen)}
             for i, shape in enumerate(MIX)]
    batch = collate(items)
    t = torch.linspace(3.0, 990.0, batch.num_samples)
    weights = [torch.randn(g.shape, generator=gen) for g in batch.latents]
    return batch, t, weights


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm())


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _packed(model, batch, t, weights):
    """Outputs and trainable gradients of the packed call under sum_i <out_i, w_i>."""
    outs = model(list(batch.latents), t, batch.context)
    sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
    return outs, _grads(model)


def _alone(call, model, batch, t, weights):
    """The same, each sample through `call(x, t, context)` alone (gradients accumulate)."""
    outs, i = [], 0
    for group, w in zip(batch.latents, weights, strict=True):
        parts = []
        for j in range(group.shape[0]):
            out = call(group[j : j + 1], t[i : i + 1], batch.context[i : i + 1])
            (out * w[j : j + 1]).sum().backward()
            parts.append(out)
            i += 1
        outs.append(torch.cat(parts))
    return outs, _grads(model)


def _diffusers_alone(ref):
    return lambda x, t, c: ref(x, timestep=t, encoder_hidden_states=c, return_dict=False)[0]


def _assert_close(packed, alone, strip: str = "") -> None:
    (outs, grads), (want_outs, want_grads) = packed, alone
    for got, want in zip(outs, want_outs, strict=True):
        assert got.shape == want.shape and _rel(got, want) <= RTOL
    assert grads and {k.removeprefix(strip) for k in grads} == set(want_grads)
    worst = max((_rel(g, want_grads[k.removeprefix(strip)]), k) for k, g in grads.items())
    assert worst[0] <= RTOL, worst


@pytest.mark.parametrize(
    ("cfg", "checkpointing"),
    [(WIDTHS[0], False), (WIDTHS[1], False), (WIDTHS[0], True)],
    ids=["w32", "w96", "w32-checkpointed"],
)
def test_packed_equals_diffusers_per_sample(cfg, checkpointing):
    ref = _diffusers(cfg)
    model = copy.deepcopy(ref)
    if checkpointing:
        model.enable_gradient_checkpointing()
    adapter = PackedWan(model)
    batch, t, weights = _batch(cfg)
    assert (len(batch.latents), batch.num_samples) == (5, 6)  # a group of 2; 24 tokens twice
    _assert_close(_packed(adapter, batch, t, weights),
                  _alone(_diffusers_alone(ref), ref, batch, t, weights), strip="transformer.")


def test_dense_through_the_adapter_is_diffusers_forward():
    ref = _diffusers(WIDTHS[0])
    adapter = PackedWan(copy.deepcopy(ref))
    x, ctx = torch.randn(2, 16, 2, 8, 12), torch.randn(2, 8, 32)
    t = torch.tensor([10.0, 700.0])
    with torch.no_grad():
        want = _diffusers_alone(ref)(x, t, ctx)
        assert _rel(adapter(x, t, ctx), want) <= RTOL
        (one,) = adapter([x], t, ctx)  # a pack of one shape: the same numbers
        assert _rel(one, want) <= RTOL


def test_adapter_refuses_what_it_cannot_pack():
    from adaptiveload.errors import UserError

    with pytest.raises(UserError, match="wraps a diffusers WanTransformer3DModel"):
        PackedWan(WanModel(MICRO))
    i2v = diffusers.WanTransformer3DModel(**{**layout_config(MICRO, "diffusers"),
                                            "image_dim": 32, "added_kv_proj_dim": 32})
    with pytest.raises(UserError, match="I2V model"):
        PackedWan(i2v)


def _lora(targets: list[str]):
    peft = pytest.importorskip("peft")
    # random A and B (peft's default zero B would leave A without a gradient)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


def test_lora_through_the_adapter_packed_equals_per_sample():
    cfg = WIDTHS[0]
    ref = _diffusers(cfg)
    torch.manual_seed(1)
    ref.add_adapter(_lora(["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2"]))
    model = copy.deepcopy(ref)
    for m in (ref, model):  # the base frozen, only LoRA trains
        for name, p in m.named_parameters():
            p.requires_grad_("lora_" in name)
    batch, t, weights = _batch(cfg)
    packed = _packed(PackedWan(model), batch, t, weights)
    assert all("lora_" in k for k in packed[1])
    assert len(packed[1]) == 2 * 2 * 9  # A and B; 2 blocks; 9 Linears each
    _assert_close(packed, _alone(_diffusers_alone(ref), ref, batch, t, weights),
                  strip="transformer.")


def test_lora_on_wan_model_packed_equals_per_sample():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = WanModel(MICRO)
    with torch.no_grad():  # Wan zero-inits the head, which would hide every upstream gradient
        model.head.head.weight.normal_(std=0.02)
    model = peft.inject_adapter_in_model(_lora(["q", "k", "v", "o", "ffn.0"]), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    batch, t, weights = _batch(MICRO)
    packed = _packed(model, batch, t, weights)
    model.zero_grad(set_to_none=True)
    _assert_close(packed, _alone(model, model, batch, t, weights))
    assert len(packed[1]) == 2 * (4 * 2 + 1)  # A, B of q, k, v, o (self, cross) and ffn.0
