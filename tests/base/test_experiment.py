import pytest
import torch
from repo_paths import ROOT

from adaptiveload import experiment
from adaptiveload.data.bucketing import (
    DEFAULT_GRID,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MODE,
    GRIDS,
    MODES,
    SHORT_CLIPS,
)
from adaptiveload.data.dataset import CONTENTS
from adaptiveload.errors import UserError
from adaptiveload.model.attention import LAYOUTS
from adaptiveload.pipeline import MAX_EMULATED_WORLD_SIZE, SWEEP_VARIANTS
from adaptiveload.planning.budgets import MAX_BUDGET, P_RANGE
from adaptiveload.planning.plan import FREE, STEP_MODES
from adaptiveload.planning.policies import POLICIES
from adaptiveload.planning.simulate import DEFAULT_ALLREDUCE_GBPS
from adaptiveload.training.settings import (
    AUTO_LAYOUT,
    AUTO_PRECISION,
    DEVICES,
    KERNELS,
    PRECISIONS,
    TrainConfig,
    from_experiment,
)


def test_minimal_file_gets_every_default(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("name: x\n")
    cfg = experiment.load(path)
    assert cfg["budgets"] == {
        "m_tok": "auto", "m_mem": "auto", "m_comp": "auto", "pack_tokens": None, "p": "auto",
    }
    assert cfg["train"]["world_size"] >= 1
    assert cfg["data"]["bucketing"] == "aspect"


def test_shipped_experiments_validate():
    files = sorted(ROOT.glob("experiments/*.yaml"))
    assert files, "no experiment files found"
    for path in files:
        experiment.load(path)


def test_snakemake_fills_the_schemas_defaults():
    """The Snakefile validates through Snakemake's own default-filling validator, which
    recurses into a field's properties even where the value is null: every shipped file and
    one with each nullable section given must pass it as the package's validator does."""
    snakemake_utils = pytest.importorskip("snakemake.utils")
    files = sorted(ROOT.glob("experiments/*.yaml"))
    configs = [experiment.read_yaml(path, "experiment file") for path in files]
    configs.append({"name": "x", "train": {"lora": {"rank": 4}}})
    for config in configs:
        snakemake_utils.validate(config, str(experiment.SCHEMA_PATH))
    assert configs[-1]["train"]["lora"]["targets"], "the nested defaults were not filled"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("name: x\nbudgets: {p: 7}\n", "budgets.p"),
        ("name: x\ntrain: {world_size: 0}\n", "train.world_size"),
        ("name: x\npolicies: [bogus]\n", "policies.0"),
        ("name: x\nunknown_section: 1\n", "(top level)"),
        ("name: x\nplan: {steps_per_epoch: matched}\n", "plan.steps_per_epoch"),
        ("name: x\nplan: {steps_per_epoch: 0}\n", "plan.steps_per_epoch"),
        ("name: x\ntrain: {step_modes: [free, free]}\n", "train.step_modes"),
        ("name: x\ntrain: {step_modes: [matched]}\n", "train.step_modes"),
        # names become folders and values reach a job's shell: hostile ones are refused
        ("name: '..'\n", "name"),
        ("name: '.'\n", "name"),
        ("name: a/b\n", "name"),
        ("name: .hidden\n", "name"),
        ("name: x\ndata: {mixture: '$(touch PWNED)tiny-cpu'}\n", "data.mixture"),
        ("name: x\nanalysis: {baseline: 'equal-token; touch PWNED'}\n", "analysis.baseline"),
        ("name: x\nsweeps: {mixtures: ['../x']}\n", "sweeps.mixtures.0"),
    ],
)
def test_bad_field_is_named(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        experiment.load(path)
    assert str(path) in str(info.value)
    assert f"'{field}'" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        experiment.load(tmp_path / "nope.yaml")


def test_train_config_defaults_are_the_schemas():
    """A TrainConfig built from its dataclass defaults equals one from an experiment file that
    sets nothing: a dataclass default that drifts from the schema's fails here."""
    exp = experiment.validate({"name": "x"}, "test")
    from_file = from_experiment(
        exp, "adaptiveload", 0, launch_mode="emulated", world_size=exp["train"]["world_size"]
    )
    bare = TrainConfig(experiment="x", policy="adaptiveload", seed=0, model=exp["model"]["config"])
    assert bare == from_file


def test_training_has_its_own_device_and_precision():
    """train.device (null: calibration.device, as before it existed) and train.precision
    (auto: bf16 on CUDA, fp32 on CPU, what the trainer hard-coded before)."""

    def cfg(**sections):
        exp = experiment.validate({"name": "x", **sections}, "test")
        return from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=1)

    assert (cfg().device, cfg().precision, cfg().autocast_dtype) == ("cpu", "fp32", None)
    on_gpu = cfg(calibration={"device": "cuda"})
    assert (on_gpu.device, on_gpu.precision) == ("cuda", "bf16")
    assert on_gpu.autocast_dtype == torch.bfloat16
    assert cfg(calibration={"device": "cuda"}, train={"device": "cpu"}).device == "cpu"
    assert cfg(train={"precision": "bf16"}).autocast_dtype == torch.bfloat16
    assert cfg(train={"device": "cuda", "precision": "fp16"}).autocast_dtype == torch.float16
    with pytest.raises(UserError, match=r"train\.precision fp16: CUDA only") as err:
        cfg(train={"precision": "fp16"})
    assert "\n" not in str(err.value)


def test_schema_default_reads_nested_and_list_fields():
    filled = experiment.validate({"name": "x"}, "test")
    assert experiment.schema_default("train.steps") == filled["train"]["steps"]
    assert experiment.schema_default("paper_map.centre.world_size") == 16
    assert experiment.schema_default("simulate.grid") == "wan"  # a field of the list's entries
    with pytest.raises(KeyError, match="no such field"):
        experiment.schema_default("train.nope")
    with pytest.raises(KeyError, match="no default"):
        experiment.schema_default("name")


def test_schema_copies_of_code_constants():
    """The schema cannot import; where it repeats a name list or a number the code owns, the
    copy must match the code's."""
    props = experiment.schema()["properties"]
    data, sim = props["data"]["properties"], props["simulate"]["items"]["properties"]
    assert props["policies"]["items"]["enum"] == list(POLICIES)
    assert experiment.schema_default("policies") == [
        name for name, policy in POLICIES.items() if not policy.peer
    ]
    assert experiment.schema_default("analysis.baseline") in POLICIES
    for section in (data, sim):
        assert section["bucketing"]["enum"] == list(MODES)
        assert section["grid"]["enum"] == list(GRIDS)
    assert experiment.schema_default("data.bucketing") == DEFAULT_MODE
    assert experiment.schema_default("simulate.bucketing") == DEFAULT_MODE
    assert experiment.schema_default("simulate.grid") == DEFAULT_GRID
    assert experiment.schema_default("data.max_frames") == DEFAULT_MAX_FRAMES
    assert data["short_clips"]["enum"] == list(SHORT_CLIPS)  # its default: bucketing reads it
    assert data["content"]["enum"] == list(CONTENTS)
    assert experiment.schema_default("data.content") == CONTENTS[0]  # noise: nothing changes
    for field in ("train", "simulate", "paper_map"):
        assert experiment.schema_default(f"{field}.allreduce_gbps") == DEFAULT_ALLREDUCE_GBPS
    assert props["model"]["properties"]["kernels"]["items"]["enum"] == list(KERNELS)
    assert props["model"]["properties"]["batch_layout"]["enum"] == [AUTO_LAYOUT, *LAYOUTS]
    assert props["calibration"]["properties"]["device"]["enum"] == list(DEVICES)
    assert props["train"]["properties"]["device"]["enum"] == [*DEVICES, None]
    assert props["train"]["properties"]["precision"]["enum"] == [AUTO_PRECISION, *PRECISIONS]
    assert props["train"]["properties"]["world_size"]["maximum"] == MAX_EMULATED_WORLD_SIZE
    assert list(props["sweeps"]["properties"]) == list(SWEEP_VARIANTS)  # every axis is named
    budgets = props["budgets"]["properties"]
    assert budgets["m_comp"]["oneOf"][1]["maximum"] == MAX_BUDGET
    assert budgets["pack_tokens"]["maximum"] == MAX_BUDGET
    p = budgets["p"]["oneOf"][1]
    assert (p["minimum"], p["maximum"]) == P_RANGE
    modes = props["plan"]["properties"]["steps_per_epoch"]["oneOf"]
    assert modes[0]["enum"] == list(STEP_MODES) and modes[1]["type"] == "integer"
    assert experiment.schema_default("plan.steps_per_epoch") == FREE
    assert sim["steps_per_epoch"]["oneOf"][1]["oneOf"] == modes  # the same values, one anchor
