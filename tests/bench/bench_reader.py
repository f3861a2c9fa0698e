"""Benchmark: the trainer's exposed load time, plan-order prefetch vs inline reads, on a latent
cache on disk (target: exposed load with prefetch <= 20% of inline's, at equal compute, the same
samples in the same order).

Run: nice -n 10 .venv/bin/python tests/bench/bench_reader.py [--samples 2000] [--workers 2]
     [--depth 4] [-o results/benchmarks/reader.json]

A cache of `--samples` latents of mixed shapes (tiny Wan latents, 16 channels, 1-5 latent
frames, 8-24 latent pixels a side; one shared text embedding per 8 samples) is written to a
temporary folder in this project's layout and indexed by `adaptiveload manifest import`'s
importer. The same experiment (Wan micro model, 4 emulated ranks, policy adaptiveload, one
whole epoch) is trained twice in this process: `reader_workers: 0` (every micro-batch read on
the loop's thread when it is needed) and `reader_workers: N` (each rank's next micro-batches
fetched in plan order by N background processes). Measured: per micro-batch the exposed load
(`load_exposed_s`: the loop's own thread CPU time in loading plus the wall time it blocked for
a worker) and compute (`compute_s`, thread CPU time), and both on the wall clock
(`Loaded.load_wall_s`, `compute_wall_s`). The per-step table's losses must be equal in both
runs (same samples, same order, same noise), and the summed compute is reported for both
(equal compute).

Two conditions, each with both readers: `cold`, the cache's files evicted from the page cache
before the run (posix_fadvise DONTNEED: every latent is read from the disk, as a cache larger
than memory is), and `warm`, the files in the page cache (reading is then CPU work, which
competes with the CPU's compute for the same cores: on a GPU the loop's thread waits for the
device instead). The target is read on `cold`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import yaml
from stamp import stamp

from adaptiveload import experiment
from adaptiveload.data.importers import import_cache
from adaptiveload.data.latents import save_sample, save_text
from adaptiveload.data.manifest import write_manifest
from adaptiveload.io import write_json
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import Trainer
from adaptiveload.training.settings import from_experiment

TARGET = 0.20  # exposed load with prefetch / inline
WORLD = 4
NOTE = (
    "Measured on a shared 2-core CPU (load average recorded), 4 emulated ranks in one process, "
    "on the trainer's timer: the computing thread's CPU time (docs/measurement.md), plus the "
    "wall time the loop blocked for a worker still fetching (load_exposed_s of the per-step "
    "table); *_wall fields: the same spans on the wall clock, which on this loaded machine "
    "also count the loop's thread waiting for a core. Compute = forward + backward of the "
    "micro Wan model; the reader's workers are processes."
)


def write_cache(folder: Path, n: int, seed: int = 0) -> Path:
    """`n` latents of mixed shapes and their shared text embeddings; returns the manifest."""
    gen = torch.Generator().manual_seed(seed)
    frames, sides = (1, 2, 3, 5), (8, 12, 16, 24)
    for c in range((n + 7) // 8):
        save_text(folder / f"text{c:04d}.safetensors", torch.randn(6, 32, generator=gen))
    for i in range(n):
        f = frames[i % len(frames)]
        h, w = sides[(i // 4) % len(sides)], sides[(i // 16) % len(sides)]
        save_sample(
            folder / f"s{i:05d}.safetensors",
            torch.randn(16, f, h, w, generator=gen),
            text_file=f"text{i // 8:04d}.safetensors",
        )
    manifest = folder / "manifest.csv"
    frame = import_cache(folder, "adaptiveload").manifest
    write_manifest(manifest, frame)
    return manifest


def evict(folder: Path) -> None:
    """Drop the cache's files from the page cache: the next read of each goes to the disk."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def train(config: Path, workers: int, depth: int) -> dict:
    """One epoch; per micro-batch the loop's wall wait for its input, summed with compute."""
    exp = experiment.load(config)
    exp["train"].update(reader_workers=workers, prefetch_depth=depth)
    cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=WORLD)
    trainer = Trainer(cfg, prepare_data(exp, cfg), None, Ranks.emulated(WORLD), progress=False)
    waits: list[float] = []
    load = trainer._load

    def timed_load(rank):  # the wall clock the loop waited for this micro-batch's input
        loaded = load(rank)
        waits.append(loaded.load_wall_s)
        return loaded

    trainer._load = timed_load
    t0 = time.perf_counter()
    try:
        table = trainer.run().steps
    finally:
        trainer.close()
    return {
        "micro_batches": len(waits),
        "samples": int(table["samples"].sum()),
        "load_exposed_s": float(table["load_exposed_s"].sum()),
        "load_s": float(table["load_s"].sum()),
        "compute_s": float(table["compute_s"].sum()),
        "exposed_load_wall_s": sum(waits),
        "compute_wall_s": float(table["compute_wall_s"].sum()),
        "run_wall_s": time.perf_counter() - t0,
        "_losses": table[["step", "rank", "samples", "loss"]].to_dict("list"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("-o", "--out", default="results/benchmarks/reader.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_reader_") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        t0 = time.perf_counter()
        manifest = write_cache(cache, args.samples)
        write_s = time.perf_counter() - t0
        config = Path(tmp) / "reader.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "name": "reader",
                    "data": {"manifest": str(manifest), "bucketing": "exact", "max_frames": 17},
                    "model": {"config": "wan2.1-micro"},
                    "budgets": {"m_tok": 2048, "m_mem": 2048, "m_comp": 60000, "p": 1.4},
                    "train": {"world_size": WORLD, "steps": "epoch", "warmup_steps": 0},
                }
            )
        )
        load_before = os.getloadavg()
        train(config, 0, args.depth)  # the code paths and the text embeddings' cache warm
        runs = {}
        for condition in ("cold", "warm"):
            for name, workers in (("inline", 0), ("prefetch", args.workers)):
                if condition == "cold":
                    evict(cache)
                runs[condition, name] = train(config, workers, args.depth)
        load_after = os.getloadavg()
    conditions = {}
    for condition in ("cold", "warm"):
        inline, prefetch = runs[condition, "inline"], runs[condition, "prefetch"]
        same = inline.pop("_losses") == prefetch.pop("_losses")
        conditions[condition] = {
            "inline": inline,
            "prefetch": prefetch,
            "exposed_ratio": prefetch["load_exposed_s"] / inline["load_exposed_s"],
            "compute_ratio": prefetch["compute_s"] / inline["compute_s"],
            "exposed_ratio_wall": prefetch["exposed_load_wall_s"] / inline["exposed_load_wall_s"],
            "same_samples_same_order": same,
        }
    cold = conditions["cold"]
    result = {
        **stamp("reader", "measured", NOTE, torch=torch.__version__),
        "cache": {
            "latents": args.samples,
            "layout": "adaptiveload",
            "write_s": write_s,
            "shapes": "16 x {1,2,3,5} x {8..24} x {8..24} latent, text shared by 8",
        },
        "run": {
            "model": "wan2.1-micro",
            "world_size": WORLD,
            "policy": "adaptiveload",
            "steps": "one epoch",
            "reader_workers": args.workers,
            "prefetch_depth": args.depth,
        },
        "host_load_1m": {"before": load_before[0], "after": load_after[0]},
        **conditions,
        "target": f"cold exposed_ratio <= {TARGET}",
        "meets_target": bool(cold["same_samples_same_order"] and cold["exposed_ratio"] <= TARGET),
    }
    write_json(args.out, result)
    for condition, c in conditions.items():
        i, p = c["inline"], c["prefetch"]
        print(
            f"{condition}: exposed load inline {i['load_exposed_s']:.3f} s, prefetch "
            f"{p['load_exposed_s']:.3f} s (ratio {c['exposed_ratio']:.3f}; wall "
            f"{c['exposed_ratio_wall']:.3f}); compute {i['compute_s']:.2f} / "
            f"{p['compute_s']:.2f} s; same order: {c['same_samples_same_order']}"
        )
    print(f"load {load_before[0]:.1f} -> {load_after[0]:.1f}")


if __name__ == "__main__":
    main()
