"""Rectified-flow (flow-matching) objective, as Wan 2.1 is trained.

For clean latents x0 and Gaussian noise eps at noise level sigma in (0, 1):

    x_t    = (1 - sigma) * x0 + sigma * eps
    target = eps - x0                         (the velocity dx_t/dsigma)
    loss   = mean over elements of (model(x_t, t, context) - target)^2,  t = 1000 * sigma

sigma is drawn per sample, then shifted toward high noise as Wan's FlowMatch scheduler does
(shift = 5 for 480p/720p video; a larger shift spends more steps on coarse structure):

    sigma' = shift * sigma / (1 + (shift - 1) * sigma)

with sigma ~ U(0, 1) (`uniform`, Wan/DiffSynth) or sigma = sigmoid(N(mu, s)) (`logit-normal`,
SD3's choice). Noise and sigmas come from a generator seeded by (seed, step, rank), so a
step's randomness does not depend on what ran before it: resumed, emulated and distributed
runs draw identical noise for the same micro-batch.
"""

from __future__ import annotations

import numpy as np
import torch

from adaptiveload.training.settings import ObjectiveConfig


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's timestep shift: sigma' = shift * sigma / (1 + (shift - 1) * sigma)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A CPU generator for one (seed, step, rank): order-independent randomness."""
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
    x0: torch.Tensor,
    context: torch.Tensor,
    cfg: ObjectiveConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """Flow-matching MSE of each sample of the micro-batch: shape [B], float32 (or x0's dtype
    if wider). Runs under whatever autocast the caller set up."""
    b = x0.shape[0]
    sigma = sample_sigmas(b, cfg, generator)
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
    noise = noise.to(device=x0.device, dtype=x0.dtype)
    s = sigma.to(device=x0.device, dtype=x0.dtype).view(b, *([1] * (x0.ndim - 1)))
    x_t = (1 - s) * x0 + s * noise
    dtype = torch.promote_types(torch.float32, x0.dtype)  # fp32 timesteps, as Wan asserts
    t = (sigma * cfg.num_train_timesteps).to(device=x0.device, dtype=dtype)
    pred = model(x_t, t, context)
    target = noise - x0
    err = (pred.to(dtype) - target.to(dtype)).pow(2)
    return err.flatten(1).mean(dim=1)
