"""`train.steps: epoch`: the warm-up replays the epoch's first batches, then exactly one whole
epoch is timed, so every policy's timed window holds the same samples; a resume at the seam
(the step where the epoch starts again) continues the same batches."""

from __future__ import annotations

import pytest

from adaptiveload.errors import UserError
from adaptiveload.step_table import WHOLE_EPOCH, run_steps


def test_run_steps():
    assert run_steps(40, 4, 83) == 40
    assert run_steps(WHOLE_EPOCH, 4, 83) == 87
    with pytest.raises(UserError, match=r"train\.steps"):
        run_steps("all", 4, 83)
