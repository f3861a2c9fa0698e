"""A run executes the plan `adaptiveload plan` wrote (what the pipeline's train rule passes as
--plan), or refuses before writing anything; and its ranks come from one place."""

from __future__ import annotations

import pytest

from adaptiveload.errors import UserError
from adaptiveload.training.distributed import Ranks, resolve_ranks


def test_ranks_are_resolved_from_torchrun_else_the_flag_else_the_config(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_ranks(None, 4) == Ranks.emulated(4) == Ranks(4, (0, 1, 2, 3), False)
    assert resolve_ranks(2, 4) == Ranks.emulated(2)
    assert resolve_ranks(2, 4).launch_mode == "emulated"
    with pytest.raises(UserError, match="--emulate-world-size 0"):
        resolve_ranks(0, 4)

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ranks = resolve_ranks(None, 4)
    assert ranks == Ranks(2, (1,), True, process_rank=1, local_rank=1)
    assert ranks.launch_mode == "distributed" and not ranks.is_main
    with pytest.raises(UserError, match="not with torchrun"):
        resolve_ranks(2, 4)


def test_a_run_says_what_its_ln_modulate_sites_executed():
    """`ln_modulate_impl` (tag and summary): eager is eager; fused is the CUDA kernel only on
    CUDA with the library loaded, else the op's reference math, which `session.resolve`
    refuses on CUDA so that a fused GPU row never measures reference math."""
    from adaptiveload.ops import ln_modulate as lm
    from adaptiveload.training.settings import TrainConfig
    from adaptiveload.training.summary import ln_modulate_impl

    def impl(kernel: str, device: str) -> str:
        cfg = TrainConfig("e", "adaptiveload", 0, "wan2.1-micro", kernel=kernel, device=device)
        return ln_modulate_impl(cfg)

    assert impl("eager", "cpu") == impl("eager", "cuda") == "eager"
    assert impl("fused", "cpu") == "reference math"
    assert impl("fused", "cuda") == ("cuda kernel" if lm.fused_available() else "reference math")
