"""Rectified-flow (flow-matching) objective, as Wan 2.1 is trained.

For clean latents x0 and Gaussian noise eps at noise level sigma in (0, 1):

    x_t    = (1 - sigma) * x0 + sigma * eps
    target = eps - x0                         (the velocity dx_t/dsigma)
    loss   = mean over elements of (model(x_t, t, context) - target)^2,  t = 1000 * sigma

sigma is drawn per sample, then shifted toward high noise as Wan's FlowMatch scheduler does
(shift = 5 for 480p/720p video; a larger shift spends more steps on coarse structure):

    sigma' = shift * sigma / (1 + (shift - 1) * sigma)

with sigma ~ U(0, 1) (`uniform`, Wan/DiffSynth) or sigma = sigmoid(N(mu, s)) (`logit-normal`,
SD3's choice). Noise and sigmas come from a generator seeded by (seed, step, micro-batch
number in the step), so a step's randomness does not depend on what ran before it: resumed,
emulated and distributed runs draw identical noise for the same micro-batch. The number is
the rank where every micro-batch is one rank's; on sequence-parallel groups it is the
micro-batch's place in the step (by first rank), the same on every rank of its group, so the
ranks of a group compute one loss (docs/sequence_parallel.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from adaptiveload.training.settings import ObjectiveConfig


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's timestep shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A CPU generator for one (seed, step, rank): order-independent randomness (`rank`: the
    micro-batch's number in the step, its rank where each micro-batch is one rank's)."""
    state = np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))


def sample_sigmas(n: int, cfg: ObjectiveConfig, generator: torch.Generator) -> torch.Tensor:
    """n shifted noise levels in (0, 1), float64 on CPU."""
    if cfg.timestep_sampling == "uniform":
        sigma = torch.rand(n, generator=generator, dtype=torch.float64)
    elif cfg.timestep_sampling == "logit-normal":
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        sigma = torch.sigmoid(cfg.logit_mean + cfg.logit_std * z)
    else:
        raise ValueError(f"unknown timestep_sampling {cfg.timestep_sampling!r}")
    return shift_sigma(sigma, cfg.timestep_shift)


def per_sample_loss(
    model: torch.nn.Module,
    x0: torch.Tensor | Sequence[torch.Tensor],
    context: torch.Tensor,
    cfg: ObjectiveConfig,
    generator: torch.Generator,
    sp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Flow-matching MSE of each sample of the micro-batch: shape [B], float32 (or x0's dtype
    if wider). Runs under whatever autocast the caller set up.

    `x0` is a dense batch [B, C, T', H', W'] or a packed one: a list of such tensors of
    different shapes (`data.packed.PackedBatch.latents`), the samples in list order. Either
    way the B sigmas are drawn first, then one flat stream of noise for all samples in order,
    so a packed batch of one shape draws exactly what the dense batch draws.

    `sp_group`: the sequence-parallel group the micro-batch runs over (passed to the model;
    None: not passed, so a model without the argument runs as ever)."""
    packed = not isinstance(x0, torch.Tensor)
    groups = list(x0) if packed else [x0]
    like = groups[0]
    counts = [g.shape[0] for g in groups]
    sigma = sample_sigmas(sum(counts), cfg, generator)
    noise = _noise(groups, generator)
    x_t = []
    for s, g, n in zip(sigma.to(like.device, like.dtype).split(counts), groups, noise, strict=True):
        s = s.view(-1, *([1] * (g.ndim - 1)))
        x_t.append((1 - s) * g + s * n)
    dtype = torch.promote_types(torch.float32, like.dtype)  # fp32 timesteps, as Wan asserts
    t = (sigma * cfg.num_train_timesteps).to(device=like.device, dtype=dtype)
    extra = {} if sp_group is None else {"sp_group": sp_group}
    pred = model(x_t if packed else x_t[0], t, context, **extra)
    losses = [
        (p.to(dtype) - (n - g).to(dtype)).pow(2).flatten(1).mean(dim=1)
        for p, g, n in zip(pred if packed else [pred], groups, noise, strict=True)
    ]
    return torch.cat(losses)


def _noise(groups: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """Gaussian noise like each group, cut from ONE flat draw over all samples in order (the
    same numbers a dense draw of the same samples gives)."""
    sizes = [g.numel() for g in groups]
    flat = torch.randn(sum(sizes), generator=generator, dtype=torch.float32)
    return [
        part.view(g.shape).to(device=g.device, dtype=g.dtype)
        for part, g in zip(flat.split(sizes), groups, strict=True)
    ]
