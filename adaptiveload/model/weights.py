"""Wan 2.1 T2V weights from the files users have: read, check, load into `WanModel`, convert.

Two layouts, both as local files (nothing is downloaded):

- **original** (Wan-Video/Wan2.1, the `Wan-AI/Wan2.1-T2V-*` folders): the parameter names of
  `wan/modules/model.py`, which are `WanModel`'s own; a folder with `config.json`
  (`model_type`, `dim`, `num_heads`, ...) and `diffusion_pytorch_model.safetensors`, or shards
  named in a `*.safetensors.index.json`; or one `.safetensors` / `.pth` / `.pt` file.
- **diffusers** (`Wan-AI/Wan2.1-T2V-*-Diffusers`): a `transformer/` folder (or the pipeline
  folder that holds it) with `WanTransformer3DModel`'s `config.json` and the same file naming.
  Its names map 1:1 onto the original ones (`DIFFUSERS_NAMES`; one trap: diffusers' `norm2`
  is the affine cross-attention norm, Wan's `norm3`; the modulated norms carry no weights).

The shape comes from the weights (`dim`, `ffn_dim`, layers, patch, text and frequency widths),
`num_heads`, `eps` and `text_len` from `config.json` or from a named config
(`architectures.CONFIGS`), and each is checked against the other. Every key and shape is
checked against `WanModel` before a tensor is read; what cannot load correctly is refused in
one line (`UserError`): a missing or unexpected key, a shape that does not match, an I2V,
FLF2V or VACE checkpoint (this model is T2V only).
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import re
import shutil
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from adaptiveload.errors import UserError, notice
from adaptiveload.io import read_json, regular_file, write_failure
from adaptiveload.model.architectures import CONFIGS, WanConfig, get_config
from adaptiveload.model.wan import WanModel, build_on_meta

LAYOUTS = ("original", "diffusers")
WEIGHTS_NAME = "diffusion_pytorch_model"  # both layouts' file stem on the Hub
TORCH_SUFFIXES = (".pth", ".pt", ".bin")

# diffusers name prefix -> original (WanModel) name prefix; "{n}" is a block's index
DIFFUSERS_NAMES: tuple[tuple[str, str], ...] = (
    ("patch_embedding.", "patch_embedding."),
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("blocks.{n}.attn1.to_q.", "blocks.{n}.self_attn.q."),
    ("blocks.{n}.attn1.to_k.", "blocks.{n}.self_attn.k."),
    ("blocks.{n}.attn1.to_v.", "blocks.{n}.self_attn.v."),
    ("blocks.{n}.attn1.to_out.0.", "blocks.{n}.self_attn.o."),
    ("blocks.{n}.attn1.norm_q.", "blocks.{n}.self_attn.norm_q."),
    ("blocks.{n}.attn1.norm_k.", "blocks.{n}.self_attn.norm_k."),
    ("blocks.{n}.attn2.to_q.", "blocks.{n}.cross_attn.q."),
    ("blocks.{n}.attn2.to_k.", "blocks.{n}.cross_attn.k."),
    ("blocks.{n}.attn2.to_v.", "blocks.{n}.cross_attn.v."),
    ("blocks.{n}.attn2.to_out.0.", "blocks.{n}.cross_attn.o."),
    ("blocks.{n}.attn2.norm_q.", "blocks.{n}.cross_attn.norm_q."),
    ("blocks.{n}.attn2.norm_k.", "blocks.{n}.cross_attn.norm_k."),
    ("blocks.{n}.norm2.", "blocks.{n}.norm3."),
    ("blocks.{n}.ffn.net.0.proj.", "blocks.{n}.ffn.0."),
    ("blocks.{n}.ffn.net.2.", "blocks.{n}.ffn.2."),
    ("blocks.{n}.scale_shift_table", "blocks.{n}.modulation"),
    ("proj_out.", "head.head."),
    ("scale_shift_table", "head.modulation"),
)
_BLOCK = re.compile(r"^blocks\.(\d+)\.")

# a key fragment -> the checkpoint kind it marks (none of them loads into the T2V model)
NOT_T2V = (
    ("img_emb.emb_pos", "FLF2V"),
    ("image_embedder.pos_embed", "FLF2V"),
    ("img_emb.", "I2V"),
    ("image_embedder.", "I2V"),
    ("k_img.", "I2V"),
    ("add_k_proj.", "I2V"),
    ("vace_", "VACE"),
)
# prefixes that wrappers put before every key (ComfyUI, DDP); stripped with a note
WRAPPER_PREFIXES = ("model.diffusion_model.", "module.")


def rename(key: str, to: str) -> str | None:
    """`key` in the `to` layout ("original" or "diffusers") from the other one; None if the
    key has no counterpart."""
    src, dst = (0, 1) if to == "original" else (1, 0)
    match = _BLOCK.match(key)
    generic = key if match is None else "blocks.{n}." + key[match.end():]
    for pair in DIFFUSERS_NAMES:
        if generic.startswith(pair[src]) and ("{n}" in pair[src]) == (match is not None):
            new = pair[dst] + generic[len(pair[src]):]
            return new.replace("{n}", match.group(1)) if match else new
    return None


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint's tensors are: its layout, its files in order and its config.json."""

    path: Path
    layout: str
    files: tuple[Path, ...]
    config_json: Mapping[str, Any] | None
    prefix: str = ""  # a wrapper's prefix before every key (stripped on reading)

    def tensors(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each file's tensors under their original (WanModel) names, file by file."""
        for file in self.files:
            raw = _read_file(file)
            yield {self.original_name(k): v for k, v in raw.items()}

    def original_name(self, key: str) -> str:
        key = key[len(self.prefix):]
        if self.layout == "original":
            return key
        new = rename(key, "original")
        if new is None:
            raise UserError(f"{self.path}: unexpected key {key!r} in a diffusers Wan 2.1 T2V "
                            "checkpoint; this model loads T2V weights only (docs/models.md)")
        return new


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at `path` (a weights file, an index, a transformer folder or a diffusers
    pipeline folder), its layout read from its keys; UserError if it is none of them."""
    path = regular_file(path, "checkpoint")
    if not path.exists():
        raise UserError(f"{path}: checkpoint not found; give a weights file or its folder")
    if path.is_dir() and (path / "transformer").is_dir():
        path = path / "transformer"
    if path.is_dir() and (path / "adapter_config.json").exists():
        raise UserError(f"{path}: a LoRA adapter folder (adapter_config.json), not a model; "
                        "merge it into its base model first (peft: model.merge_and_unload(), "
                        "docs/models.md)")
    files = tuple(regular_file(file, "weights file") for file in _weight_files(path))
    if path.name.endswith(".index.json"):  # the checkpoint is its folder: config.json too
        path = path.parent
    config_json = read_json(path / "config.json", "config.json") if path.is_dir() and (
        path / "config.json").exists() else None
    keys = [k for file in files for k in _shapes(file)]
    prefix = next((p for p in WRAPPER_PREFIXES if keys and all(k.startswith(p) for k in keys)), "")
    if prefix:
        notice(f"{path}: every key starts with {prefix!r}; read without it")
    keys = [k[len(prefix):] for k in keys]
    _refuse_other_kinds(path, keys, config_json)
    if any(k.startswith("condition_embedder.") for k in keys):
        layout = "diffusers"
    elif any(k.startswith(("time_embedding.", "blocks.", "head.")) for k in keys):
        layout = "original"
    else:
        raise UserError(f"{path}: no Wan 2.1 keys (first: {keys[:1]}); "
                        "expected a Wan 2.1 T2V DiT checkpoint, original or diffusers layout")
    return Checkpoint(path, layout, files, config_json, prefix)


def _weight_files(path: Path) -> tuple[Path, ...]:
    """The files holding the weights: one file, or every shard an index names, in order."""
    if path.is_file():
        return _index_shards(path) if path.name.endswith(".index.json") else (path,)
    indexes = sorted(path.glob("*.index.json"))
    if len(indexes) == 1:
        return _index_shards(indexes[0])
    if len(indexes) > 1:
        raise UserError(f"{path}: several index files ({', '.join(p.name for p in indexes)}); "
                        "give the one to load")
    for pattern in ("*.safetensors", *(f"*{s}" for s in TORCH_SUFFIXES)):
        found = sorted(path.glob(pattern))
        if len(found) == 1:
            return (found[0],)
        if found:
            raise UserError(f"{path}: {len(found)} {pattern} files and no *.index.json naming "
                            "the shards; give the one file to load")
    raise UserError(f"{path}: no weights (*.safetensors, *.pth, *.pt) in this folder")


def _index_shards(index: Path) -> tuple[Path, ...]:
    weight_map = read_json(index, "checkpoint index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: field weight_map missing or empty; expected key -> shard file")
    shards = tuple(index.parent / str(name) for name in dict.fromkeys(weight_map.values()))
    for shard in shards:
        regular_file(shard, f"shard named in {index.name}", root=index.parent)
        if not shard.is_file():
            raise UserError(f"{index}: shard {shard.name} named in weight_map is missing")
    return shards


# key fragments of unmerged LoRA layers (peft's and diffusers' names)
LORA_MARKS = ("lora_A", "lora_B", "lora_down", "lora_up", ".base_layer.")


def refuse_lora(where: str, keys: list[str]) -> None:
    """UserError naming LoRA if `keys` hold unmerged LoRA layers: they have no place in a
    Wan checkpoint until merged (otherwise reported as some unexpected key)."""
    key = next((k for k in keys if any(mark in k for mark in LORA_MARKS)), None)
    if key is not None:
        raise UserError(f"{where}: unmerged LoRA weights (key {key!r}); merge them into the "
                        "model first (peft: model.merge_and_unload(), docs/models.md)")


def _refuse_other_kinds(path: Path, keys: list[str], config_json: Mapping | None) -> None:
    refuse_lora(str(path), keys)
    kind = (config_json or {}).get("model_type", "t2v")
    if str(kind).lower() != "t2v":
        raise UserError(f"{path}/config.json: model_type {kind!r}; this model loads Wan 2.1 T2V "
                        "checkpoints only (I2V, FLF2V and VACE: not yet, docs/models.md)")
    for fragment, name in NOT_T2V:
        key = next((k for k in keys if fragment in k), None)
        if key is not None:
            raise UserError(f"{path}: a Wan 2.1 {name} checkpoint (key {key!r}); this model "
                            "loads T2V checkpoints only (docs/models.md)")


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        # torch's message advises weights_only=False, which would run the file's code
        raise UserError(f"{file}: holds Python objects besides tensors, which are never "
                        "unpickled (that could run code); save model.state_dict() with "
                        "torch.save, or as .safetensors") from None
    except (RuntimeError, EOFError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{file}: not a readable torch.save zip file ({reason}); save it "
                        "again with a current torch.save, or as .safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{file}: expected a flat dict of tensors (a state dict), got "
                        f"{type(state).__name__}; save model.state_dict()")
    return state


def _shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of one file, without reading its tensors (safetensors) or by mmap."""
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(file, "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{file}: not a readable safetensors file ({exc})") from None
    return {k: tuple(v.shape) for k, v in _read_file(file).items()}


def shapes(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape under its original (WanModel) name."""
    out: dict[str, tuple[int, ...]] = {}
    for file in ckpt.files:
        for key, shape in _shapes(file).items():
            out[ckpt.original_name(key)] = shape
    return out


# config.json field of each layout -> WanConfig field (the original names are WanConfig's own)
DIFFUSERS_CONFIG = {
    "num_attention_heads": "num_heads",
    "in_channels": "in_dim",
    "out_channels": "out_dim",
    "text_dim": "text_dim",
    "freq_dim": "freq_dim",
    "ffn_dim": "ffn_dim",
    "num_layers": "num_layers",
    "cross_attn_norm": "cross_attn_norm",
    "eps": "eps",
    "patch_size": "patch_size",
}
QK_NORM = "rms_norm_across_heads"  # diffusers' name for Wan's q/k RMSNorm across all heads
ROPE_MAX_SEQ_LEN = 1024  # diffusers' default: RoPE table rows per axis (patches)
# config.json fields of diffusers' without a WanConfig counterpart: a conversion keeps the
# source's value (in an original-layout config.json too, whose reader ignores it), so a
# round trip through either layout gives them back
DIFFUSERS_ONLY = ("rope_max_seq_len",)


def from_weights(ckpt: Checkpoint, s: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The WanConfig fields the tensors' shapes state."""
    for key in ("patch_embedding.weight", "blocks.0.ffn.0.weight", "text_embedding.0.weight",
                "time_embedding.0.weight", "head.head.weight"):
        if key not in s:
            raise UserError(f"{ckpt.path}: missing key {key!r}; not a complete Wan 2.1 T2V DiT")
    dim, in_dim, *patch = s["patch_embedding.weight"]
    volume = patch[0] * patch[1] * patch[2]
    return {
        "dim": dim,
        "in_dim": in_dim,
        "patch_size": tuple(patch),
        "ffn_dim": s["blocks.0.ffn.0.weight"][0],
        "num_layers": len({m.group(1) for k in s if (m := _BLOCK.match(k))}),
        "text_dim": s["text_embedding.0.weight"][1],
        "freq_dim": s["time_embedding.0.weight"][1],
        "out_dim": s["head.head.weight"][0] // volume,
        "qk_norm": "blocks.0.self_attn.norm_q.weight" in s,
        "cross_attn_norm": "blocks.0.norm3.weight" in s,
    }


def from_config_json(ckpt: Checkpoint) -> dict[str, Any]:
    """The WanConfig fields the checkpoint's config.json states (none without one)."""
    raw = dict(ckpt.config_json or {})
    if ckpt.layout == "original":
        names = {f.name for f in fields(WanConfig)} - {"name"}
        stated = {k: v for k, v in raw.items() if k in names}
    else:
        stated = {ours: raw[theirs] for theirs, ours in DIFFUSERS_CONFIG.items() if theirs in raw}
        if "qk_norm" in raw:
            stated["qk_norm"] = raw["qk_norm"] == QK_NORM
        if "attention_head_dim" in raw and "num_attention_heads" in raw:
            stated["dim"] = raw["attention_head_dim"] * raw["num_attention_heads"]
        for field in ("image_dim", "added_kv_proj_dim"):
            if raw.get(field) is not None:
                raise UserError(f"{ckpt.path}/config.json: {field} {raw[field]} marks an I2V "
                                "checkpoint; this model loads T2V checkpoints only "
                                "(docs/models.md)")
    if "patch_size" in stated:
        stated["patch_size"] = tuple(stated["patch_size"])
    return stated


def resolve_config(
    ckpt: Checkpoint, s: Mapping[str, tuple[int, ...]], name: str | None = None
) -> WanConfig:
    """The checkpoint's WanConfig: its shape from the weights, checked against its config.json
    and against the named config `name`; without a name, the registered config of that shape,
    else one built from the weights and config.json (which must then give num_heads)."""
    weights = from_weights(ckpt, s)
    stated = from_config_json(ckpt)
    for field in weights.keys() & stated.keys():
        if weights[field] != stated[field]:
            raise UserError(f"{ckpt.path}/config.json: {field} {stated[field]} but the weights "
                            f"have {weights[field]}; the config belongs to another model")
    facts = {**stated, **weights}
    matching = [c for c in CONFIGS.values() if _differences(c, facts) == []]
    if name is not None:
        cfg = get_config(name)
        diff = _differences(cfg, facts)
        if diff:
            hint = f"pass --config {matching[0].name}" if matching else "drop --config"
            raise UserError(f"{ckpt.path}: does not match config '{name}': {diff[0]}; {hint}")
        return cfg
    if matching:
        return matching[0]
    if "num_heads" not in facts:
        raise UserError(f"{ckpt.path}: num_heads is not in the weights and no config.json "
                        f"states it; pass --config (one of: {', '.join(CONFIGS)})")
    try:
        return WanConfig(name=ckpt.path.stem, **facts)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{ckpt.path}: not a valid Wan 2.1 config ({exc})") from None


def _differences(cfg: WanConfig, facts: Mapping[str, Any]) -> list[str]:
    return [f"{k} is {v} in the checkpoint, {getattr(cfg, k)} in the config"
            for k, v in facts.items() if getattr(cfg, k) != v]


def check_keys(ckpt: Checkpoint, s: Mapping[str, tuple[int, ...]], cfg: WanConfig) -> None:
    """Every WanModel key present with its shape, and nothing else; else one UserError line."""
    _check_names(str(ckpt.path), s, cfg)


def _check_names(where: str, s: Mapping[str, tuple[int, ...]], cfg: WanConfig) -> None:
    want = {k: tuple(v.shape) for k, v in build_on_meta(cfg).state_dict().items()}
    for what, keys in (("missing", want.keys() - s.keys()), ("unexpected", s.keys() - want.keys())):
        if keys:
            first, more = sorted(keys)[0], f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise UserError(f"{where}: {what} key {first!r}{more} for config {cfg.name}; "
                            "a shard missing, or the weights of another model")
    for key, shape in want.items():
        if s[key] != shape:
            raise UserError(f"{where}: {key} has shape {list(s[key])}, config {cfg.name} "
                            f"expects {list(shape)}")


def inspect(
    path: str | os.PathLike[str], config: str | None = None
) -> tuple[Checkpoint, WanConfig]:
    """The checkpoint at `path` and its config, every key and shape checked: nothing is read
    but the headers (safetensors)."""
    ckpt = open_checkpoint(path)
    s = shapes(ckpt)
    cfg = resolve_config(ckpt, s, config)
    check_keys(ckpt, s, cfg)
    return ckpt, cfg


def load_wan(
    path: str | os.PathLike[str],
    config: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    ln_modulate_impl: str = "eager",
    activation_checkpointing: bool = False,
) -> WanModel:
    """A WanModel with the weights at `path` (either layout), in `dtype` (fp32: Wan's training
    dtype; bf16 weights convert exactly). Built on the meta device, filled file by file."""
    ckpt, cfg = inspect(path, config)
    with torch.device("meta"):
        model = WanModel(cfg, ln_modulate_impl, activation_checkpointing)
    for part in ckpt.tensors():
        part = {k: v.to(dtype, copy=True) for k, v in part.items()}
        model.load_state_dict(part, strict=False, assign=True)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"not loaded: {left[:3]}"  # check_keys saw every key
    return model


def layout_config(cfg: WanConfig, layout: str) -> dict[str, Any]:
    """The config.json of `cfg` in `layout`: Wan's own fields, or WanTransformer3DModel's."""
    if layout == "original":
        out = {"_class_name": "WanModel", "model_type": "t2v", **cfg.to_dict()}
        del out["name"]
        return out
    if not cfg.qk_norm:
        raise UserError(f"config {cfg.name}: qk_norm False has no diffusers form "
                        "(WanTransformer3DModel always norms q and k)")
    out = {"_class_name": "WanTransformer3DModel", "attention_head_dim": cfg.head_dim}
    out.update({theirs: getattr(cfg, ours) for theirs, ours in DIFFUSERS_CONFIG.items()})
    out["patch_size"] = list(cfg.patch_size)
    out.update(qk_norm=QK_NORM, image_dim=None, added_kv_proj_dim=None,
               rope_max_seq_len=ROPE_MAX_SEQ_LEN)
    return out


def convert(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], to: str, config: str | None = None
) -> WanConfig:
    """Write the checkpoint at `src` to the new folder `dst` in layout `to`, file by file,
    each tensor as stored (dtype and bytes kept), its shards kept; returns its config."""
    if to not in LAYOUTS:
        raise UserError(f"--to {to!r}: expected one of {', '.join(LAYOUTS)}")
    ckpt, cfg = inspect(src, config)
    parts = (stored_names(part, to) for part in ckpt.tensors())
    source = ckpt.config_json or {}
    kept = {k: source[k] for k in DIFFUSERS_ONLY if k in source}
    write_checkpoint(dst, parts, len(ckpt.files), {**layout_config(cfg, to), **kept})
    return cfg


def save_wan(
    model: WanModel,
    dst: str | os.PathLike[str],
    layout: str = "diffusers",
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Export `model` to the new folder `dst` in `layout` (diffusers: a `transformer/` folder
    `WanTransformer3DModel.from_pretrained` reads), in `dtype` (default: as it is), sharded
    at `max_shard_bytes`. A model with LoRA layers is refused: merge them first."""
    if layout not in LAYOUTS:
        raise UserError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    state = {k: v.detach().to("cpu", dtype or v.dtype) for k, v in model.state_dict().items()}
    refuse_lora(f"{type(model).__name__} state dict", list(state))
    _check_names(f"{type(model).__name__} state dict", {k: tuple(v.shape) for k, v in
                 state.items()}, model.cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += nbytes
    parts = (stored_names(part, layout) for part in shards)
    return write_checkpoint(dst, parts, len(shards), layout_config(model.cfg, layout))


def stored_names(part: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Tensors under original names -> under `layout`'s names."""
    if layout == "original":
        return dict(part)
    return {rename(k, "diffusers"): v for k, v in part.items()}


def write_checkpoint(
    dst: str | os.PathLike[str],
    parts: Iterator[dict[str, torch.Tensor]],
    num_parts: int,
    config_json: Mapping[str, Any],
) -> Path:
    """`num_parts` safetensors files (the Hub's `diffusion_pytorch_model[-0000i-of-0000n]`
    names, an index when several) and config.json, into the new folder `dst`, whole or not
    at all: written into a temporary folder beside it (`.<dst>.<host>-<pid>.tmp`, on the
    same disk), renamed into place at the end. What a killed writer left there is removed,
    and reported, by the next write of `dst` once that writer's process is gone."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"{dst}: exists and is not an empty folder; choose a new output folder")
    if dst.is_dir() and os.path.ismount(dst):  # its temporary beside it is on another disk
        raise UserError(f"{dst}: a mount point; write into a new folder inside it "
                        f"({dst / 'checkpoint'})")
    dst.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale_writes(dst):
        shutil.rmtree(stale, ignore_errors=True)
        notice(f"removed {stale}: the unfinished output of a killed write of {dst.name}")
    tmp = dst.parent / f".{dst.name}.{socket.gethostname()}-{os.getpid()}.tmp"
    tmp.mkdir()
    try:
        weight_map, total = {}, 0
        for i, part in enumerate(parts):
            name = (f"{WEIGHTS_NAME}.safetensors" if num_parts == 1
                    else f"{WEIGHTS_NAME}-{i + 1:05d}-of-{num_parts:05d}.safetensors")
            save_file({k: v.contiguous() for k, v in part.items()}, tmp / name,
                      metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
            total += sum(v.numel() * v.element_size() for v in part.values())
        if num_parts > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / f"{WEIGHTS_NAME}.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(dict(config_json), indent=2) + "\n")
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except (OSError, SafetensorError) as exc:
        message = write_failure(dst, _as_os_error(exc))
        if message is None:
            raise
        raise UserError(message) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _as_os_error(exc: Exception) -> OSError:
    """`exc` as an OSError with its errno: safetensors reports a disk's refusal as text only
    ("I/O error: File too large (os error 27)")."""
    if isinstance(exc, OSError):
        return exc
    found = re.search(r"os error (\d+)", str(exc))
    return OSError(int(found.group(1)) if found else 0, str(exc))


def _stale_writes(dst: Path) -> list[Path]:
    """The temporary folders of writes of `dst` whose process (on this host) is gone."""
    host = socket.gethostname()
    stale = []
    for tmp in dst.parent.glob(f".{glob.escape(dst.name)}.*.tmp"):
        owner = tmp.name[len(dst.name) + 2 : -len(".tmp")]
        name, _, pid = owner.rpartition("-")
        if name == host and pid.isdigit() and not _alive(int(pid)):
            stale.append(tmp)
    return sorted(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True

