import pytest

from adaptiveload import config
from adaptiveload.errors import UserError


def test_minimal_file_gets_every_default(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("name: x\n")
    cfg = config.load(path)
    assert cfg["budgets"] == {"m_tok": "auto", "m_mem": "auto", "m_comp": "auto", "p": "auto"}
    assert cfg["train"]["world_size"] >= 1
    assert cfg["data"]["bucketing"] == "aspect"


def test_shipped_experiments_validate():
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[1].glob("experiments/*.yaml"))
    assert files, "no experiment files found"
    for path in files:
        config.load(path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("name: x\nbudgets: {p: 7}\n", "budgets.p"),
        ("name: x\ntrain: {world_size: 0}\n", "train.world_size"),
        ("name: x\npolicies: [bogus]\n", "policies.0"),
        ("name: x\nunknown_section: 1\n", "(top level)"),
    ],
)
def test_bad_field_is_named(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        config.load(path)
    assert str(path) in str(info.value)
    assert f"'{field}'" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        config.load(tmp_path / "nope.yaml")
