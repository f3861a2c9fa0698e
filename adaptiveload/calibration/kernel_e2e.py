"""The fused kernel end to end: whole Wan training steps, eager vs fused LayerNorm-Modulate.

One B = 1 training step per sequence length (forward + backward with per-block activation
checkpointing; bf16 autocast on CUDA, fp32 on CPU for a dry run at tiny scale), the model's
LayerNorm-Modulate sites eager, then fused: step time (median of `steps` synchronised steps
after `warmup`) and peak memory (CUDA's max allocated over them). The step is the
calibration's own (`timing.train_step` / `timing.timed` on `timing.random_batch` of the
calibration's bucket grid), so a kernel's end-to-end gain and the cost model are measured
the same way. The op-level benchmark is `adaptiveload.ops.kernel_bench`.

`adaptiveload kernel e2e`; runnable without the CLI's dependencies too (the kernel check
script uses this):
    python -m adaptiveload.calibration.kernel_e2e -o results/kernels/e2e.csv
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaptiveload.calibration.grid import latent_grid
from adaptiveload.calibration.timing import random_batch, timed, train_step
from adaptiveload.errors import UserError, int_list
from adaptiveload.io import write_text
from adaptiveload.model.architectures import get_config
from adaptiveload.model.wan import WanModel
from adaptiveload.ops import ln_modulate as lm
from adaptiveload.ops.kernel_bench import check_positive, to_csv

COLUMNS = (
    "source", "device", "date", "torch", "cuda", "model", "precision",
    "activation_checkpointing", "B", "S", "grid", "kernel", "fused_impl", "steps", "step_s",
    "step_s_min", "peak_mem_gib", "speedup_vs_eager", "mem_saved_gib", "note",
)
DEFAULT_OUT = Path("results/kernels/e2e.csv")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class E2EConfig:
    """What one end-to-end benchmark times: `model` at every S of `seq_lens` (latent tokens of
    Wan 2.1 buckets, 480p to 720p clips, by default) on `device`."""

    model: str = "wan2.1-t2v-1.3b"
    seq_lens: tuple[int, ...] = (16380, 32760, 75600)
    device: str = "cuda"
    steps: int = 3
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        get_config(self.model)  # UserError naming the known configs
        check_positive(seq_lens=self.seq_lens, steps=(self.steps,))
        if self.device not in DEVICES:
            raise UserError(f"kernel e2e: device {self.device!r}: expected cuda, or cpu for a "
                            "dry run")
        if self.warmup < 0:
            raise UserError(f"kernel e2e: warmup {self.warmup}: expected >= 0")


def run(cfg: E2EConfig) -> Iterator[list[dict[str, Any]]]:
    """The rows of one S at a time (eager, then fused, with the fused row's speed-up and saved
    memory), so a caller can save partial results."""
    dev = torch.device(cfg.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(cfg.seed)
    arch = get_config(cfg.model)
    with dev:  # initialise on the device (a 1.3B model's CPU init would take seconds)
        model = WanModel(arch, activation_checkpointing=True)
    fused_impl = (
        "cuda kernel"
        if cuda and lm.fused_available()
        else f"reference math ({lm.fused_unavailable_reason() or 'CPU tensors'})"
    )
    stamp = {
        "source": "measured", "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "model": cfg.model,
        "precision": "bf16 autocast" if cuda else "fp32", "activation_checkpointing": True,
        "B": 1, "steps": cfg.steps,
    }
    for s in cfg.seq_lens:
        inputs = random_batch(arch, 1, s, dev, cfg.seed)
        base = dict(stamp, S=s, grid="x".join(map(str, latent_grid(s))))
        rows = [_kernel_row(model, inputs, dev, cfg, kernel, base, fused_impl)
                for kernel in ("eager", "fused")]
        by_kernel = {r["kernel"]: r for r in rows if r.get("step_s")}
        if {"eager", "fused"} <= by_kernel.keys():
            eager, fused = by_kernel["eager"], by_kernel["fused"]
            fused["speedup_vs_eager"] = eager["step_s"] / fused["step_s"]
            if cuda:
                fused["mem_saved_gib"] = eager["peak_mem_gib"] - fused["peak_mem_gib"]
        del inputs
        if cuda:
            torch.cuda.empty_cache()
        print(f"e2e S={s} done", file=sys.stderr)
        yield rows


def _kernel_row(
    model: WanModel, inputs: Any, dev: torch.device, cfg: E2EConfig, kernel: str,
    base: dict[str, Any], fused_impl: str,
) -> dict[str, Any]:
    """One kernel's row at one S: its step times and peak memory, or the error that stopped it
    (an out-of-memory eager step must not lose the fused one)."""
    cuda = dev.type == "cuda"
    model.set_ln_modulate_impl(kernel)
    impl = fused_impl if kernel == "fused" else "Wan eager ops"
    try:
        for _ in range(cfg.warmup):
            train_step(model, inputs, dev)
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        times = [timed(model, inputs, dev, 1)[0] for _ in range(cfg.steps)]
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
        return dict(base, kernel=kernel, fused_impl=impl, step_s=statistics.median(times),
                    step_s_min=min(times), peak_mem_gib=peak)
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
        note = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        return dict(base, kernel=kernel, fused_impl=impl, note=note)


def to_file(out: Path, cfg: E2EConfig) -> int:
    """Run and write the CSV after every S (a timeout keeps what was measured); the exit
    status for a CLI (1: CUDA asked for and none visible)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device visible (use --device cpu for a dry run)",
              file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = []
    for s_rows in run(cfg):
        rows += s_rows
        write_text(out, to_csv(rows, COLUMNS))
    write_text(out, to_csv(rows, COLUMNS))
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m adaptiveload.calibration.kernel_e2e`: `adaptiveload kernel e2e` without the
    CLI's dependencies (the same options; the defaults are E2EConfig's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--model", help="model config name")
    parser.add_argument("--seq-lens", help="comma-separated S values")
    parser.add_argument("--device", help="cuda, or cpu for a dry run")
    parser.add_argument("--steps", type=int, help="timed steps per point (median)")
    given = vars(parser.parse_args(argv))  # only the options on the command line, and -o
    try:
        cfg = E2EConfig(**e2e_fields(given))
    except UserError as exc:
        parser.error(str(exc))
    return to_file(given["out"], cfg)


def e2e_fields(flags: dict[str, Any]) -> dict[str, Any]:
    """E2EConfig's fields from command-line text (a comma list of S), those given only."""
    parse = {"model": str, "seq_lens": lambda v: int_list(v, "--seq-lens"), "device": str,
             "steps": int}
    return {k: parse[k](v) for k, v in flags.items() if k in parse and v is not None}


if __name__ == "__main__":
    sys.exit(main())
