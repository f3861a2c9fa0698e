"""The CPU-side resource check of the fused kernels: every instance the dispatcher can launch
fits on the GPU architecture, proven from the compiler's own numbers, without a GPU.

Two inputs, both produced here on the CPU:
- `ptxas_report`: each `.cu` file compiled for one architecture (default sm_90) with
  `nvcc -Xptxas -v` and the device flags of the library build; per kernel instance the
  registers per thread, static shared memory and spill bytes ptxas reports.
- `dispatch_table`: `kernels/ln_modulate_dispatch_table.cpp` (kernel_sources) built with
  the host compiler and run; it prints, from the same header the kernels dispatch with, every
  launch the library can make (kernel instance, threads per CTA, dynamic shared memory,
  opt-in) for every D.

`check` then holds every launch to the sm_90 limits (registers x threads per CTA <= 64 K, shared
memory <= 48 KB or the opt-in maximum, zero spills) and every compiled instance to being
launchable. The first H200 run failed exactly this way at D = 1536 (48 KB of pipeline plus
128 B of static scratch without the opt-in), which a GPU-less machine can now see.

Results are cached in `resources/` of the kernel build folder (kernel_lib: build/kernels/ in
a checkout) keyed by a hash of the sources, the nvcc version, the flags and the architecture
(compiling takes ~1-2 minutes on 2 cores).

    python -m adaptiveload.ops.kernel_resources [--arch 90] [--out ptxas.txt]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adaptiveload.ops.kernel_build import NVCC_FLAGS, SOURCES, nvcc_path, nvcc_version
from adaptiveload.ops.kernel_lib import default_build_dir
from adaptiveload.ops.kernel_sources import SOURCE_DIR, sources_digest

TABLE_SOURCE = SOURCE_DIR / "ln_modulate_dispatch_table.cpp"
DEFAULT_SM = "90"
REG_ALLOC_UNIT = 8  # registers per thread are allocated in steps of 8 (256 per warp)


@dataclass(frozen=True)
class Instance:
    """One compiled kernel instance as ptxas reports it."""

    name: str  # demangled, without namespaces or parameters: ln_mod_bwd_kernel<float, ...>
    registers: int
    static_smem: int
    stack_frame: int
    spill_stores: int
    spill_loads: int


def skip_reason() -> str:
    """'' when this machine can run the check, else what is missing."""
    if nvcc_path() is None:
        return "nvcc not found (set CUDA_HOME)"
    if shutil.which("c++filt") is None:
        return "c++filt not found (binutils)"
    if _cxx() is None:
        return "no host C++ compiler (c++/g++) on PATH"
    return ""


def _cxx() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def _nvcc_flags(sm: str) -> list[str]:
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # what the library build adds

    return [
        *COMMON_NVCC_FLAGS,
        *NVCC_FLAGS,
        "-std=c++17",
        f"-gencode=arch=compute_{sm},code=sm_{sm}",
    ]


def _key(sm: str, extra: str) -> str:
    """The cache key of one compile: the sources (the build record's digest) and the flags."""
    return hashlib.sha256(f"{sources_digest()}|{sm}|{extra}".encode()).hexdigest()[:16]


# --- ptxas ---------------------------------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
# a kernel's name with its template arguments (which hold no parentheses), if any
_INSTANCE = re.compile(r"(\w+(?:<[^()]*>)?)\(")


def parse_ptxas(text: str) -> list[dict[str, Any]]:
    """Per entry function of `nvcc -Xptxas -v` output: mangled name, registers, smem, spills."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            out.append({"mangled": m.group(1), "stack_frame": 0, "spill_stores": 0,
                        "spill_loads": 0, "static_smem": 0})
        elif out and (m := _FRAME.search(line)):
            out[-1].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif out and (m := _USED.search(line)):
            out[-1]["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                out[-1]["static_smem"] = int(s.group(1))
    return out


def short_name(demangled: str) -> str:
    """`void ns::(anonymous namespace)::k<float, 2>(ns::P)` -> `k<float, 2>`; `... ns::k(int)`
    -> `k`."""
    m = _INSTANCE.search(demangled)
    return m.group(1) if m else demangled


def _demangle(names: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True)
    return out.stdout.splitlines()


def _compile_one(source: Path, flags: list[str], workdir: Path) -> str:
    nvcc = nvcc_path()
    assert nvcc is not None
    obj = workdir / f"{source.stem}.o"
    proc = subprocess.run(
        [str(nvcc), *flags, "-Xptxas", "-v", "-I", str(SOURCE_DIR), "-c", str(source),
         "-o", str(obj)],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source.name}:\n{proc.stderr[-4000:]}")
    return proc.stderr


def default_cache_dir() -> Path:
    """Where compiled results are kept between runs: `resources/` of the kernel build folder."""
    return default_build_dir() / "resources"


def ptxas_report(sm: str = DEFAULT_SM, cache_dir: Path | None = None) -> list[Instance]:
    """Every kernel instance of the library's .cu files as compiled for sm_<sm> (cached)."""
    cache_dir = cache_dir or default_cache_dir()
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    flags = _nvcc_flags(sm)
    cache = cache_dir / f"ptxas-sm{sm}-{_key(sm, nvcc_version(nvcc) + ' '.join(flags))}.json"
    if cache.is_file():
        return [Instance(**r) for r in json.loads(cache.read_text())]
    work = cache_dir / "obj"
    work.mkdir(parents=True, exist_ok=True)
    sources = [SOURCE_DIR / s for s in SOURCES if s.endswith(".cu")]
    with ThreadPoolExecutor(max_workers=len(sources)) as pool:
        logs = list(pool.map(lambda s: _compile_one(s, flags, work), sources))
    entries = [e for log in logs for e in parse_ptxas(log)]
    names = _demangle([e["mangled"] for e in entries])
    instances = [
        Instance(
            name=short_name(n),
            registers=e["registers"],
            static_smem=e["static_smem"],
            stack_frame=e["stack_frame"],
            spill_stores=e["spill_stores"],
            spill_loads=e["spill_loads"],
        )
        for e, n in zip(entries, names, strict=True)
    ]
    cache.write_text(json.dumps([asdict(i) for i in instances], indent=1))
    return instances


# --- the dispatch table --------------------------------------------------------------------


def dispatch_table(cache_dir: Path | None = None) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """(limits, launches) printed by the dispatch-table program (built once per source hash)."""
    cache_dir = cache_dir or default_cache_dir()
    cxx = _cxx()
    if cxx is None:
        raise RuntimeError("no host C++ compiler")
    exe = cache_dir / f"dispatch_table-{_key('host', cxx)}"
    if not exe.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(SOURCE_DIR),
             str(TABLE_SOURCE), "-o", str(exe)],
            check=True, capture_output=True, text=True,
        )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    lines = [json.loads(ln) for ln in out.splitlines()]
    return lines[0], lines[1:]


# --- the check -----------------------------------------------------------------------------


def cta_registers(registers: int, threads: int) -> int:
    """Registers a CTA occupies: per-thread count rounded up to the allocation unit, per warp."""
    per_thread = -(-registers // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    return per_thread * 32 * -(-threads // 32)


def check(
    instances: list[Instance], limits: dict[str, int], launches: list[dict[str, Any]]
) -> list[str]:
    """Every violated limit, as one readable line each ([] when all launches fit)."""
    by_name = {i.name: i for i in instances}
    problems = [
        f"{i.name}: {i.spill_stores} B spill stores, {i.spill_loads} B spill loads"
        for i in instances
        if i.spill_stores or i.spill_loads
    ]
    used: set[str] = set()
    seen: set[tuple[str, int, int, bool]] = set()
    for row in launches:
        key = (row["kernel"], row["threads"], row["dynamic_smem"], row["opt_in"])
        if key in seen:
            continue
        seen.add(key)
        where = f"{row['kernel']} (D={row['D']}, {row['threads']} threads)"
        inst = by_name.get(row["kernel"])
        if inst is None:
            problems.append(f"{where}: dispatched but not among the compiled instances")
            continue
        used.add(inst.name)
        regs = cta_registers(inst.registers, row["threads"])
        if regs > limits["kRegistersPerCta"]:
            problems.append(f"{where}: {inst.registers} registers x threads = {regs} > "
                            f"{limits['kRegistersPerCta']}")
        if inst.registers > row["max_registers"]:
            problems.append(
                f"{where}: {inst.registers} registers > its bound {row['max_registers']}"
            )
        if row["op"] != "bwd_finalize" and row["threads"] > limits["kMaxThreads"]:
            problems.append(f"{where}: more threads than __launch_bounds__ {limits['kMaxThreads']}")
        smem = inst.static_smem + row["dynamic_smem"]
        if row["opt_in"]:
            cap = limits["kMaxPipeSmem"]
            if row["dynamic_smem"] > cap or inst.static_smem + cap > limits["kSmemOptInMax"]:
                problems.append(f"{where}: {row['dynamic_smem']} B dynamic + {inst.static_smem} "
                                f"B static smem exceeds the opt-in of {cap} B")
        elif smem > limits["kSmemDefault"]:
            problems.append(f"{where}: {smem} B smem > {limits['kSmemDefault']} B without opt-in")
    problems += [
        f"{n}: compiled but never dispatched (unchecked)" for n in by_name if n not in used
    ]
    return problems


def launch_table(
    instances: list[Instance], launches: list[dict[str, Any]], dims: tuple[int, ...]
) -> list[dict[str, Any]]:
    """One row per launch at the given widths: the numbers a reviewer wants side by side."""
    by_name = {i.name: i for i in instances}
    rows = []
    for r in launches:
        if r["D"] not in dims:
            continue
        inst = by_name.get(r["kernel"])
        rows.append(dict(r, **({
            "registers": inst.registers, "static_smem": inst.static_smem,
            "spill_stores": inst.spill_stores,
            "cta_registers": cta_registers(inst.registers, r["threads"]),
        } if inst else {})))
    return rows


def report(
    sm: str = DEFAULT_SM, dims: tuple[int, ...] = (1152, 1536, 2048, 3072, 4096, 5120)
) -> tuple[str, list[str]]:
    """(text report, problems) for the CLI and the GPU check script."""
    instances = ptxas_report(sm)
    limits, launches = dispatch_table()
    problems = check(instances, limits, launches)
    lines = [f"# ptxas -v, sm_{sm}: every compiled instance of {SOURCE_DIR} (sources_digest "
             f"{sources_digest()})", "instance registers static_smem "
             "stack_frame spill_stores spill_loads"]
    lines += [f"{i.name} {i.registers} {i.static_smem} {i.stack_frame} {i.spill_stores} "
              f"{i.spill_loads}" for i in instances]
    lines += ["", f"# launches at D in {dims} (x, mod, op, layout, pipeline)",
              "D x mod op layout pipeline kernel threads registers cta_registers static_smem "
              "dynamic_smem opt_in spill_stores"]
    for r in launch_table(instances, launches, dims):
        lines.append(" ".join(str(r.get(k, "?")) for k in (
            "D", "x", "mod", "op", "layout", "pipeline", "kernel", "threads", "registers",
            "cta_registers", "static_smem", "dynamic_smem", "opt_in", "spill_stores")))
    lines += ["", f"# check over all {len(launches)} launches, D = 8..{limits['kMaxD']}: "
              + ("OK" if not problems else f"{len(problems)} problem(s)"), *problems]
    return "\n".join(lines) + "\n", problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=DEFAULT_SM, help="SM number, e.g. 90")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if reason := skip_reason():
        print(f"resource check skipped: {reason}")
        return 0
    text, problems = report(args.arch)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text, end="")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
