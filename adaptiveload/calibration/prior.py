"""Analytic priors: a `source: model` calibration from the analytic step time and memory of
a model on a device's rates, fitted like a measurement (the shipped H200 priors)."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import numpy as np
import torch

from adaptiveload.calibration.files import calibration_record, setup_dict
from adaptiveload.calibration.fit import fit
from adaptiveload.calibration.mix import TokenMix
from adaptiveload.calibration.settings import BudgetRules
from adaptiveload.costmodel import Calibration, derive_budgets
from adaptiveload.errors import UserError
from adaptiveload.model import analytic
from adaptiveload.model.architectures import get_config
from adaptiveload.model.wan import build_on_meta, count_parameters

# How the priors assume the model is trained (see TrainingSetup): bf16 autocast, per-block
# activation checkpointing, AdamW. The 14B's 229 GB of fp32 weights+grads+Adam cannot live on
# one 141 GB device, so its prior shards them over 16 ranks (FSDP/ZeRO-3; the default
# simulation world size); the 1.3B is plain data parallel.
PRIOR_SETUPS = {
    "wan2.1-t2v-14b": analytic.TrainingSetup(shard_world_size=16),
}
PRIOR_BATCH_SIZES = (1, 2, 4, 8)


def prior(
    model_name: str,
    rates: str,
    mix: TokenMix | None = None,
    rules: BudgetRules | None = None,
    num_tokens: int = 10,
) -> Calibration:
    """A `source: model` calibration: the analytic step time and memory of `model_name` on a
    device's rates, evaluated on a grid spanning the manifest's tokens and fitted like a
    measurement (so its fit statistics say how well the form captures the analytic model).
    The budgets follow `rules`: at its capacity if it names one, else the device's."""
    rules = rules or BudgetRules()
    cfg = get_config(model_name)
    if rates not in analytic.PRIORS:
        raise UserError(f"prior '{rates}': unknown; expected one of {', '.join(analytic.PRIORS)}")
    device = analytic.PRIORS[rates]
    setup = PRIOR_SETUPS.get(cfg.name, analytic.TrainingSetup())
    if mix is None:
        raise UserError("a prior needs a manifest or mixture for its token range")
    lo, hi = int(mix.tokens.min()), int(mix.tokens.max())
    tokens = sorted({int(s) for s in np.geomspace(lo, max(hi, lo + 1), num_tokens)})
    num_params = count_parameters(build_on_meta(cfg))
    m_static, m_tok, m_seq = analytic.memory_terms(cfg, num_params, setup)
    points = [
        {"batch": b, "tokens": s, "time_s": analytic.step_time(cfg, device, setup, b, s)}
        for s in tokens
        for b in PRIOR_BATCH_SIZES
    ]
    B = np.array([p["batch"] for p in points])
    S = np.array([p["tokens"] for p in points])
    cost, stats = fit(B, S, np.array([p["time_s"] for p in points]))
    cost = replace(cost, m_static=m_static, m_tok=m_tok, m_seq=m_seq)
    for p in points:
        p["peak_bytes_model"] = float(cost.memory(p["batch"], p["tokens"]))
    capacity = rules.capacity_bytes(device.capacity_bytes)
    budgets = derive_budgets(cost, mix.tokens, capacity, rules.headroom, rules.ref_tokens,
                             rules.ref_batch)
    return calibration_record(
        cfg, device.name, "model", cost, budgets, capacity, rules.headroom, num_params, mix,
        extra={
            "memory_source": "model",
            "provenance": {
                "generator": "adaptiveload.calibration.prior",
                "command": f"adaptiveload calibrate prior --rates {rates} --model {cfg.name} "
                "--mixture NAME --num-samples N (see `manifest.origin`)",
                "date": dt.datetime.now(dt.timezone.utc).date().isoformat(),
                "torch": torch.__version__,
            },
            "rates": device.to_dict(),
            "setup": setup_dict(setup, "bf16 autocast (assumed)"),
            "analytic": {
                "flop_terms_forward": analytic.flop_terms(cfg).__dict__,
                "activation_bytes_per_token_block": analytic.activation_bytes_per_token_block(
                    cfg, setup
                ),
                "assumptions": [
                    "step time = overhead + B * (GEMM FLOPs / (rate*linear_eff) + attention "
                    "FLOPs / (rate*attention_eff) + element-wise bytes / (copy*memory_eff))",
                    "FLOPs: forward x3 for forward+backward, x4 with per-block activation "
                    "checkpointing (recomputed forward)",
                    "memory: static = params * (16 B fp32 weights+grads+AdamW + 2 B bf16 weight "
                    "copy) / shard_world_size; activations counted tensor by tensor "
                    "(activation_bytes_per_token_block); with checkpointing, every block "
                    "input (fp32) + one block's activations",
                ],
            },
            "grid": {"batch_sizes": list(PRIOR_BATCH_SIZES), "tokens": tokens},
            "fit": stats.to_dict(),
            "points": points,
            "notes": [
                "source: model. Replace it with a measurement on an H200 (the 1.3B fits one "
                "GPU; the 14B's optimizer state needs sharding): `adaptiveload calibrate measure "
                f"--model {cfg.name} --device cuda --activation-checkpointing --batch-sizes 1,2,4 "
                "--tokens 1560,3600,7800,14040,32760 --mixture paper-mixed -o FILE`",
                "budget rules (`budgets.rules`): one reference batch, the heaviest bucket within "
                "M_mem at its memory-limited batch B_ref; M_tok = B_ref * S_ref (equal-token), "
                "M_comp = B_ref * S_ref^p (AdaptiveLoad)",
            ],
        },
    )
