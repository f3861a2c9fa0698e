"""Fine-tuning (`model.init_from`, `train.lora`): a run starts from a tiny pretrained
checkpoint in either layout bit for bit, the checkpoint's content is the run's identity, what
cannot load is refused in one line; a LoRA run trains the adapters alone (the base weights
stay bit-identical to the checkpoint), saves them alone, resumes to the uninterrupted run's
adapters bit for bit, and exports them merged (`save_wan`) or alone in either naming."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_runner import run
from finetune_setup import CONFIG, pretrained_model, write_pretrained
from training_setup import write_experiment

from adaptiveload import experiment as experiment_config
from adaptiveload.errors import UserError
from adaptiveload.model.lora import LoraSpec, convert_lora, is_lora_key
from adaptiveload.model.weights import load_wan, rename
from adaptiveload.training import checkpoint
from adaptiveload.training.distributed import resolve_ranks
from adaptiveload.training.export import export_lora, export_merged
from adaptiveload.training.finetune import FinetuneWarning
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import Trainer, build_model
from adaptiveload.training.settings import TrainConfig, from_experiment

pytest.importorskip("peft")
LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    return {layout: write_pretrained(root / layout, layout) for layout in ("original", "diffusers")}


def _cfg(init_from: str = "scratch", **kw) -> TrainConfig:
    return TrainConfig("ft", "adaptiveload-packed", 0, CONFIG, init_from=init_from, **kw)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_init_from_loads_either_layout_bit_exact(pretrained, layout):
    model = build_model(_cfg(str(pretrained[layout])), torch.device("cpu"))
    want = pretrained_model().state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_checkpoints_content_is_the_runs_identity(pretrained, tmp_path):
    original = _cfg(str(pretrained["original"]))
    copy = shutil.copytree(pretrained["original"], tmp_path / "elsewhere")
    assert _cfg(str(copy)).fingerprint() == original.fingerprint()  # same bytes, same run
    other = write_pretrained(tmp_path / "other", "original", seed=8)
    assert _cfg(str(other)).fingerprint() != original.fingerprint()
    assert _cfg().fingerprint() != original.fingerprint()
    lora = LoraSpec(4, None, ("q",), 0.0)
    assert replace(original, lora=lora).fingerprint() != original.fingerprint()


def test_what_cannot_load_is_refused_in_one_line(pretrained, tmp_path):
    with pytest.raises(UserError) as exc:
        _cfg(str(tmp_path / "missing"))
    assert "model.init_from" in _one_line(exc) and "not found" in str(exc.value)
    with pytest.raises(UserError) as exc:  # a checkpoint of another model
        build_model(
            replace(_cfg(str(pretrained["original"])), model="wan2.1-tiny"), torch.device("cpu")
        )
    assert "is not a wan2.1-tiny checkpoint" in _one_line(exc) and "dim" in str(exc.value)
    from safetensors.torch import save_file

    save_file({"encoder.weight": torch.zeros(2)}, tmp_path / "foreign.safetensors")
    with pytest.raises(UserError) as exc:  # no layout of Wan's
        _cfg(str(tmp_path / "foreign.safetensors"))
    assert "model.init_from" in _one_line(exc) and "encoder.weight" in str(exc.value)
    state = pretrained_model().state_dict()
    del state["blocks.0.ffn.2.bias"]
    save_file(state, tmp_path / "short.safetensors")
    with pytest.raises(UserError) as exc:  # a key missing: named
        build_model(_cfg(str(tmp_path / "short.safetensors")), torch.device("cpu"))
    assert "blocks.0.ffn.2.bias" in _one_line(exc)
    with pytest.raises(UserError) as exc, pytest.warns(FinetuneWarning):
        build_model(_cfg(lora=LoraSpec(4, None, ("to_q",), 0.0)), torch.device("cpu"))
    assert "train.lora.targets" in _one_line(exc) and "self_attn.q" in str(exc.value)


def test_adapters_on_a_model_from_scratch_train_with_one_warning(recwarn):
    model = build_model(_cfg(lora=LoraSpec(4, None, ("self_attn.q",), 0.0)), torch.device("cpu"))
    assert [w.category for w in recwarn.list] == [FinetuneWarning]
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("self_attn.q.lora_" in n for n in trained)


def _trainer(tmp_path: Path, init_from: Path, ckpt: Path, resume: dict | None = None) -> Trainer:
    tmp_path.mkdir(exist_ok=True)
    exp = experiment_config.load(
        write_experiment(
            tmp_path,
            model={"init_from": str(init_from), "batch_layout": "packed"},
            data={"num_samples": 40},
            steps=3,
            warmup_steps=1,
            checkpoint_every=1,
            world_size=2,
            lora=LORA,
        )
    )
    cfg = from_experiment(exp, "adaptiveload-packed", 0, launch_mode="emulated", world_size=2)
    return Trainer(
        cfg, prepare_data(exp, cfg), ckpt, resolve_ranks(2, 2), progress=False, resume=resume
    )


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if is_lora_key(k)}


@pytest.fixture(scope="module")
def lora_run(pretrained, tmp_path_factory) -> tuple[Trainer, Path, object]:
    tmp = tmp_path_factory.mktemp("lora")
    torch.set_num_threads(1)
    trainer = _trainer(tmp, pretrained["diffusers"], tmp / "ckpt")
    return trainer, tmp / "ckpt", trainer.run().steps


def test_lora_trains_the_adapters_alone_and_saves_them_alone(lora_run):
    trainer, ckpt, _ = lora_run
    state = trainer.model.state_dict()
    base = pretrained_model().state_dict()
    for key, want in base.items():  # every base weight bit-identical to the checkpoint's
        name = (
            key
            if key in state
            else key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        )
        assert torch.equal(state[name], want), key
    adapters = _adapters(trainer.model)
    assert adapters and any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    trained = {id(p) for n, p in trainer.model.named_parameters() if is_lora_key(n)}
    assert optimized == trained
    saved = checkpoint.load_one(ckpt / "ckpt-00000003.pt")
    assert saved["model"].keys() == adapters.keys()
    assert all(torch.equal(saved["model"][k], adapters[k]) for k in adapters)


def test_a_lora_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(
    lora_run, pretrained, tmp_path
):
    trainer, ckpt, steps = lora_run
    shutil.copy(ckpt / "ckpt-00000002.pt", tmp_path / "ckpt-00000002.pt")
    state = checkpoint.find(tmp_path, trainer.identity, last=2).state
    assert state is not None and state["step"] == 2
    resumed = _trainer(tmp_path / "again", pretrained["diffusers"], tmp_path, resume=state)
    again = resumed.run().steps
    assert again["loss"].tolist() == steps["loss"].tolist()
    want, got = _adapters(trainer.model), _adapters(resumed.model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_exports_merged_and_adapters_alone_in_either_naming(lora_run, tmp_path):
    trainer, ckpt, _ = lora_run
    src = ckpt / "ckpt-00000003.pt"
    merged = load_wan(export_merged(src, tmp_path / "merged", "original"))
    gen = torch.Generator().manual_seed(3)
    c = merged.cfg.in_dim
    x = [torch.randn(2, c, 1, 4, 4, generator=gen), torch.randn(1, c, 2, 4, 6, generator=gen)]
    t = torch.tensor([10.0, 500.0, 900.0])
    context = torch.randn(3, merged.cfg.text_len, merged.cfg.text_dim, generator=gen)
    trainer.model.execution = merged.execution = None
    with torch.no_grad():
        want, got = trainer.model(x, t, context), merged(x, t, context)
        base = pretrained_model()(x, t, context)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want, strict=True))
    # the adapters moved the outputs beyond that tolerance: the merge is what made them agree
    assert not all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(base, want, strict=True)
    )
    adapters = _adapters(trainer.model)
    from safetensors.torch import load_file

    for naming, prefix in (("original", "diffusion_model."), ("diffusers", "transformer.")):
        written = load_file(export_lora(src, tmp_path / f"{naming}.safetensors", naming))
        assert all(k.startswith(prefix) for k in written)
        alphas = {k: v for k, v in written.items() if k.endswith(".alpha")}
        assert bool(alphas) == (naming == "original")  # ComfyUI's scale, alpha / rank
        assert all(float(v) == LORA["alpha"] for v in alphas.values())
        back = convert_lora({k: v for k, v in written.items() if k not in alphas}, "peft")
        assert back.keys() == adapters.keys()
        assert all(torch.equal(back[k], adapters[k]) for k in adapters)


def test_lora_names_map_through_the_base_models_table():
    keys = [
        "blocks.3.self_attn.q.lora_A.default.weight",
        "blocks.3.cross_attn.o.lora_B.default.weight",
        "blocks.0.ffn.0.lora_A.default.weight",
        "head.head.lora_B.default.weight",
    ]
    state = {k: torch.randn(2, 2) for k in keys}
    diffusers = convert_lora(state, "diffusers")
    for key, new in zip(keys, diffusers, strict=True):  # the module part is weights.rename's
        module = key.split(".lora_")[0] + "."
        assert new.startswith("transformer." + rename(module, "diffusers") + "lora_")
    original = convert_lora(diffusers, "original")
    assert list(original) == ["diffusion_model." + k.replace(".default", "") for k in keys]
    assert convert_lora(convert_lora(original, "diffusers"), "original") == original
    back = convert_lora(original, "peft")
    assert list(back) == keys and all(back[k] is state[k] for k in keys)
    with pytest.raises(UserError) as exc:
        convert_lora({"transformer.blocks.0.attn1.to_x.lora_A.weight": torch.zeros(1)}, "original")
    assert "attn1.to_x" in _one_line(exc)


def test_diffusers_runs_the_exported_adapters_as_the_run_trained_them(
    lora_run, pretrained, tmp_path
):
    """The adapters in diffusers' names, loaded by diffusers' own `load_lora_adapter` into
    its WanTransformer3DModel of the same base, give the trained model's output (alpha 8,
    rank 4: the scale travels in the file's adapter metadata)."""
    diffusers = pytest.importorskip("diffusers")
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    trainer, ckpt, _ = lora_run
    path = export_lora(ckpt / "ckpt-00000003.pt", tmp_path / "lora.safetensors", "diffusers")
    with safe_open(path, "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    theirs = diffusers.WanTransformer3DModel.from_pretrained(pretrained["diffusers"])
    theirs.load_lora_adapter(load_file(path), prefix="transformer", metadata=metadata)
    ours = trainer.model
    ours.execution = None
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, ours.cfg.in_dim, 2, 4, 4, generator=gen)
    t, context = torch.tensor([400.0]), torch.randn(1, 8, ours.cfg.text_dim, generator=gen)
    with torch.no_grad():
        want = ours(x, t, context)
        got = theirs(x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]
        theirs.disable_adapters()
        base = theirs(x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]
    assert float((got - want).norm() / want.norm()) <= 1e-5
    assert float((base - want).norm() / want.norm()) > 1e-5  # the adapters did matter


def test_cli_export_writes_and_refuses_in_one_line(lora_run, tmp_path, monkeypatch, capsys):
    _, ckpt, _ = lora_run
    src = str(ckpt / "ckpt-00000003.pt")
    args = ("model", "export", src, "-o", str(tmp_path / "merged"), "--to", "diffusers")
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "diffusers layout" in out
    assert load_wan(tmp_path / "merged").cfg.name == CONFIG
    code, _, err = run(monkeypatch, capsys, *args)  # the folder exists now
    assert code == 2 and err.strip().count("\n") == 0 and "new output folder" in err
    lora = ("model", "export", src, "-o", str(tmp_path / "a.safetensors"), "--lora-only")
    code, _, err = run(monkeypatch, capsys, *lora, "--to", "comfyui")
    assert code == 2 and "--to 'comfyui'" in err and not (tmp_path / "a.safetensors").exists()
    code, _, err = run(
        monkeypatch, capsys, "model", "export", str(tmp_path / "none.pt"), "-o", str(tmp_path / "x")
    )
    assert code == 2 and err.strip().count("\n") == 0 and "none.pt" in err
