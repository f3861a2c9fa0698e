"""The CPU-side resource check of the fused kernels (no GPU needed): every kernel instance the
dispatcher can launch, compiled for sm_90 with `ptxas -v`, fits the SM (registers x threads
per CTA, shared memory with or without the opt-in) and spills nothing; every dispatched
instance is compiled and every compiled one is dispatched; the Python validator's limits are
the header's. Compiling takes ~1-2 minutes on 2 cores, cached in build/kernels/resources/."""

from __future__ import annotations

import pytest

from adaptiveload.ops import kernel_resources as kr
from adaptiveload.ops import ln_modulate as lm

WAN_WIDTHS = (1152, 1536, 2048, 3072, 4096, 5120)


@pytest.fixture(scope="module")
def compiled() -> tuple[list[kr.Instance], dict, list[dict]]:
    if reason := kr.skip_reason():
        pytest.skip(f"resource check needs the CUDA toolkit: {reason}")
    limits, launches = kr.dispatch_table()
    return kr.ptxas_report("90"), limits, launches


def test_every_dispatched_instance_fits_sm90(compiled) -> None:
    instances, limits, launches = compiled
    assert kr.check(instances, limits, launches) == []
    bwd = [i for i in instances if i.name.startswith("ln_mod_bwd_kernel")]
    assert len(bwd) == 30  # 5 (x, modulation) dtype pairs x 3 layouts x pipelined or not
    fwd = [i for i in instances if i.name.startswith("ln_mod_fwd_kernel")]
    assert len(fwd) == 30  # 5 dtype pairs x 3 chunk counts x dense or segments
    assert all(i.spill_stores == 0 and i.spill_loads == 0 for i in instances)


@pytest.mark.parametrize("d", WAN_WIDTHS)
def test_wan_widths_launch_checked_instances(compiled, d: int) -> None:
    """Each width: both forward layouts and the three backward layouts, for every dtype pair,
    pick a compiled instance whose registers x threads fit 64 K (the D = 1536 backward never
    launched), the segment kernels included."""
    instances, limits, launches = compiled
    by_name = {i.name: i for i in instances}
    pairs = {(r["x"], r["mod"]) for r in launches if r["D"] == d}
    assert pairs == {("float32", "float32"), ("float16", "float32"), ("float16", "float16"),
                     ("bfloat16", "float32"), ("bfloat16", "bfloat16")}
    for r in (r for r in launches if r["D"] == d):
        inst = by_name[r["kernel"]]
        assert kr.cta_registers(inst.registers, r["threads"]) <= limits["kRegistersPerCta"]
        assert inst.static_smem + r["dynamic_smem"] <= (
            limits["kSmemOptInMax"] if r["opt_in"] else limits["kSmemDefault"]
        )
    ops = {(r["op"], r["layout"], r["pipeline"]) for r in launches if r["D"] == d}
    assert {("fwd", "dense", 1), ("fwd", "segment", 1), ("bwd", "sample", 1),
            ("bwd", "token", 1), ("bwd", "segment", 1), ("bwd_finalize", "segment", 1),
            ("check", "segment", 1)} <= ops


def test_python_limits_are_the_headers(compiled) -> None:
    _, limits, launches = compiled
    assert (limits["kMaxD"], limits["kPack"]) == (lm.MAX_D, lm.PACK)
    assert limits["kMaxGridY"] == lm.MAX_SEGMENTS
    assert {r["D"] for r in launches} == set(range(lm.PACK, lm.MAX_D + 1, lm.PACK))
    assert {r["x"] for r in launches} == {str(d).removeprefix("torch.") for d in lm.KERNEL_DTYPES}


# --- the check itself, on synthetic numbers (no toolkit needed) ---------------------------


LIMITS = {"kMaxD": 8192, "kPack": 8, "kMaxThreads": 512, "kRegistersPerCta": 65536,
          "kSmemDefault": 49152, "kSmemOptInMax": 232448, "kMaxPipeSmem": 102400,
          "kMaxGridY": 65535}


def _inst(name: str, regs: int = 96, smem: int = 128, spill: int = 0) -> kr.Instance:
    return kr.Instance(name, regs, smem, 0, spill, spill)


def _launch(kernel: str, threads: int = 192, dyn: int = 0, opt_in: bool = False) -> dict:
    return {"D": 1536, "op": "bwd", "kernel": kernel, "threads": threads, "dynamic_smem": dyn,
            "opt_in": opt_in, "max_registers": 128}


def test_check_flags_the_first_h200_failure() -> None:
    """48 KB of pipeline + 128 B of static smem without the opt-in: what D = 1536 launched."""
    k = "ln_mod_bwd_kernel_lean<__nv_bfloat16, float, 2, false, 4>"
    problems = kr.check([_inst(k)], LIMITS, [_launch(k, dyn=49152, opt_in=False)])
    assert len(problems) == 1 and "without opt-in" in problems[0]
    assert kr.check([_inst(k)], LIMITS, [_launch(k, dyn=49152, opt_in=True)]) == []


def test_check_flags_spills_registers_and_unmatched_instances() -> None:
    k, other = "k<float, 4>", "k<float, 2>"
    assert "spill" in kr.check([_inst(k, spill=136)], LIMITS, [_launch(k)])[0]
    (regs,) = kr.check([_inst(k, regs=128)], LIMITS, [_launch(k, threads=544)])[:1]
    assert "65536" in regs
    problems = kr.check([_inst(other)], LIMITS, [_launch(k)])
    assert any("not among the compiled" in p for p in problems)
    assert any("never dispatched" in p for p in problems)


def test_cta_registers_rounds_like_the_hardware() -> None:
    assert kr.cta_registers(119, 512) == 120 * 512
    assert kr.cta_registers(96, 200) == 96 * 224
    assert kr.cta_registers(128, 512) == 65536


PTXAS = """\
ptxas info    : Compiling entry function '_ZN12adaptiveload51_GLOBAL__N__x_18_ln_modulate_bwd_cu_y17ln_mod_bwd_kernelIffLi4ELb0ELi4EEEvNS0_9BwdParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN12adaptiveload51_GLOBAL__N__x_18_ln_modulate_bwd_cu_y17ln_mod_bwd_kernelIffLi4ELb0ELi4EEEvNS0_9BwdParamsE
    488 bytes stack frame, 484 bytes spill stores, 440 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 488 bytes cumulative stack size, 128 bytes smem, 400 bytes cmem[0]
"""  # noqa: E501  (ptxas -v of the first H200 run's sources, one instance)


def test_parse_ptxas_and_short_name() -> None:
    (entry,) = kr.parse_ptxas(PTXAS)
    assert (entry["registers"], entry["static_smem"], entry["spill_stores"]) == (128, 128, 484)
    demangled = (
        "void adaptiveload::(anonymous namespace)::ln_mod_bwd_kernel<float, float, 4, false, 4>"
        "(adaptiveload::(anonymous namespace)::BwdParams)"
    )
    assert kr.short_name(demangled) == "ln_mod_bwd_kernel<float, float, 4, false, 4>"
    fin = (
        "void adaptiveload::(anonymous namespace)::ln_mod_bwd_finalize<float>(float const*, float*)"
    )
    assert kr.short_name(fin) == "ln_mod_bwd_finalize<float>"
    check = "adaptiveload::(anonymous namespace)::ln_mod_check_offsets(int const*, long, long)"
    assert kr.short_name(check) == "ln_mod_check_offsets"
