"""Packed micro-batches of the micro Wan for the model's packing tests: items of given latent
shapes, the model with a non-zero head, relative error and gradients, and the two exactness
checks both lanes run (tests/model/ without activation checkpointing, tests/slow/model/ with
it)."""

from __future__ import annotations

import torch

from adaptiveload.data.packed import collate
from adaptiveload.model.architectures import get_config
from adaptiveload.model.wan import WanModel

CFG = get_config("wan2.1-micro")
RTOL = 1e-5
# latent [C, T', H', W'] shapes: images and clips; (1, 8, 12) and (1, 12, 8) both give 24
# tokens on different grids (one attention run of two shape groups), 48, 30 and 20 others
MIX = [(1, 8, 12), (3, 8, 8), (1, 12, 8), (1, 8, 12), (2, 6, 10), (3, 8, 8), (5, 4, 4)]


def micro_wan(impl: str = "eager", checkpointing: bool = False, seed: int = 0) -> WanModel:
    """The micro Wan, seeded, with a non-zero head."""
    torch.manual_seed(seed)
    net = WanModel(CFG, ln_modulate_impl=impl, activation_checkpointing=checkpointing)
    with torch.no_grad():  # Wan zero-inits the head, which would hide every upstream gradient
        net.head.head.weight.normal_(std=0.02)
    return net


def items(shapes: list[tuple[int, int, int]], seed: int = 0) -> list[dict]:
    """Dataset items (sample_id, latent, text context) of the given latent [T', H', W']."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "sample_id": f"s{i}",
            "latent": torch.randn(CFG.in_dim, *shape, generator=gen),
            "context": torch.randn(CFG.text_len, CFG.text_dim, generator=gen),
        }
        for i, shape in enumerate(shapes)
    ]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative norm error of `got` against `want`."""
    return float((got - want).detach().norm() / want.detach().norm())


def grads(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name."""
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def _packed_and_alone(impl: str, checkpointing: bool):
    """(outputs, grads) of the packed batch and of every sample run alone (dense, B = 1),
    each under the loss sum_i <out_i, w_i> with fixed random weights w_i."""
    batch = collate(items(MIX))
    g = batch.num_samples
    t = torch.linspace(3.0, 990.0, g)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(grp.shape, generator=gen) for grp in batch.latents]

    net = micro_wan(impl, checkpointing)
    packed = net(list(batch.latents), t, batch.context)
    sum((out * w).sum() for out, w in zip(packed, weights, strict=True)).backward()
    packed_grads = grads(net)

    net.zero_grad(set_to_none=True)
    alone, i = [], 0
    for grp, w in zip(batch.latents, weights, strict=True):
        outs = []
        for j in range(grp.shape[0]):
            out = net(grp[j : j + 1], t[i : i + 1], batch.context[i : i + 1])
            (out * w[j : j + 1]).sum().backward()  # gradients accumulate over samples
            outs.append(out)
            i += 1
        alone.append(torch.cat(outs))
    return packed, packed_grads, alone, grads(net)


def check_packed_equals_alone(impl: str, checkpointing: bool) -> None:
    """A pack of MIX gives each sample's output and every parameter gradient as that sample
    run alone, fp32, <= RTOL relative."""
    packed, packed_grads, alone, alone_grads = _packed_and_alone(impl, checkpointing)
    assert [tuple(p.shape) for p in packed] == [tuple(a.shape) for a in alone]
    assert len(packed) == 5  # shape groups: 48, 30, 24 (two grids), 20 tokens
    for got, want in zip(packed, alone, strict=True):
        assert got.dtype == torch.float32 and rel(got, want) <= RTOL
    assert set(packed_grads) == set(alone_grads)
    worst = max(rel(packed_grads[n], alone_grads[n]) for n in alone_grads)
    assert worst <= RTOL, worst
    assert all(g.any() for g in alone_grads.values())  # every parameter takes part


def check_one_shape_pack_equals_dense(checkpointing: bool) -> None:
    """A pack of one shape gives the dense batch's output and gradients."""
    batch = collate(items([(3, 8, 12)] * 3))
    assert batch.is_dense
    t = torch.tensor([11.0, 500.0, 977.0])
    results = []
    for packed in (False, True):
        net = micro_wan(checkpointing=checkpointing)
        x = list(batch.latents) if packed else batch.dense()
        out = net(x, t, batch.context)
        out = out[0] if packed else out
        out.square().mean().backward()
        results.append((out, grads(net)))
    (dense, dense_grads), (packed, packed_grads) = results
    assert rel(packed, dense) <= RTOL
    assert max(rel(packed_grads[n], dense_grads[n]) for n in dense_grads) <= RTOL
