"""The all-to-all calibration (`calibration.comm`, `calibrate comm`) and the SP process groups
(`training.sp_groups`): the fit recovers known latency and bandwidth, the `comm` section has
the shared format, and under torchrun (gloo, 4 processes) the command measures for real and
the groups are the aligned blocks. Nothing here asserts a timing value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from comm_format import LINK_KEYS, POINT_KEYS, SPEC_KEYS
from repo_paths import H200_PRIOR

from adaptiveload.calibration.comm import comm_section, fit_links, read_target, with_comm
from adaptiveload.calibration.settings import COMM_SIZES, CommGrid
from adaptiveload.errors import UserError
from adaptiveload.training.sp_groups import SPGroups, block, blocks, check_group_degree, degrees_of

LINKS = {2: (3.1e-5, 3.4e11), 4: (4.5e-5, 2.9e11), 8: (6.0e-5, 2.2e11)}  # latency, bytes/s


def _points(links: dict[int, tuple[float, float]], sizes=(2**16, 2**20, 2**24)) -> list[dict]:
    return [
        {"degree": d, "bytes": n, "seconds": lat + n * (d - 1) / d / bw}
        for d, (lat, bw) in links.items() for n in sizes
    ]


def test_fit_recovers_known_latency_and_bandwidth_per_degree():
    links, fits = fit_links(_points(LINKS))
    assert [link["degree"] for link in links] == [2, 4, 8]
    for link, fit in zip(links, fits, strict=True):
        latency, bandwidth = LINKS[link["degree"]]
        assert link["latency_s"] == pytest.approx(latency, rel=1e-6)
        assert link["bytes_per_s"] == pytest.approx(bandwidth, rel=1e-9)
        assert fit["r2"] == pytest.approx(1.0) and fit["max_rel_err"] < 1e-6
        assert not fit["latency_clamped_at_zero"]


def test_fit_keeps_the_latency_non_negative_and_refuses_what_has_no_bandwidth():
    # times through a negative intercept: the constrained fit lies on latency 0
    points = [{"degree": 2, "bytes": n, "seconds": -1e-4 + n / 2 / 1e9} for n in (1e6, 2e6, 4e6)]
    (link,), (fit,) = fit_links(points)
    assert link["latency_s"] == 0.0 and fit["latency_clamped_at_zero"]
    xs = [n / 2 for n in (1e6, 2e6, 4e6)]
    ys = [p["seconds"] for p in points]
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    assert link["bytes_per_s"] == pytest.approx(1 / slope)
    flat = [{"degree": 4, "bytes": n, "seconds": 1e-3 - n * 1e-12} for n in (1e5, 1e6)]
    with pytest.raises(UserError, match="degree 4: seconds do not grow with bytes"):
        fit_links(flat)
    with pytest.raises(UserError, match="degree 2: needs >= 2 sizes"):
        fit_links([{"degree": 2, "bytes": 4096, "seconds": 1e-4}] * 3)


def test_comm_section_has_the_shared_format():
    grid = CommGrid("cpu", (2**16, 2**20, 2**24), repeats=3, warmup=1)
    section = comm_section(_points(LINKS), "gloo", "cpu", 8, grid)
    assert set(section) >= SPEC_KEYS and section["source"] == "measured"
    assert section["backend"] == "gloo" and section["device"].startswith("cpu:")
    assert section["dtype_bytes"] == 4  # fp32 activations on CPU (bf16 on CUDA: 2)
    assert all(set(link) == LINK_KEYS for link in section["links"])
    assert all(set(p) == POINT_KEYS for p in section["points"])
    assert [link["degree"] for link in section["links"]] == sorted(LINKS)
    prov = section["provenance"]
    assert prov["world_size"] == 8 and prov["torch"] and prov["sizes"] == list(grid.byte_sizes)
    assert json.loads(json.dumps(section)) == section  # plain JSON


def test_grid_defaults_and_refusals():
    assert CommGrid("cuda").byte_sizes == COMM_SIZES["cuda"]
    assert COMM_SIZES["cuda"][0] == 64 * 1024 and COMM_SIZES["cuda"][-1] == 64 * 1024**2
    assert CommGrid("cpu", (4096, 1024)).byte_sizes == (1024, 4096)
    for bad in ({"sizes": (4096,)}, {"sizes": (0, 4096)}, {"repeats": 0}, {"device": "tpu"}):
        with pytest.raises(UserError):
            CommGrid(**bad)


def test_merge_keeps_every_other_field(tmp_path):
    cal = json.loads(H200_PRIOR.read_text())
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    data, out = read_target(path, None)
    assert out == path
    section = comm_section(_points(LINKS), "gloo", "cpu", 8, CommGrid("cpu", (2**16, 2**20)))
    with_comm(data, section, out)
    merged = json.loads(path.read_text())
    assert merged["comm"] == section and {k: v for k, v in merged.items() if k != "comm"} == cal
    with pytest.raises(UserError, match="give -o/--output"):
        read_target(Path("h200-wan2.1-t2v-1.3b"), None)
    assert read_target(Path("h200-wan2.1-t2v-1.3b"), path)[0] == cal  # shipped, by name
    (tmp_path / "not.json").write_text("{}")
    with pytest.raises(UserError, match="missing field"):
        read_target(tmp_path / "not.json", None)


def test_groups_are_aligned_blocks_of_power_of_two_degrees():
    assert degrees_of(8) == (2, 4, 8) and degrees_of(12) == (2, 4) and degrees_of(3) == ()
    for degree in degrees_of(8):
        tiles = blocks(8, degree)
        assert sorted(r for b in tiles for r in b) == list(range(8))  # each rank once
        assert all(b.start % degree == 0 and len(b) == degree for b in tiles)
        assert all(block(r, degree) in tiles and r in block(r, degree) for r in range(8))
    for degree, world in ((3, 6), (4, 6), (16, 8), (0, 8)):
        with pytest.raises(UserError, match=f"degree {degree}: expected a power of two"):
            check_group_degree(degree, world)
    assert SPGroups(8, (), {}).group_of(5, 1) == (None, 0)  # degree 1: no group
    with pytest.raises(UserError, match="no group was built for it"):
        SPGroups(8, (), {}).group_of(5, 2)


def test_a_world_of_one_writes_nothing(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from adaptiveload.cli import _register
    from adaptiveload.cli.app import app

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    _register()
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["calibrate", "comm", "--calibration",
                                      "h200-wan2.1-t2v-1.3b", "-o", str(out)])
    assert isinstance(result.exception, UserError), result.output
    assert "needs >= 2 processes" in str(result.exception) and not out.exists()
