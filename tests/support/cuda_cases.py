"""Helpers of the CUDA kernel tests (test_kernel_cuda*.py): cases recorded for pytest and for
script mode (the GPU machine may lack pytest), fresh seeds, NaN-poisoned allocator blocks and
the relative norm error every comparison uses."""

from __future__ import annotations

import itertools
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from adaptiveload.ops import ln_modulate as lm

try:
    import pytest
except ImportError:  # the GPU machine may lack pytest: see run_as_script()
    pytest = None

SKIP_REASON = (
    "no CUDA device visible" if not torch.cuda.is_available() else lm.fused_unavailable_reason()
)
# bf16/fp16 I/O carries its rounding; fp32 outputs are held to fp32 accuracy
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


def parametrize(names: str, values: list) -> Callable:
    """pytest.mark.parametrize that also records the cases for script mode."""

    def deco(fn: Callable) -> Callable:
        fn.cases = [(names, values), *getattr(fn, "cases", [])]
        return pytest.mark.parametrize(names, values)(fn) if pytest else fn

    return deco


def pytest_marks() -> list:
    """The module marks of a CUDA test file (`pytestmark`): `cuda`, skipped with the reason
    without one; none in script mode."""
    if pytest is None:
        return []
    return [pytest.mark.cuda, pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)]


def fresh_seed() -> int:
    """A clock-drawn seed, set and printed (pytest shows it on failure)."""
    seed = time.time_ns() % 2**31
    torch.manual_seed(seed)
    print(f"seed {seed}")
    return seed


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative norm error of a against b, in fp64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def poison(*like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Fill then free blocks of the outputs' sizes: the caching allocator hands them out next,
    so an output element a kernel forgot to write shows up as NaN."""
    blocks = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in like]
    torch.cuda.synchronize()
    del blocks


def run_as_script(namespace: dict[str, Any]) -> int:
    """Script mode: run every test_* of `namespace` with the product of its recorded cases."""
    if SKIP_REASON:
        print(f"SKIPPED: {SKIP_REASON}")
        return 0
    failures = total = 0
    for name, fn in list(namespace.items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        groups = getattr(fn, "cases", [])
        keys = [g[0] for g in groups]
        for combo in itertools.product(*(g[1] for g in groups)):
            total += 1
            label = f"{name}[{', '.join(f'{k}={v}' for k, v in zip(keys, combo, strict=True))}]"
            try:
                fn(**dict(zip(keys, combo, strict=True)))
                print(f"PASS {label}")
            except Exception:
                failures += 1
                print(f"FAIL {label}\n{traceback.format_exc()}")
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0
