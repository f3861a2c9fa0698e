"""Benchmark: forward + backward per sample of packed micro-batches vs the same samples as
homogeneous (dense, one bucket shape) batches, on CPU, by thread CPU time.

Run: .venv/bin/python tests/bench/bench_packing.py [--packs K] [--repeats R]
     [-o results/benchmarks/packing_cpu.json]

The samples are the default experiment's (experiments/default.yaml: the tiny-cpu mixture
bucketed on the tiny grid). Packs are filled first-fit from a seeded shuffle up to a token
budget (default 5,700 tokens, about the default run's M_mem), so each holds clips and images
of several shapes, as a packing planner's cells do. Each pack runs (a) packed: one micro-batch,
`WanModel(list_of_shape_groups, ...)`, and (b) homogeneous: one dense micro-batch per bucket
shape of the same samples; both through the trainer's real objective (`per_sample_loss`:
noise, timesteps, flow-matching MSE) and one backward. A point's time is the minimum over
`repeats` interleaved passes (packed, then its dense batches) of one thread's CPU time, torch
limited to one thread: other processes on the machine do not enter it. Per sample, packed and
homogeneous process the same samples, so the per-sample ratio is sum(packed) / sum(dense).
Target: packed within 10% of homogeneous for the default mixture, tiny and micro models.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
from stamp import stamp

from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.dataset import LatentDataset
from adaptiveload.data.mixtures import synthesize
from adaptiveload.data.packed import PackedBatch, collate
from adaptiveload.experiment import load
from adaptiveload.io import write_json
from adaptiveload.model.architectures import get_config
from adaptiveload.model.attention import choose_backend
from adaptiveload.model.wan import WanModel
from adaptiveload.training.objective import per_sample_loss, step_generator
from adaptiveload.training.settings import ObjectiveConfig

TARGET = 1.10  # packed / homogeneous seconds per sample
MODELS = ("wan2.1-tiny", "wan2.1-micro")
KERNELS = ("eager", "fused")


def make_packs(samples, budget: int, count: int, seed: int) -> list[list[int]]:
    """`count` packs of dataset positions, first-fit in a seeded shuffle up to `budget` tokens;
    only packs of at least two bucket shapes are kept (the case packing is for)."""
    tokens = samples["tokens"].to_numpy()
    shape = samples["bucket_frames"].astype(str) + "x" + samples["bucket_height"].astype(str)
    shape = (shape + "x" + samples["bucket_width"].astype(str)).to_numpy()
    order = np.random.default_rng(seed).permutation(len(samples))
    packs, current, used = [], [], 0
    for i in order:
        if current and used + tokens[i] > budget:
            if len(set(shape[current])) > 1:
                packs.append(current)
            current, used = [], 0
        current.append(int(i))
        used += int(tokens[i])
        if len(packs) == count:
            break
    return packs


def fwd_bwd_seconds(model: WanModel, batch: PackedBatch, packed: bool, step: int) -> float:
    """One thread's CPU seconds of forward + backward of `batch` (as one packed micro-batch, or
    one dense micro-batch per shape group), with the trainer's objective."""
    cfg, spent = ObjectiveConfig(), 0.0
    parts = [batch] if packed else _dense_parts(batch)
    for k, part in enumerate(parts):
        x0 = list(part.latents) if packed else part.dense()
        gen = step_generator(0, step, k)
        t0 = time.thread_time()
        per_sample_loss(model, x0, part.context, cfg, gen).sum().backward()
        spent += time.thread_time() - t0
        model.zero_grad(set_to_none=True)
    return spent


def _dense_parts(batch: PackedBatch) -> list[PackedBatch]:
    out, start = [], 0
    for group in batch.latents:
        n = group.shape[0]
        ids = batch.sample_ids[start : start + n]
        out.append(PackedBatch((group,), batch.context[start : start + n], ids))
        start += n
    return out


def bench_model(name: str, kernel: str, batches: list[PackedBatch], repeats: int) -> dict:
    torch.manual_seed(0)
    model = WanModel(get_config(name), ln_modulate_impl=kernel)
    for batch in batches[:2]:  # process warm-up (allocator, first-call costs)
        fwd_bwd_seconds(model, batch, True, 0)
        fwd_bwd_seconds(model, batch, False, 0)
    rows = []
    for p, batch in enumerate(batches):
        packed, dense = [], []
        for r in range(repeats):
            packed.append(fwd_bwd_seconds(model, batch, True, r))
            dense.append(fwd_bwd_seconds(model, batch, False, r))
        rows.append({
            "pack": p, "samples": batch.num_samples,
            "latent_grids": [list(g.shape[2:]) for g in batch.latents],  # T', H', W'
            "tokens_per_sample": [g[0, 0].numel() // 4 for g in batch.latents],  # patch 1x2x2
            "samples_per_shape": [g.shape[0] for g in batch.latents],
            "packed_s": min(packed), "homogeneous_s": min(dense),
            "ratio": min(packed) / min(dense),
        })
    total_packed = sum(r["packed_s"] for r in rows)
    total_dense = sum(r["homogeneous_s"] for r in rows)
    ratio = total_packed / total_dense
    return {
        "model": name,
        "kernel": kernel,
        "samples": sum(r["samples"] for r in rows),
        "packed_s_per_sample": total_packed / sum(r["samples"] for r in rows),
        "homogeneous_s_per_sample": total_dense / sum(r["samples"] for r in rows),
        "ratio_per_sample": ratio,
        "ratio_median_of_packs": statistics.median(r["ratio"] for r in rows),
        "ratio_worst_pack": max(r["ratio"] for r in rows),
        "meets_target": ratio <= TARGET,
        "packs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="experiments/default.yaml")
    parser.add_argument("--packs", type=int, default=8)
    parser.add_argument("--budget", type=int, default=5700, help="tokens per pack")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("-o", "--out", default="results/benchmarks/packing_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    exp = load(args.config)
    data = exp["data"]
    frame = synthesize(data["mixture"], data["num_samples"], 0)
    samples = bucketize(frame, mode=data["bucketing"], grid=data["grid"],
                        max_frames=data["max_frames"]).samples.reset_index(drop=True)
    packs = make_packs(samples, args.budget, args.packs, seed=0)
    load_before = os.getloadavg()
    results: list[dict[str, Any]] = []
    for name in MODELS:
        cfg = get_config(name)
        dataset = LatentDataset(samples, cfg.in_dim, cfg.text_len, cfg.text_dim, seed=0)
        batches = [collate([dataset[i] for i in pack]) for pack in packs]
        for kernel in KERNELS:
            results.append(bench_model(name, kernel, batches, args.repeats))
            ratio = results[-1]["ratio_per_sample"]
            print(f"{name} {kernel}: packed / homogeneous per sample {ratio:.3f}")
    note = (
        "Thread CPU time of one thread (torch.set_num_threads(1)): the work, not the waiting for "
        "a core on the shared 2-core machine. Packed attention on CPU is SDPA per run of "
        "equal-length segments (sdpa-runs); packed eager LayerNorm-Modulate gathers each "
        "token's modulation row (wan_eager_segments), fused runs the segment op's CPU "
        "reference. Homogeneous: one dense micro-batch per bucket shape of the pack, so a pack "
        "of k shapes is k forward+backward calls, each running every layer once on its own "
        "tokens; packed runs each token-wise layer once on all of them."
    )
    write_json(args.out, {
        **stamp("packed vs homogeneous micro-batches, forward+backward per sample (CPU)",
                "measured", note, torch=torch.__version__),
        "clock": "cpu thread time (time.thread_time), minimum over repeats",
        "config": args.config,
        "mixture": data["mixture"],
        "pack_budget_tokens": args.budget,
        "packs_count": len(packs),
        "repeats": args.repeats,
        "attention_backend": choose_backend("packed", torch.device("cpu")),
        "target_ratio": TARGET,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    })


if __name__ == "__main__":
    main()
