"""LoRA on Wan 2.1 through peft: adapters in, adapter weights out, merged weights out, and the
adapter files of the other tools in either naming.

`add_lora` injects peft's LoRA layers (`peft.inject_adapter_in_model`, no wrapper class, so
the model keeps its forward and its `cfg`) into the Linear layers a `LoraSpec` names and
freezes everything else: the base weights cannot move, and an optimizer built from the
trainable parameters holds the adapters' state only. peft initialises A randomly (from
torch's generator: seed it) and B at zero, so the adapted model starts as the base model.

`lora_state` is what a LoRA run saves (the adapters alone: megabytes, not the 1.3B's 5 GB);
`merge_lora` folds the adapters into the base weights (W + B A * alpha / rank) and removes
them, leaving a plain WanModel that `weights.save_wan` exports.

Adapter files name their tensors three ways; `convert_lora` maps between them, key by key,
tensors untouched (a round trip gives the same bytes back):

- peft, in the model: `blocks.0.self_attn.q.lora_A.default.weight` (`default`: the adapter);
- original / ComfyUI (`diffusion_model.` + Wan's names): `diffusion_model.blocks.0.self_attn.
  q.lora_A.weight`, what ComfyUI and musubi-tuner read and write;
- diffusers (`transformer.` + diffusers' names): `transformer.blocks.0.attn1.to_q.lora_A.
  weight`, what `WanPipeline.load_lora_weights` reads.

The module names map through `weights.rename`, the table the base checkpoints use (one home
for the names). A `.alpha` tensor per module (kohya/ComfyUI files) and the `lora_down` /
`lora_up` spelling are carried over unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from adaptiveload.errors import UserError
from adaptiveload.extras import require
from adaptiveload.model.weights import rename

ADAPTER = "default"  # peft's adapter name in the model's keys
# names of an adapter file's tensors: layout -> the prefix before every module name
LORA_LAYOUTS = {"original": "diffusion_model.", "diffusers": "transformer.", "peft": ""}
# what follows a module's name in an adapter key (peft's in-model names insert the adapter)
LORA_SUFFIXES = (
    ".lora_A.weight",
    ".lora_B.weight",
    ".lora_down.weight",
    ".lora_up.weight",
    ".alpha",
)


@dataclass(frozen=True)
class LoraSpec:
    """An experiment's `train.lora`: adapter rank, alpha (None: the rank, scale 1), the
    Linear layers it adapts (suffixes of their dotted names) and dropout on their input."""

    rank: int
    alpha: float | None
    targets: tuple[str, ...]
    dropout: float

    @property
    def lora_alpha(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha)


def lora_spec(lora: Mapping[str, Any] | None) -> LoraSpec | None:
    """`train.lora` of a validated experiment (its defaults filled in) as a LoraSpec: what
    training adapts and what calibration times (`adaptiveload calibrate` measures the LoRA
    step of an experiment that trains one)."""
    if lora is None:
        return None
    return LoraSpec(
        rank=lora["rank"],
        alpha=lora["alpha"],
        targets=tuple(lora["targets"]),
        dropout=lora["dropout"],
    )


def spec_record(spec: LoraSpec | None) -> dict[str, Any] | None:
    """A LoraSpec as JSON (a calibration's `setup.lora`: the step it timed), None for none."""
    return None if spec is None else {**asdict(spec), "targets": list(spec.targets)}


def is_lora_key(name: str) -> bool:
    """Whether a parameter or state-dict key is an adapter weight (peft's in-model names)."""
    return ".lora_A." in name or ".lora_B." in name


def _targeted(model: nn.Module, target: str) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and (n == target or n.endswith("." + target))
    ]


def add_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """`model` with peft LoRA layers on the Linear layers `spec.targets` names, every other
    parameter frozen (requires_grad False). A target that names no Linear layer is refused:
    peft would otherwise adapt fewer layers than asked, silently."""
    peft = require("peft")
    for target in spec.targets:
        if not _targeted(model, target):
            linears = sorted(
                {
                    n.split(".", 2)[-1] if n.startswith("blocks.") else n
                    for n, m in model.named_modules()
                    if isinstance(m, nn.Linear)
                }
            )
            raise UserError(
                f"train.lora.targets: {target!r} names no Linear layer of "
                f"{type(model).__name__}; use names such as {', '.join(linears)}"
            )
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.targets),
        lora_dropout=spec.dropout,
    )
    model = peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_key(name))
    return model


def lora_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter weights of a model's state dict (peft's in-model names)."""
    return {k: v for k, v in state.items() if is_lora_key(k)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA layer into its base Linear and put the base Linear back in its place:
    the result has the base model's keys (what `save_wan` writes)."""
    require("peft")
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    return model


def convert_lora(state: Mapping[str, torch.Tensor], to: str) -> dict[str, torch.Tensor]:
    """Adapter weights under any of the three namings (module docstring), one naming per
    file, -> under `to`'s ("original", "diffusers" or "peft"); the tensors themselves are
    the same objects. A key of no known form is refused, naming it."""
    if to not in LORA_LAYOUTS:
        raise UserError(f"LoRA layout {to!r}: expected one of {', '.join(LORA_LAYOUTS)}")
    out = {}
    for key, value in state.items():
        source, module, suffix = _split(key)
        module = _module_name(key, module, _naming(source), _naming(to))
        if to == "peft" and suffix != ".alpha":
            suffix = suffix.replace(".weight", f".{ADAPTER}.weight")
        out[LORA_LAYOUTS[to] + module + suffix] = value
    return out


def _split(key: str) -> tuple[str, str, str]:
    """(naming, module name without prefix, suffix) of an adapter key."""
    bare = key.replace(f".{ADAPTER}.weight", ".weight")
    suffix = next((s for s in LORA_SUFFIXES if bare.endswith(s)), None)
    if suffix is None:
        raise UserError(
            f"LoRA key {key!r}: expected <module>{{.lora_A.weight, .lora_B.weight, "
            ".lora_down.weight, .lora_up.weight, .alpha}}"
        )
    module = bare[: -len(suffix)]
    for layout in ("original", "diffusers"):
        if module.startswith(LORA_LAYOUTS[layout]):
            return layout, module[len(LORA_LAYOUTS[layout]) :], suffix
    if bare != key:  # peft's in-model names carry the adapter name
        return "peft", module, suffix
    raise UserError(
        f"LoRA key {key!r}: no prefix of a known naming (diffusion_model. for "
        "original/ComfyUI, transformer. for diffusers)"
    )


def _naming(layout: str) -> str:
    """The module naming of a LoRA layout: peft's in-model names are WanModel's (original)."""
    return "original" if layout == "peft" else layout


def _module_name(key: str, module: str, source: str, to: str) -> str:
    """`module` (named as in `source`) as `to` names it; every name goes through the table,
    also when the naming stays, so a module of neither model is refused here."""
    original = module + "." if source == "original" else rename(module + ".", "original")
    diffusers = None if original is None else rename(original, "diffusers")
    if diffusers is None:
        raise UserError(
            f"LoRA key {key!r}: module {module!r} is not a layer of a Wan 2.1 T2V "
            f"model in {source} names"
        )
    return (original if to == "original" else diffusers)[:-1]
