"""Wan 2.1 T2V checkpoints in, out and across layouts (adaptiveload.model.weights).

Every checkpoint here is written by the test itself at micro width: the original layout as a
state dict in one safetensors or .pth file, or sharded by hand with an index; the diffusers
layout by diffusers' own `save_pretrained` (sharded too). Loads and round trips are compared
bit for bit (`torch.equal`, dtypes included); each refusal is one line naming what is wrong.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from cli_runner import run
from safetensors.torch import load_file, save_file

from adaptiveload.errors import UserError
from adaptiveload.model import weights
from adaptiveload.model.architectures import WanConfig, get_config
from adaptiveload.model.wan import WanModel

MICRO = get_config("wan2.1-micro")
# two layers (block index 1 renamed too), 3 heads: a shape no registered config has
CUSTOM = WanConfig("custom", dim=48, ffn_dim=64, num_heads=3, num_layers=2, freq_dim=32,
                   text_len=8, text_dim=24)


def perturbed(cfg: WanConfig, seed: int = 0) -> WanModel:
    """A model whose every weight is off its init value (norm weights of 1 and zeros too)."""
    torch.manual_seed(seed)
    model = WanModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical: the same keys, dtypes and values."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def write_sharded(state: dict[str, torch.Tensor], folder: Path, config: dict | None) -> Path:
    """The Hub's sharded form, written by hand: two files and the index naming them."""
    folder.mkdir()
    keys = list(state)
    halves = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2 :]}
    for name, part in halves.items():
        save_file({k: state[k].contiguous() for k in part}, folder / name)
    index = {"weight_map": {k: name for name, part in halves.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_original_file_loads_bit_exact(tmp_path, suffix):
    state = perturbed(MICRO).state_dict()
    path = tmp_path / f"wan{suffix}"
    if suffix == ".pth":
        torch.save(state, path)
    else:
        save_file(state, path)
    model = weights.load_wan(path)  # no config.json: the shape names wan2.1-micro
    assert model.cfg == MICRO
    assert same(model.state_dict(), state)


def test_original_shards_with_index_load_bit_exact_and_bf16_widens_exactly(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in perturbed(CUSTOM).state_dict().items()}
    config = weights.layout_config(CUSTOM, "original")  # num_heads comes from here
    folder = write_sharded(state, tmp_path / "ckpt", config)
    model = weights.load_wan(folder)
    assert (model.cfg.num_heads, model.cfg.num_layers, model.cfg.dim) == (3, 2, 48)
    loaded = model.state_dict()
    assert all(v.dtype == torch.float32 for v in loaded.values())
    assert same({k: v.to(torch.bfloat16) for k, v in loaded.items()}, state)
    # the index itself as the path reads the config.json beside it (num_heads is only there)
    by_index = weights.load_wan(folder / "model.safetensors.index.json")
    assert by_index.cfg == model.cfg and same(by_index.state_dict(), loaded)


def test_diffusers_folder_loads_and_matches_diffusers(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**weights.layout_config(CUSTOM, "diffusers")).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # a pipeline folder: transformer/ holds diffusers' own sharded save
    ref.save_pretrained(tmp_path / "pipe" / "transformer", max_shard_size="20KB")
    assert len(list((tmp_path / "pipe" / "transformer").glob("*.safetensors"))) > 1
    model = weights.load_wan(tmp_path / "pipe", config=None).eval()
    renamed = {weights.rename(k, "original"): v for k, v in ref.state_dict().items()}
    assert same(model.state_dict(), renamed)
    x = torch.randn(1, 16, 2, 4, 6)
    t = torch.tensor([500.0])
    ctx = torch.randn(1, CUSTOM.text_len, CUSTOM.text_dim)
    with torch.no_grad():
        want = ref(x, t, ctx, return_dict=False)[0]
        got = model(x, t, ctx)
    assert float((got - want).norm() / want.norm()) <= 1e-4


def test_convert_round_trip_is_bit_exact_and_diffusers_reads_it(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in perturbed(MICRO).state_dict().items()}
    src = write_sharded(state, tmp_path / "orig", weights.layout_config(MICRO, "original"))
    assert weights.convert(src, tmp_path / "diff", "diffusers") == MICRO
    assert len(list((tmp_path / "diff").glob("*.safetensors"))) == 2  # shards kept
    weights.convert(tmp_path / "diff", tmp_path / "back", "original")
    back = {}
    for file in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(load_file(file))
    assert same(back, state)
    # a diffusers field without a Wan counterpart survives a round trip through the original
    # layout (it was reset to diffusers' default)
    config = tmp_path / "diff" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rope_max_seq_len": 64}))
    weights.convert(tmp_path / "diff", tmp_path / "o2", "original")
    weights.convert(tmp_path / "o2", tmp_path / "d2", "diffusers")
    assert json.loads((tmp_path / "d2" / "config.json").read_text())["rope_max_seq_len"] == 64
    diffusers = pytest.importorskip("diffusers")
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "diff")  # fp32: exact
    theirs = {weights.rename(k, "original"): v.bfloat16() for k, v in ref.state_dict().items()}
    assert same(theirs, state)


def test_save_wan_exports_both_layouts_bit_exact(tmp_path):
    model = perturbed(CUSTOM)
    weights.save_wan(model, tmp_path / "orig", "original", max_shard_bytes=20_000)
    assert (tmp_path / "orig" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert same(weights.load_wan(tmp_path / "orig").state_dict(), model.state_dict())
    weights.save_wan(model, tmp_path / "diff", "diffusers", dtype=torch.bfloat16)
    loaded = weights.load_wan(tmp_path / "diff", dtype=torch.bfloat16).state_dict()
    assert same(loaded, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})


def _refusal(tmp_path: Path, edit, config: str | None = None, with_json: bool = True) -> str:
    """Write the micro checkpoint with `edit` applied to its state dict; the one-line error."""
    state = perturbed(MICRO).state_dict()
    edit(state)
    folder = tmp_path / "bad"
    folder.mkdir(parents=True)
    save_file(state, folder / "diffusion_pytorch_model.safetensors")
    if with_json:
        (folder / "config.json").write_text(json.dumps(weights.layout_config(MICRO, "original")))
    with pytest.raises(UserError) as exc:
        weights.load_wan(folder, config)
    return one_line(exc)


def test_refusals_name_the_key_shape_and_kind(tmp_path):
    def drop(s):
        del s["blocks.0.ffn.2.bias"]

    def extra(s):
        s["blocks.0.extra.weight"] = torch.zeros(2)

    def reshape(s):
        s["blocks.0.self_attn.o.bias"] = torch.zeros(31)

    def i2v(s):
        s["blocks.0.cross_attn.k_img.weight"] = torch.zeros(32, 32)

    def lora(s):
        s["blocks.0.self_attn.q.lora_A.default.weight"] = torch.zeros(8, 32)

    cases = [(drop, "missing key 'blocks.0.ffn.2.bias'"),
             (extra, "unexpected key 'blocks.0.extra.weight'"),
             (reshape, "blocks.0.self_attn.o.bias has shape [31]"),
             (i2v, "a Wan 2.1 I2V checkpoint (key 'blocks.0.cross_attn.k_img.weight')"),
             (lora, "unmerged LoRA weights (key 'blocks.0.self_attn.q.lora_A.default.weight')")]
    for i, (edit, says) in enumerate(cases):
        assert says in _refusal(tmp_path / str(i), edit), says


def test_an_index_reaches_no_file_outside_its_folder_and_no_fifo_is_opened(tmp_path):
    """A shared checkpoint's index names its shards: a name that climbs out (`..`), an
    absolute path or a link to elsewhere is refused before anything is opened; so is a FIFO
    given as the weights file (its `open` would block forever)."""
    state = perturbed(MICRO).state_dict()
    folder = write_sharded(state, tmp_path / "ckpt", None)
    (tmp_path / "other").mkdir()
    (folder / "a.safetensors").rename(tmp_path / "other" / "a.safetensors")
    (folder / "link.safetensors").symlink_to(tmp_path / "other" / "a.safetensors")
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    for name in ("../other/a.safetensors", "/etc/passwd", "link.safetensors"):
        edited = {k: name if v == "a.safetensors" else v for k, v in weight_map.items()}
        index.write_text(json.dumps({"weight_map": edited}))
        with pytest.raises(UserError) as exc:
            weights.load_wan(folder)
        assert "outside" in one_line(exc) and "model.safetensors.index.json" in str(exc.value)
    fifo = tmp_path / "wan.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(UserError) as exc:
        weights.load_wan(fifo)
    assert "not a regular file (a FIFO" in one_line(exc)


def test_pickles_legacy_files_and_lora_folders_are_refused_in_one_line(tmp_path):
    state = perturbed(MICRO).state_dict()
    torch.save({**state, "payload": Path("x")}, tmp_path / "pickle.pth")  # a Python object
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    says = {"pickle.pth": "holds Python objects besides tensors, which are never unpickled",
            "legacy.pth": "not a readable torch.save zip file"}
    for name, message in says.items():
        with pytest.raises(UserError) as exc:
            weights.load_wan(tmp_path / name)
        assert message in one_line(exc) and "weights_only=False" not in str(exc.value)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    save_file({"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(8, 32)},
              adapter / "adapter_model.safetensors")
    with pytest.raises(UserError) as exc:
        weights.load_wan(adapter)
    assert "a LoRA adapter folder" in one_line(exc)


def test_convert_removes_what_a_killed_convert_left_and_refuses_a_full_disk(tmp_path, capsys):
    """The temporary folder beside the target of a writer that is gone is removed, and said
    so, by the next write; one of a live writer stays. A disk that refuses the write (here
    a file size limit: EFBIG) is one line naming the target and the fix, nothing left."""
    src = tmp_path / "wan.safetensors"
    save_file(perturbed(MICRO).state_dict(), src)
    host = socket.gethostname()
    gone = tmp_path / f".out.{host}-{_ended_pid()}.tmp"
    live = tmp_path / f".out.{host}-{os.getppid()}.tmp"  # a live process
    for folder in (gone, live):
        folder.mkdir()
        (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"partial")
    weights.convert(src, tmp_path / "out", "diffusers")
    assert not gone.exists() and live.exists()
    assert f"removed {gone}" in capsys.readouterr().err
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, limit[1]))
    try:
        with pytest.raises(UserError) as exc:
            weights.convert(src, tmp_path / "full", "diffusers")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert f"{tmp_path / 'full'}: cannot write it" in one_line(exc) and "free space" in str(
        exc.value)
    assert not (tmp_path / "full").exists() and not list(tmp_path.glob(".full.*"))


def _ended_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_config_inferred_and_checked(tmp_path):
    message = _refusal(tmp_path / "a", lambda s: None, config="wan2.1-tiny")
    assert "does not match config 'wan2.1-tiny': dim is 32 in the checkpoint, 64" in message
    assert "pass --config wan2.1-micro" in message
    # a shape no registered config has, and no config.json to give num_heads
    model = perturbed(CUSTOM)
    save_file(model.state_dict(), tmp_path / "custom.safetensors")
    with pytest.raises(UserError) as exc:
        weights.load_wan(tmp_path / "custom.safetensors")
    assert "num_heads is not in the weights" in one_line(exc)
    # config.json that contradicts the weights
    folder = tmp_path / "c"
    folder.mkdir()
    save_file(perturbed(MICRO).state_dict(), folder / "w.safetensors")
    bad = {**weights.layout_config(MICRO, "original"), "ffn_dim": 99}
    (folder / "config.json").write_text(json.dumps(bad))
    with pytest.raises(UserError) as exc:
        weights.load_wan(folder)
    assert "config.json: ffn_dim 99 but the weights have 64" in one_line(exc)
    (folder / "config.json").write_text(json.dumps({**bad, "ffn_dim": 64, "model_type": "i2v"}))
    with pytest.raises(UserError) as exc:
        weights.load_wan(folder)
    assert "model_type 'i2v'" in one_line(exc)


def test_cli_convert_writes_once_and_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    save_file(perturbed(MICRO).state_dict(), tmp_path / "wan.safetensors")
    args = ("model", "convert", str(tmp_path / "wan.safetensors"), "-o", str(tmp_path / "diff"))
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "diffusers layout, config wan2.1-micro" in out
    config = json.loads((tmp_path / "diff" / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel" and config["num_attention_heads"] == 2
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2
    assert err.strip().count("\n") == 0 and "choose a new output folder" in err
    assert not list(tmp_path.glob(".*.tmp"))  # nothing left beside it
