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

Segment layout (a packed micro-batch): x bf16 [L, D], the token stream of G samples with
uneven lengths (seeded, within +-50% of L / G), scale/shift fp32 [G, D] rows of a [G, 6, D]
modulation tensor (row stride 6*D, one row per sample as a packed Wan block has them) and
int32 offsets. `fused` is `ln_modulate_segments`, `eager` and `compile` are Wan's sequence
with the per-token gather of modulation rows (`wan_eager_segments`), `fused_dense` is the
dense kernel on the same stream with one modulation row, what segment mode costs over it.
Rows carry `layout` (`dense` or `segments`) and `G`; for segments S is L, the stream's
tokens, so a segment row and a dense row of equal S move the same bytes.

The `torch.compile` baseline is compiled afresh with static shapes for every (D, S): a
dynamic-S compile returned [D]-shaped gradients for [1, 1, D] leaves on the first H200 run
(torch 2.11), and one compiled function across all shapes would hit Dynamo's recompile limit
and silently run eager.

Whole training steps, eager vs fused, are `adaptiveload.calibration.kernel_e2e` (they need the
model and the calibration's timed step, which sit above this package).

`adaptiveload kernel bench`; runnable without the CLI's dependencies too (the kernel check
script uses this):
    python -m adaptiveload.ops.kernel_bench -o results/kernels/bench.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaptiveload.errors import UserError, int_list
from adaptiveload.io import write_text
from adaptiveload.ops import ln_modulate as lm

SEQ_LENS = (8192, 16384, 32768, 65536, 75600)
# Open-Sora 1152, Wan 2.1 1.3B 1536, 2048, HunyuanVideo-class 3072, 4096, Wan 2.1 14B 5120
DIMS = (1152, 1536, 2048, 3072, 4096, 5120)
IMPLS = ("fused", "eager", "compile")
SEGMENT_COUNTS = (1, 8, 64)
SEGMENT_DIMS = (1536, 5120)  # Wan 2.1 1.3B and 14B
SEGMENT_LENS = (16384, 75600)  # L, the tokens of a pack (75,600: one 81-frame 720p clip)
COLUMNS = (
    "source", "device", "date", "torch", "cuda", "layout", "B", "G", "S", "D", "x_dtype",
    "mod_dtype", "phase", "impl", "median_us", "min_us", "repeats", "model_bytes", "gbps",
    "tbps", "frac_of_copy", "speedup_vs_eager", "speedup_vs_compile", "saved_bytes",
    "saved_vs_eager", "note",
)
DEFAULT_OUT = Path("results/kernels/bench.csv")


@dataclass(frozen=True)
class KernelBenchConfig:
    """What one op benchmark measures: every (D, S) of `dims` x `seq_lens` in the dense layout
    (none if either is empty), then every (D, L, G) of `segment_dims` x `segment_lens` x
    `segment_counts` in the segment layout (none without segment counts), each of `impls`,
    `repeats` timed calls after `warmup` (medians reported)."""

    seq_lens: tuple[int, ...] = SEQ_LENS
    dims: tuple[int, ...] = DIMS
    repeats: int = 20
    warmup: int = 5
    seed: int = 0
    impls: tuple[str, ...] = IMPLS
    segment_counts: tuple[int, ...] = SEGMENT_COUNTS
    segment_dims: tuple[int, ...] = SEGMENT_DIMS
    segment_lens: tuple[int, ...] = SEGMENT_LENS

    def __post_init__(self) -> None:
        check_positive(repeats=(self.repeats,))
        if self.seq_lens and self.dims:
            check_positive(seq_lens=self.seq_lens, dims=self.dims)
        elif not self.segment_counts:
            raise UserError("kernel bench: no shape to measure: give dims and seq_lens (dense), "
                            "or segment counts (packed)")
        if self.segment_counts:
            check_positive(segment_counts=self.segment_counts, segment_dims=self.segment_dims,
                           segment_lens=self.segment_lens)
            if max(self.segment_counts) > min(self.segment_lens):
                raise UserError(
                    f"kernel bench: {max(self.segment_counts)} segments in a pack of "
                    f"{min(self.segment_lens)} tokens: expected at most one segment per token"
                )
        if self.warmup < 0:
            raise UserError(f"kernel bench: warmup {self.warmup}: expected >= 0")
        unknown = sorted(set(self.impls) - set(IMPLS))
        if unknown or not self.impls:
            raise UserError(
                f"kernel bench: impls {list(self.impls)}: expected some of {', '.join(IMPLS)}"
            )


def check_positive(**lists: tuple[int, ...]) -> None:
    """UserError unless every named list is non-empty and all its values are >= 1."""
    for name, values in lists.items():
        if not values or min(values) < 1:
            raise UserError(f"{name} {list(values)}: expected one or more values >= 1")


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


def segment_offsets(total: int, count: int, seed: int) -> torch.Tensor:
    """int32 offsets [count + 1] of `count` segments of uneven lengths (each within +-50% of
    total / count, at least 1) summing to `total`: a pack of mixed shapes, reproducible."""
    gen = torch.Generator().manual_seed(seed)
    weights = 0.5 + torch.rand(count, generator=gen, dtype=torch.float64)
    cuts = (weights.cumsum(0) / weights.sum() * (total - count)).floor().long()
    ends = cuts + torch.arange(1, count + 1)  # one row each, then the rest by weight
    ends[-1] = total
    return torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32)


def _segment_inputs(
    total: int, d: int, count: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(total, d, device="cuda", generator=gen).to(torch.bfloat16)
    e = 0.1 * torch.randn(count, 6, d, device="cuda", generator=gen)
    # one row per segment, strided views of the [G, 6, D] modulation (row stride 6 D)
    scale = e[:, 1].detach().requires_grad_()
    shift = e[:, 0].detach().requires_grad_()
    return x.requires_grad_(), scale, shift, segment_offsets(total, count, seed).cuda()


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


def compiled_baseline(
    fn: Callable[..., torch.Tensor] = lm.wan_eager,
) -> Callable[..., torch.Tensor]:
    """torch.compile of Wan's eager sequence (`wan_eager`, or `wan_eager_segments`), static
    shapes (see the module docstring); call once per shape after `torch._dynamo.reset()`."""
    import torch._functorch.config as functorch_config

    # donated buffers forbid the retain_graph=True that timing backward alone needs
    functorch_config.donated_buffer = False
    return torch.compile(fn, fullgraph=True, dynamic=False)


def unavailable_reason() -> str:
    """'' when the benchmark can run here."""
    if not torch.cuda.is_available():
        return "kernel bench needs CUDA: no CUDA device visible"
    if not lm.fused_available():
        return f"kernel bench needs the fused kernel: {lm.fused_unavailable_reason()}"
    return ""


def run(cfg: KernelBenchConfig) -> Iterator[list[dict[str, Any]]]:
    """Measure every dense (D, S) and segment (D, L, G) shape, each impl and phase; yields the
    CSV rows (dicts keyed by COLUMNS) of one shape at a time, so a caller can save partial
    results."""
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
        "repeats": cfg.repeats,
    }
    for d in cfg.dims if cfg.seq_lens else ():
        for s in cfg.seq_lens:
            torch._dynamo.reset()  # a fresh static compile per shape
            fns = {name: _MAKERS[name]() for name in cfg.impls}
            rows = _shape_rows(cfg, dict(stamp, layout="dense", S=s, D=d), fns,
                               _inputs(s, d, cfg.seed), ())
            torch.cuda.empty_cache()  # the shape's tensors are gone with _shape_rows' frame
            print(f"D={d} S={s} done", file=sys.stderr)
            yield rows
    for d in cfg.segment_dims if cfg.segment_counts else ():
        for total in cfg.segment_lens:
            for count in cfg.segment_counts:
                yield _segment_shape_rows(cfg, dict(stamp, layout="segments", G=count, S=total,
                                                    D=d))
                torch.cuda.empty_cache()
                print(f"D={d} L={total} G={count} done", file=sys.stderr)


_MAKERS: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {
    "fused": lambda: lm.ln_modulate,
    "eager": lambda: lm.wan_eager,
    "compile": compiled_baseline,
}
_SEGMENT_MAKERS: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {
    "fused": lambda: lm.ln_modulate_segments,
    "eager": lambda: lm.wan_eager_segments,
    "compile": lambda: compiled_baseline(lm.wan_eager_segments),
}


def _fused_dense(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """The dense kernel on the same stream, every row modulated by segment 0's row."""
    return lm.ln_modulate(x[None], scale[:1, None], shift[:1, None])[0]


def _segment_shape_rows(cfg: KernelBenchConfig, base: dict[str, Any]) -> list[dict[str, Any]]:
    """`_shape_rows` of one segment shape, with the dense kernel beside the fused one."""
    torch._dynamo.reset()
    fns = {name: _SEGMENT_MAKERS[name]() for name in cfg.impls}
    if "fused" in fns:
        fns["fused_dense"] = _fused_dense
    x, scale, shift, cu = _segment_inputs(base["S"], base["D"], base["G"], cfg.seed)
    return _shape_rows(cfg, base, fns, (x, scale, shift), (cu,))


def _shape_rows(
    cfg: KernelBenchConfig,
    base: dict[str, Any],
    fns: dict[str, Callable[..., torch.Tensor]],
    leaves: tuple[torch.Tensor, ...],
    extra: tuple[torch.Tensor, ...],
) -> list[dict[str, Any]]:
    """The rows of one shape, each `fn(*leaves, *extra)` differentiated in `leaves` (x, scale,
    shift): the copy ceiling, then each implementation's saved bytes and phases (one failing
    implementation is an `error` row; the others still run)."""
    s, d, warmup, repeats = base["S"], base["D"], cfg.warmup, cfg.repeats
    x = leaves[0]
    n = s * d
    model_bytes = {"fwd": 4 * n + 8 * s, "bwd": 6 * n + 8 * s, "fwd_bwd": 10 * n + 16 * s}
    dst, src = torch.empty_like(x, requires_grad=False), x.detach()
    copy_t = _elapsed_us(lambda: dst.copy_(src), warmup, repeats)
    copy_gbps = 4 * n / (statistics.median(copy_t) * 1e3)
    rows: list[dict[str, Any]] = [
        dict(base, phase="copy", impl="copy", median_us=statistics.median(copy_t),
             min_us=min(copy_t), model_bytes=4 * n, gbps=copy_gbps,
             note="device-to-device copy of x: the bandwidth ceiling")
    ]
    medians: dict[tuple[str, str], float] = {}
    for name, fn in fns.items():
        try:
            rows.append(dict(base, phase="saved", impl=name,
                             saved_bytes=_saved_bytes(fn, *leaves, *extra),
                             note="autograd's saved bytes (unique storages)"))
        except Exception as exc:
            rows.append(dict(base, phase="saved", impl=name, note=f"error: {exc}"))
        try:
            for phase, times in _time_phases(fn, leaves, extra, warmup, repeats).items():
                med = statistics.median(times)
                medians[(name, phase)] = med
                gbps = model_bytes[phase] / (med * 1e3)
                rows.append(dict(base, phase=phase, impl=name, median_us=med,
                                 min_us=min(times), model_bytes=model_bytes[phase],
                                 gbps=gbps, tbps=gbps / 1e3,
                                 frac_of_copy=gbps / copy_gbps))
        except Exception as exc:  # one failing baseline must not lose the others
            rows.append(dict(base, phase="error", impl=name,
                             note=f"{type(exc).__name__}: {exc}"))
    _add_ratios(rows, medians)
    return rows


def _add_ratios(rows: list[dict[str, Any]], medians: dict[tuple[str, str], float]) -> None:
    """Saved bytes vs eager, and speed-ups vs eager and torch.compile, into `rows`."""
    saved = {r["impl"]: r.get("saved_bytes") for r in rows if r["phase"] == "saved"}
    for row in rows:
        if row["phase"] == "saved" and row.get("saved_bytes") and saved.get("eager"):
            row["saved_vs_eager"] = row["saved_bytes"] / saved["eager"]
        key = (row["impl"], row["phase"])
        if key in medians:
            for ref in ("eager", "compile"):
                if (ref, row["phase"]) in medians:
                    row[f"speedup_vs_{ref}"] = medians[(ref, row["phase"])] / medians[key]


def _time_phases(
    fn: Callable[..., torch.Tensor],
    leaves: tuple[torch.Tensor, ...],
    extra: tuple[torch.Tensor, ...],
    warmup: int,
    repeats: int,
) -> dict[str, list[float]]:
    def call() -> torch.Tensor:
        return fn(*leaves, *extra)

    with torch.no_grad():
        fwd = _elapsed_us(call, warmup, repeats)
    dy = torch.randn(leaves[0].shape, device=leaves[0].device).to(call().dtype)
    bwd = _backward_us(call(), leaves, dy, warmup, repeats)
    fwd_bwd = _elapsed_us(lambda: torch.autograd.grad(call(), leaves, dy), warmup, repeats)
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


def bench_to_file(out: Path, cfg: KernelBenchConfig, skip_ok: bool = False) -> int:
    """Run and write the CSV; the exit status for a CLI (1: needs CUDA and `skip_ok` not given,
    in which case a `skipped` row with the reason is written instead)."""
    if reason := unavailable_reason():
        if not skip_ok:
            print(f"error: {reason}", file=sys.stderr)
            return 1
        rows = skip_rows(reason)
    else:
        rows = []
        for shape_rows in run(cfg):
            rows += shape_rows
            write_text(out, to_csv(rows))  # partial results survive a timeout
    write_text(out, to_csv(rows))
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m adaptiveload.ops.kernel_bench`: `adaptiveload kernel bench` without the CLI's
    dependencies (the same options and defaults, the defaults being KernelBenchConfig's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seq-lens", help="comma-separated S values")
    parser.add_argument("--dims", help="comma-separated D values ('' for no dense shape)")
    parser.add_argument("--repeats", type=int, help="timed repeats per measurement (median)")
    parser.add_argument("--impls", help="comma-separated: fused, eager, compile")
    parser.add_argument("--segment-counts",
                        help="comma-separated G values of the packed shapes ('' for none)")
    parser.add_argument("--segment-dims", help="comma-separated D values of the packed shapes")
    parser.add_argument("--segment-lens", help="comma-separated tokens L per pack")
    parser.add_argument("--skip-ok", action="store_true", default=False,
                        help="no CUDA: write a skip record")
    given = vars(parser.parse_args(argv))  # only the options on the command line, and -o
    try:
        cfg = KernelBenchConfig(**bench_fields(given))
    except UserError as exc:
        parser.error(str(exc))
    return bench_to_file(given["out"], cfg, given["skip_ok"])


def bench_fields(flags: dict[str, Any]) -> dict[str, Any]:
    """KernelBenchConfig's fields from command-line text (comma lists), those given only."""
    parse = {"seq_lens": lambda v: int_list(v, "--seq-lens"),
             "dims": lambda v: int_list(v, "--dims"), "repeats": int,
             "impls": lambda v: tuple(v.split(",")),
             "segment_counts": lambda v: int_list(v, "--segment-counts"),
             "segment_dims": lambda v: int_list(v, "--segment-dims"),
             "segment_lens": lambda v: int_list(v, "--segment-lens")}
    return {k: parse[k](v) for k, v in flags.items() if k in parse and v is not None}


if __name__ == "__main__":
    sys.exit(main())
