"""Benchmark of the fused LayerNorm-Modulate op against Wan's eager sequence, torch.compile of
that sequence, and the device's copy bandwidth measured in the same run (CSV, source
`measured`).

Setting (Wan 2.1 block): B=1, x bf16 [1, S, D], scale/shift fp32 [1, 1, D] chunk views of a
[1, 6, D] modulation tensor (row stride 6*D, as Wan passes them). Phases: `fwd` (no grad),
`bwd` (autograd.grad of a retained graph), `fwd_bwd`. Times are CUDA-event medians.
GB/s is *effective*: the fused algorithm's minimal HBM bytes (fwd 4N, bwd 6N, fwd_bwd 10N
for N = S*D bf16 elements, + 8 bytes/row of stats) over the time, the same numerator for
every implementation, so it is a speed and comparable with the copy ceiling (a
device-to-device copy of x, 4N bytes moved). `saved` rows give the bytes autograd keeps for
backward (unique storages, via saved_tensors_hooks).

The `torch.compile` baseline is compiled afresh with static shapes for every (D, S): a
dynamic-S compile returned [D]-shaped gradients for [1, 1, D] leaves on the first H200 run
(torch 2.11), and one compiled function across all shapes would hit Dynamo's recompile limit
and silently run eager.

`--e2e` instead times whole training steps (`run_e2e`): Wan 2.1 with per-block activation
checkpointing, bf16 autocast on CUDA (fp32 on CPU, for a dry run at tiny scale), eager vs
fused LayerNorm-Modulate, step time and peak memory per sequence length.

Runnable without the CLI's dependencies (the GPU check script uses this):
    python -m adaptiveload.ops.kernel_bench -o results/kernels/bench.csv
    python -m adaptiveload.ops.kernel_bench --e2e -o results/kernels/e2e.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from adaptiveload.io import write_text
from adaptiveload.ops import ln_modulate as lm

SEQ_LENS = (8192, 16384, 32768, 65536, 75600)
# Open-Sora 1152, Wan 2.1 1.3B 1536, 2048, HunyuanVideo-class 3072, 4096, Wan 2.1 14B 5120
DIMS = (1152, 1536, 2048, 3072, 4096, 5120)
IMPLS = ("fused", "eager", "compile")
PHASES = ("fwd", "bwd", "fwd_bwd")
COLUMNS = (
    "source", "device", "date", "torch", "cuda", "B", "S", "D", "x_dtype", "mod_dtype",
    "phase", "impl", "median_us", "min_us", "repeats", "model_bytes", "gbps", "tbps",
    "frac_of_copy", "speedup_vs_eager", "speedup_vs_compile", "saved_bytes",
    "saved_vs_eager", "note",
)  # fmt: skip


def _elapsed_us(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def _inputs(s: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, s, d, device="cuda", generator=gen).to(torch.bfloat16)
    e = 0.1 * torch.randn(1, 6, d, device="cuda", generator=gen)
    # leaves that are strided views of the [B, 6, D] modulation tensor, like Wan's chunks
    scale = e[:, 1:2].detach().requires_grad_()
    shift = e[:, 0:1].detach().requires_grad_()
    return x.requires_grad_(), scale, shift


def _saved_bytes(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())


def compiled_baseline() -> Callable[..., torch.Tensor]:
    """torch.compile of Wan's eager sequence, static shapes (see the module docstring); call
    once per shape after `torch._dynamo.reset()`."""
    import torch._functorch.config as functorch_config

    # donated buffers forbid the retain_graph=True that timing backward alone needs
    functorch_config.donated_buffer = False
    return torch.compile(lm.wan_eager, fullgraph=True, dynamic=False)


def unavailable_reason() -> str:
    """'' when the benchmark can run here."""
    if not torch.cuda.is_available():
        return "kernel bench needs CUDA: no CUDA device visible"
    if not lm.fused_available():
        return f"kernel bench needs the fused kernel: {lm.fused_unavailable_reason()}"
    return ""


def run(
    seq_lens: tuple[int, ...] = SEQ_LENS,
    dims: tuple[int, ...] = DIMS,
    repeats: int = 20,
    warmup: int = 5,
    seed: int = 0,
    impls: tuple[str, ...] = IMPLS,
) -> Iterator[list[dict[str, Any]]]:
    """Measure every (D, S, impl, phase); yields the CSV rows (dicts keyed by COLUMNS) of one
    shape at a time, so a caller can save partial results."""
    if reason := unavailable_reason():
        raise RuntimeError(reason)
    stamp = {
        "source": "measured",
        "device": torch.cuda.get_device_name(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "B": 1,
        "x_dtype": "bfloat16",
        "mod_dtype": "float32",
        "repeats": repeats,
    }
    makers: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {
        "fused": lambda: lm.ln_modulate,
        "eager": lambda: lm.wan_eager,
        "compile": compiled_baseline,
    }
    for d in dims:
        for s in seq_lens:
            torch._dynamo.reset()  # a fresh static compile per shape
            fns = {name: makers[name]() for name in impls}
            rows: list[dict[str, Any]] = []
            x, scale, shift = _inputs(s, d, seed)
            n = s * d
            model_bytes = {"fwd": 4 * n + 8 * s, "bwd": 6 * n + 8 * s, "fwd_bwd": 10 * n + 16 * s}
            base = dict(stamp, S=s, D=d)
            dst = torch.empty_like(x, requires_grad=False)
            src = x.detach()
            copy_t = _elapsed_us(lambda dst=dst, src=src: dst.copy_(src), warmup, repeats)
            copy_gbps = 4 * n / (statistics.median(copy_t) * 1e3)
            rows.append(dict(base, phase="copy", impl="copy", median_us=statistics.median(copy_t),
                             min_us=min(copy_t), model_bytes=4 * n, gbps=copy_gbps,
                             note="device-to-device copy of x: the bandwidth ceiling"))  # fmt: skip
            medians: dict[tuple[str, str], float] = {}
            for name, fn in fns.items():
                try:
                    rows.append(dict(base, phase="saved", impl=name,
                                     saved_bytes=_saved_bytes(fn, x, scale, shift),
                                     note="autograd's saved bytes (unique storages)"))  # fmt: skip
                except Exception as exc:
                    rows.append(dict(base, phase="saved", impl=name, note=f"error: {exc}"))
                try:
                    for phase, t in _time_phases(fn, x, scale, shift, warmup, repeats).items():
                        med = statistics.median(t)
                        medians[(name, phase)] = med
                        gbps = model_bytes[phase] / (med * 1e3)
                        rows.append(dict(base, phase=phase, impl=name, median_us=med,
                                         min_us=min(t), model_bytes=model_bytes[phase],
                                         gbps=gbps, tbps=gbps / 1e3,
                                         frac_of_copy=gbps / copy_gbps))  # fmt: skip
                except Exception as exc:  # one failing baseline must not lose the others
                    rows.append(dict(base, phase="error", impl=name,
                                     note=f"{type(exc).__name__}: {exc}"))  # fmt: skip
            saved = {r["impl"]: r.get("saved_bytes") for r in rows if r["phase"] == "saved"}
            for row in rows:
                if row["phase"] == "saved" and row.get("saved_bytes") and saved.get("eager"):
                    row["saved_vs_eager"] = row["saved_bytes"] / saved["eager"]
                key = (row["impl"], row["phase"])
                if key in medians:
                    for ref in ("eager", "compile"):
                        if (ref, row["phase"]) in medians:
                            row[f"speedup_vs_{ref}"] = medians[(ref, row["phase"])] / medians[key]
            del x, scale, shift, dst, src
            torch.cuda.empty_cache()
            print(f"D={d} S={s} done", file=sys.stderr)
            yield rows


def _time_phases(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    warmup: int,
    repeats: int,
) -> dict[str, list[float]]:
    leaves = (x, scale, shift)
    with torch.no_grad():
        fwd = _elapsed_us(lambda: fn(x, scale, shift), warmup, repeats)
    dy = torch.randn(x.shape, device=x.device).to(fn(x, scale, shift).dtype)
    bwd = _backward_us(fn(x, scale, shift), leaves, dy, warmup, repeats)
    fwd_bwd = _elapsed_us(
        lambda: torch.autograd.grad(fn(x, scale, shift), leaves, dy), warmup, repeats
    )
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd_bwd}


def _backward_us(
    y: torch.Tensor, leaves: tuple[torch.Tensor, ...], dy: torch.Tensor, warmup: int, repeats: int
) -> list[float]:
    """Backward alone: autograd.grad over one retained graph (no .grad accumulation)."""
    return _elapsed_us(
        lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), warmup, repeats
    )


def to_csv(rows: list[dict[str, Any]], columns: tuple[str, ...] = COLUMNS) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="raise")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(row.get(k)) for k in columns})
    return buf.getvalue()


def _fmt(v: Any) -> Any:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else v)


def skip_rows(reason: str) -> list[dict[str, Any]]:
    """The record written instead of measurements where there is no CUDA (pipeline --skip-ok)."""
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return [{"source": "skipped", "date": stamp, "torch": torch.__version__, "note": reason}]


# --- end to end: whole training steps, eager vs fused ---------------------------------------

E2E_MODEL = "wan2.1-t2v-1.3b"
E2E_SEQ_LENS = (16380, 32760, 75600)  # latent tokens of Wan 2.1 buckets (480p to 720p clips)
E2E_COLUMNS = (
    "source", "device", "date", "torch", "cuda", "model", "precision",
    "activation_checkpointing", "B", "S", "grid", "kernel", "fused_impl", "steps", "step_s",
    "step_s_min", "peak_mem_gib", "speedup_vs_eager", "mem_saved_gib", "note",
)  # fmt: skip


def run_e2e(
    model_name: str = E2E_MODEL,
    seq_lens: tuple[int, ...] = E2E_SEQ_LENS,
    device: str = "cuda",
    steps: int = 3,
    warmup: int = 1,
    seed: int = 0,
) -> Iterator[list[dict[str, Any]]]:
    """One B = 1 training step (forward + backward, per-block activation checkpointing; bf16
    autocast on CUDA, fp32 on CPU) of `model_name` per S, with the model's LayerNorm-Modulate
    sites eager then fused; yields the rows of one S at a time. Step time is the median of
    `steps` synchronised steps after `warmup`; peak memory is CUDA's max allocated over them."""
    from adaptiveload import calibration  # the calibration's own step: same work, one home
    from adaptiveload.model.configs import get_config
    from adaptiveload.model.wan import WanModel

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch.manual_seed(seed)
    cfg = get_config(model_name)
    with dev:  # initialise on the device (a 1.3B model's CPU init would take seconds)
        model = WanModel(cfg, activation_checkpointing=True)
    fused_impl = (
        "cuda kernel"
        if cuda and lm.fused_available()
        else f"reference math ({lm.fused_unavailable_reason() or 'CPU tensors'})"
    )
    stamp = {
        "source": "measured", "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "model": model_name,
        "precision": "bf16 autocast" if cuda else "fp32", "activation_checkpointing": True,
        "B": 1, "steps": steps,
    }  # fmt: skip
    for s in seq_lens:
        inputs = calibration.random_batch(cfg, 1, s, dev, seed)
        base = dict(stamp, S=s, grid="x".join(map(str, calibration.latent_grid(s))))
        rows: list[dict[str, Any]] = []
        for kernel in ("eager", "fused"):
            model.set_ln_modulate_impl(kernel)
            impl = fused_impl if kernel == "fused" else "Wan eager ops"
            try:
                for _ in range(warmup):
                    calibration.train_step(model, inputs, dev)
                if cuda:
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                times = [calibration.timed(model, inputs, dev, 1)[0] for _ in range(steps)]
                peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
                rows.append(dict(base, kernel=kernel, fused_impl=impl,
                                 step_s=statistics.median(times), step_s_min=min(times),
                                 peak_mem_gib=peak))  # fmt: skip
            except (RuntimeError, torch.OutOfMemoryError) as exc:  # keep the other kernel
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.empty_cache()
                note = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                rows.append(dict(base, kernel=kernel, fused_impl=impl, note=note))
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


def e2e_to_file(
    out: Path, model_name: str, seq_lens: tuple[int, ...], device: str, steps: int
) -> int:
    """Run `run_e2e` and write its CSV after every S (a timeout keeps what was measured)."""
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device visible (use --device cpu for a dry run)",
              file=sys.stderr)  # fmt: skip
        return 1
    rows: list[dict[str, Any]] = []
    for s_rows in run_e2e(model_name, seq_lens, device, steps):
        rows += s_rows
        write_text(out, to_csv(rows, E2E_COLUMNS))
    write_text(out, to_csv(rows, E2E_COLUMNS))
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=Path("results/kernels/bench.csv"))
    parser.add_argument("--seq-lens", type=_ints, default=SEQ_LENS, help="comma-separated")
    parser.add_argument("--dims", type=_ints, default=DIMS, help="comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--impls", type=lambda v: tuple(v.split(",")), default=IMPLS)
    parser.add_argument("--skip-ok", action="store_true", help="no CUDA: write a skip record")
    parser.add_argument("--e2e", action="store_true", help="whole training steps instead")
    parser.add_argument("--model", default=E2E_MODEL, help="--e2e: model config name")
    parser.add_argument("--device", default="cuda", help="--e2e: cuda, or cpu for a dry run")
    parser.add_argument("--steps", type=int, default=3, help="--e2e: timed steps per point")
    args = parser.parse_args(argv)
    if args.e2e:
        seq_lens = E2E_SEQ_LENS if args.seq_lens == SEQ_LENS else args.seq_lens
        return e2e_to_file(args.out, args.model, seq_lens, args.device, args.steps)
    return bench_to_file(args.out, args.seq_lens, args.dims, args.repeats, args.skip_ok, args.impls)


def bench_to_file(
    out: Path,
    seq_lens: tuple[int, ...],
    dims: tuple[int, ...],
    repeats: int,
    skip_ok: bool,
    impls: tuple[str, ...] = IMPLS,
) -> int:
    """Run and write the CSV; the exit status for a CLI (1: needs CUDA and --skip-ok not given)."""
    if reason := unavailable_reason():
        if not skip_ok:
            print(f"error: {reason}", file=sys.stderr)
            return 1
        rows = skip_rows(reason)
    else:
        rows = []
        for shape_rows in run(seq_lens, dims, repeats, impls=impls):
            rows += shape_rows
            write_text(out, to_csv(rows))  # partial results survive a timeout
    write_text(out, to_csv(rows))
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
