"""Packed micro-batches with activation checkpointing: samples of different shapes as one token
stream give exactly what each sample gives alone (outputs and every parameter gradient, fp32,
<= 1e-5 relative), eager and fused (the op's CPU reference) modulation; and a pack of one
shape equals the dense path (without checkpointing: tests/model/test_model_packed.py)."""

from __future__ import annotations

import pytest
import torch
from packed_cases import check_one_shape_pack_equals_dense, check_packed_equals_alone

torch.set_num_threads(2)


@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_packed_forward_and_backward_equal_each_sample_alone_checkpointed(impl):
    check_packed_equals_alone(impl, checkpointing=True)


def test_a_pack_of_one_shape_equals_the_dense_batch_checkpointed():
    check_one_shape_pack_equals_dense(checkpointing=True)
