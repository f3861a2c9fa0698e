"""Wan 2.1 model: configs, parameter counts, shapes, gradients, switches."""

from __future__ import annotations

import pytest
import torch

from adaptiveload.model.architectures import get_config

torch.set_num_threads(2)


def test_model_info_cli_reports_parameters_tokens_and_flops():
    import json
    import subprocess
    import sys

    from adaptiveload.model.analytic import flop_terms

    proc = subprocess.run(
        [sys.executable, "-m", "adaptiveload", "model", "info", "--config", "wan2.1-t2v-1.3b",
         "--frames", "81", "--height", "480", "--width", "832", "--json"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert abs(info["parameters"] / 1.419e9 - 1) < 0.01
    assert (info["dim"], info["num_layers"], info["num_heads"], info["tokens"]) == (
        1536, 30, 12, 32760,
    )
    terms = flop_terms(get_config("wan2.1-t2v-1.3b"))
    assert info["flops_per_sample"] == pytest.approx(3 * terms.forward(32760))
    bad = subprocess.run(
        [sys.executable, "-m", "adaptiveload", "model", "info", "--config", "wan2.1-tiny",
         "--frames", "80"],
        capture_output=True, text=True,
    )
    assert bad.returncode == 2 and "4k+1" in bad.stderr
