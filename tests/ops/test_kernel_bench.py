"""The kernel benchmarks' CPU-runnable parts: the end-to-end training-step benchmark as a dry
run at tiny scale (real model, real steps, CSV as on the GPU), the torch.compile baselines'
gradients for Wan's broadcast modulation and for the packed (segment) sequence, the packs'
offsets, and both benchmarks' configs refusing bad input."""

from __future__ import annotations

import pytest
import torch

from adaptiveload.calibration import kernel_e2e
from adaptiveload.errors import UserError
from adaptiveload.ops import kernel_bench

torch.set_num_threads(1)


def test_compile_baseline_of_the_packed_sequence_matches_eager():
    """The segment shapes' torch.compile baseline: Wan's sequence with the per-token gather of
    modulation rows, compiled with static shapes, gives eager's gradients ([G, D] sums)."""
    torch._dynamo.reset()
    cu = kernel_bench.segment_offsets(40, 3, seed=1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    e = 0.1 * torch.randn(3, 6, 64, generator=gen)
    leaves = (x, e[:, 1].detach().requires_grad_(), e[:, 0].detach().requires_grad_())
    fn = kernel_bench.compiled_baseline(kernel_bench.lm.wan_eager_segments)
    y = fn(*leaves, cu)
    dy = torch.randn(y.shape, generator=gen)
    got = torch.autograd.grad(y, leaves, dy)
    want = torch.autograd.grad(kernel_bench.lm.wan_eager_segments(*leaves, cu), leaves, dy)
    for g, w, leaf in zip(got, want, leaves, strict=True):
        assert g.shape == leaf.shape
        assert ((g.double() - w.double()).norm() / w.double().norm()).item() <= 3e-2


@pytest.mark.parametrize(("total", "count"), [(75600, 64), (16384, 8), (100, 1), (64, 64)])
def test_segment_offsets_are_an_uneven_reproducible_pack(total, count):
    cu = kernel_bench.segment_offsets(total, count, seed=0)
    lengths = (cu[1:] - cu[:-1]).long()
    assert cu.dtype == torch.int32 and cu.shape == (count + 1,)
    assert cu[0] == 0 and cu[-1] == total and (lengths >= 1).all()
    mean = total / count
    assert (lengths >= 0.5 * mean - 1).all() and (lengths <= 1.5 * mean + 2).all()
    assert torch.equal(cu, kernel_bench.segment_offsets(total, count, seed=0))
    if count >= 8 and total >= 10 * count:
        assert lengths.max() > 1.2 * lengths.min()  # uneven: a pack of mixed shapes


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: kernel_bench.KernelBenchConfig(segment_counts=(8, 0)), "segment_counts"),
        (lambda: kernel_bench.KernelBenchConfig(dims=(), segment_counts=()), "no shape"),
        (lambda: kernel_bench.KernelBenchConfig(segment_counts=(64,), segment_lens=(32,)),
         "64 segments in a pack of 32 tokens"),
        (lambda: kernel_bench.KernelBenchConfig(dims=(1536, 0)), "dims"),
        (lambda: kernel_bench.KernelBenchConfig(impls=("fused", "triton")), "impls"),
        (lambda: kernel_bench.KernelBenchConfig(repeats=0), "repeats"),
        (lambda: kernel_e2e.E2EConfig(device="mps"), "device"),
        (lambda: kernel_e2e.E2EConfig(model="wan9"), "wan9"),
        (lambda: kernel_e2e.E2EConfig(seq_lens=()), "seq_lens"),
    ],
)
def test_bench_configs_refuse_what_cannot_run(make, fragment):
    with pytest.raises(UserError, match=fragment):
        make()
