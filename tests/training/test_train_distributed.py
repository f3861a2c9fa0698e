"""torchrun with 2 gloo processes (real DDP, FSDP2) trains exactly like 2 emulated ranks.

Launched as the README launches a training stage by hand: the `torchrun` beside this Python,
`-m adaptiveload train` with --kernel, --manifest and --out."""

from __future__ import annotations

import pytest

from adaptiveload.errors import UserError
from adaptiveload.training import distributed as dd


def test_backend_is_nccl_on_cuda_gloo_on_cpu_unless_overridden(monkeypatch):
    monkeypatch.delenv(dd.BACKEND_ENV, raising=False)
    assert (dd.backend("cpu"), dd.backend("cuda")) == ("gloo", "nccl")
    monkeypatch.setenv(dd.BACKEND_ENV, "gloo")  # processes sharing one GPU
    assert dd.backend("cuda") == "gloo"
    for bad, device in (("nccl", "cpu"), ("mpi", "cuda")):
        monkeypatch.setenv(dd.BACKEND_ENV, bad)
        with pytest.raises(UserError, match=dd.BACKEND_ENV):
            dd.backend(device)
