"""The latent cache: per sample a VAE latent [C, F', H', W'] in a file, and a reference to a
text embedding [L, D] that samples with the same caption share.

A manifest row of cached data names its files and where in them the tensors are:

| column | meaning |
| --- | --- |
| ``latent_path`` | the latent's file (``.safetensors``; ``.pt``/``.pth`` are read with
  ``torch.load(weights_only=True)``) |
| ``latent_key`` | the tensor's key in it (default ``latent``); a dotted key reaches into
  nested dicts of a ``.pt`` file (``prompt_emb.context``) |
| ``latent_start`` | first latent frame of this sample's window (default 0: the whole latent) |
| ``text_path`` | the text embedding's file (default: ``latent_path``, the same file) |
| ``text_key`` | its key (default ``context``) |
| ``split`` | the sample's split (``train``, ``val``...; ``data.val_split`` names the
  held-out one) |

The planner needs only each sample's shape, and the manifest holds it (``num_frames``,
``height``, ``width`` in pixels, from the latent's shape: frames ``4(F'-1)+1``, sides ``8H'``,
``8W'``): an importer reads the shapes from the safetensors headers (or a ``.pt`` file mapped,
not read) once, and no tensor is loaded to plan. A text embedding that is missing, stored
under another key, or in a file that is not there is a UserError naming the file and the keys
it holds; it is never replaced by noise (a model trained on noise as its prompt learns to
ignore the prompt).
"""

from __future__ import annotations

import json
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from adaptiveload.errors import UserError
from adaptiveload.io import regular_file

LATENT_KEY = "latent"  # the keys of this project's own cache files
TEXT_KEY = "context"
TEXT_FILE = "text_file"  # the metadata key of a latent file naming its shared text file

TORCH_SUFFIXES = (".pt", ".pth")
SUFFIXES = (".safetensors", *TORCH_SUFFIXES)
# VAE strides of Wan 2.1 (time, height, width): a latent of F' frames is 4(F'-1)+1 frames
_STRIDE_T, _STRIDE_S = 4, 8


def pixel_shape(latent_frames: int, latent_height: int, latent_width: int) -> tuple[int, int, int]:
    """(frames, height, width) in pixels of a latent [C, F', H', W'] (the manifest's sizes)."""
    return (
        _STRIDE_T * (latent_frames - 1) + 1,
        _STRIDE_S * latent_height,
        _STRIDE_S * latent_width,
    )


def check_suffix(path: Path, what: str) -> None:
    if path.suffix.lower() not in SUFFIXES:
        raise UserError(
            f"{path} ({what}): unknown cache file type {path.suffix!r}; expected "
            f"{', '.join(SUFFIXES)}"
        )


def read_header(path: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Every tensor's shape in a cache file and its string metadata, without reading tensor
    data: a safetensors file's JSON header (its first 8 bytes give the header's length), a
    ``.pt``/``.pth`` file mapped (``mmap=True``: its pages are not read; no metadata).
    Nested dicts get dotted keys."""
    path = Path(path)
    check_suffix(path, "cache file")
    regular_file(path, "cache file")
    if path.suffix.lower() in TORCH_SUFFIXES:
        tensors = _flatten(_torch_load(path, mmap=True))
        return {k: tuple(v.shape) for k, v in tensors.items()}, {}
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:
                raise ValueError(f"header of {size} bytes (not a safetensors file)")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise UserError(f"{path}: cache file not found") from None
    except (OSError, ValueError, struct.error) as exc:
        raise UserError(f"{path}: not a readable safetensors file: {exc}") from None
    shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return shapes, dict(header.get("__metadata__") or {})


def read_tensors(path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a cache file (nested dicts of a ``.pt`` file under dotted keys).

    A safetensors file is read into memory by Python's file read, which releases the GIL
    while the disk works, and then parsed from the bytes: `safetensors.torch.load_file`
    holds the GIL through its reads, so a reader thread reading from disk would stall the
    training loop's thread for as long (tests/bench/bench_reader.py)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    check_suffix(path, what)
    regular_file(path, what)
    if path.suffix.lower() in TORCH_SUFFIXES:
        return _flatten(_torch_load(path, mmap=False))
    try:
        return load(path.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{path} ({what}): file not found") from None
    except (OSError, SafetensorError) as exc:
        raise UserError(f"{path} ({what}): cannot be read: {exc}") from None


def pick(
    tensors: dict[str, torch.Tensor], key: str, path: Path, what: str, fix: str
) -> torch.Tensor:
    """`tensors[key]`, or a UserError naming the file, the key and the keys found."""
    if key not in tensors:
        found = ", ".join(sorted(tensors)) or "none"
        raise UserError(f"{path} ({what}): no tensor {key!r} (found {found}); {fix}")
    tensor = tensors[key]
    if not torch.isfinite(tensor).all():
        raise UserError(
            f"{path} ({what}): tensor {key!r} holds NaN or infinite values; encode the sample again"
        )
    return tensor


@lru_cache(maxsize=256)
def read_text(path: str, key: str, text_len: int, text_dim: int) -> torch.Tensor:
    """A text embedding [L, D] (a leading batch dim of 1 dropped), zero-padded to
    [text_len, text_dim] as Wan pads its context. Cached: samples with one caption share a
    file (read once per process; the returned tensor is never written to)."""
    file = Path(path)
    what = "text embedding"
    tensors = read_tensors(file, what)
    fix = (
        f"set the manifest's text_key to the key holding the [L <= {text_len}, {text_dim}] "
        "embedding, or cache it under 'context'"
    )
    context = pick(tensors, key, file, what, fix)
    if context.ndim == 3 and context.shape[0] == 1:
        context = context[0]
    if context.ndim != 2 or context.shape[0] > text_len or context.shape[1] != text_dim:
        raise UserError(
            f"{file} ({what}): tensor {key!r} has shape {list(context.shape)}; "
            f"expected [L <= {text_len}, {text_dim}]"
        )
    return torch.nn.functional.pad(context.float(), (0, 0, 0, text_len - context.shape[0]))


def read_latent(path: str, key: str, start: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The latent [C, F', H', W'] of `shape` at latent frame `start` of the tensor `key` (a
    leading batch dim of 1 dropped): a window of a longer clip, or the whole clip."""
    file = Path(path)
    what = "latent"
    tensors = read_tensors(file, what)
    latent = pick(
        tensors,
        key,
        file,
        what,
        "set the manifest's latent_key to the key of the [C, F', H', W'] latent",
    )
    if latent.ndim == 5 and latent.shape[0] == 1:
        latent = latent[0]
    window = latent[:, start : start + shape[1]] if latent.ndim == 4 else latent
    if tuple(window.shape) != tuple(shape):
        raise UserError(
            f"{file} (latent): tensor {key!r} of shape {list(latent.shape)} from latent frame "
            f"{start} is not {list(shape)} = [channels, 1+(F-1)/4, H/8, W/8] of its bucket; "
            "re-import the cache (adaptiveload manifest import) with data.bucketing: exact, "
            "or encode it at the bucket shape"
        )
    return window.float()


def save_sample(
    path: str | Path,
    latent: torch.Tensor,
    context: torch.Tensor | None = None,
    text_file: str | None = None,
) -> None:
    """Write one sample in this project's format: ``latent`` [C, F', H', W'] and either its
    own ``context`` [L, D] or, in the metadata, ``text_file``: the shared embedding's file
    (`save_text`), relative to this file's folder."""
    from safetensors.torch import save_file

    if (context is None) == (text_file is None):
        raise ValueError("give the sample's context or the text_file it shares, not both")
    tensors = {LATENT_KEY: latent.contiguous()}
    if context is not None:
        tensors[TEXT_KEY] = context.contiguous()
    save_file(tensors, str(path), metadata={TEXT_FILE: text_file} if text_file else None)


def save_text(path: str | Path, context: torch.Tensor) -> None:
    """Write a text embedding [L, D] that samples of one caption share (key ``context``)."""
    from safetensors.torch import save_file

    save_file({TEXT_KEY: context.contiguous()}, str(path))


def _torch_load(path: Path, mmap: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"{path}: cache file not found") from None
    except Exception as exc:  # unpickling refusals and corrupt archives come in many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{path}: cannot be read with torch.load(weights_only=True): {first}"
        ) from None


def _flatten(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of nested dicts, lists and tuples under dotted keys, a list's item under its
    index (``0.input_latents``): merging the items would let one item's key hide another's
    (DiffSynth-Studio saves its positive and negative prompt's inputs side by side)."""
    if isinstance(obj, torch.Tensor):
        return {prefix.rstrip("."): obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
    return out
