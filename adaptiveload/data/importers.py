"""Manifests from latent caches on disk: this project's, musubi-tuner's, DiffSynth-Studio's.

An importer reads only file names and headers (safetensors headers; ``.pt``/``.pth`` files
mapped, not read) and writes one manifest row per sample with the latent cache's columns
(`data.latents`): the files stay where the tool wrote them, in its key names.

Layouts (as each tool documents and writes them):

- ``adaptiveload``: ``*.safetensors`` with ``latent`` [C, F', H', W'] and either ``context``
  or the metadata entry ``text_file`` naming a shared embedding file (key ``context``).
- ``musubi`` (musubi-tuner, Wan): latents
  ``<item>_[<start>-<frames>[-<section>]_]<W>x<H>_<arch>.safetensors``
  with the key ``latents_<F>x<H>x<W>_<dtype>``; the text encoder output, shared by every latent
  of the item, in ``<item>_<arch>_te.safetensors`` under ``varlen_t5_<dtype>``.
- ``diffsynth`` (DiffSynth-Studio, Wan): ``torch.save`` files. Its first Wan trainer's
  ``<video>.tensors.pth``: a dict with ``latents`` and ``prompt_emb`` → ``context``. Its
  newer trainer's ``--task sft:data_process`` output ``<rank>/<n>.pth``: the pipeline's
  inputs, a tuple (shared, positive prompt, negative prompt) with ``input_latents`` in the
  first and ``context`` in the second (``0.input_latents``, ``1.context``), or the same keys
  in one dict. There ``latents`` is the noise training starts from, not the clip: the
  clip's ``input_latents`` is taken wherever it exists. A leading batch dimension of 1 is
  dropped.

Options: several frame windows per clip (`windows` windows of `window_frames` latent frames,
evenly spaced over the clip; all of a clip's windows share its text), and a held-out split
(`val_fraction` of the clips, chosen by a hash of the clip's id and `seed`, all windows of a
clip in the same split, so no held-out window overlaps a trained one).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload.data.dataset import sample_seed
from adaptiveload.data.latents import (
    LATENT_KEY,
    TEXT_FILE,
    TEXT_KEY,
    TORCH_SUFFIXES,
    pixel_shape,
    read_header,
)
from adaptiveload.data.manifest import validate_manifest
from adaptiveload.errors import UserError

LAYOUTS = ("adaptiveload", "musubi", "diffsynth")
TRAIN_SPLIT, VAL_SPLIT = "train", "val"
# musubi-tuner's names: latent and text-encoder cache files, and their tensor keys
_MUSUBI_LATENT = re.compile(
    r"^(?P<item>.+?)(?:_(?P<start>\d{5})-(?P<frames>\d{3})(?:-(?P<section>\d+))?)?"
    r"_(?P<w>\d{4})x(?P<h>\d{4})"
    r"_(?P<arch>[A-Za-z0-9.]+)$"
)
_MUSUBI_LATENT_KEY = re.compile(r"^latents_\d+x\d+x\d+_[A-Za-z0-9]+$")
_MUSUBI_TEXT_KEY = re.compile(r"^varlen_t5_[A-Za-z0-9]+$")
# DiffSynth-Studio's keys, older and newer trainers
# (in order: where a file has input_latents, its latents are the noise, not the clip)
_DIFFSYNTH_LATENT_KEYS = ("input_latents", "0.input_latents", "latents")
_DIFFSYNTH_TEXT_KEYS = ("prompt_emb.context", "context", "1.context")


class CacheWarning(UserWarning):
    """A cache was imported, but part of it is unusual (clips shorter than a window)."""


@dataclass
class Clip:
    """One cached clip: its id, files, keys and latent shape [C, F', H', W']."""

    clip_id: str
    latent_path: Path
    latent_key: str
    shape: tuple[int, ...]
    text_path: Path
    text_key: str


@dataclass
class Imported:
    manifest: pd.DataFrame  # paths absolute; the CLI writes them relative to the manifest
    clips: int
    short_clips: list[str] = field(default_factory=list)  # shorter than one window


def import_cache(
    directory: str | Path,
    layout: str,
    windows: int = 1,
    window_frames: int | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
) -> Imported:
    """A validated manifest of every sample cached under `directory` in `layout`."""
    root = Path(directory)
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if not root.is_dir():
        raise UserError(f"{root}: not a directory; expected a folder of cached latents")
    if windows < 1 or (window_frames is not None and window_frames < 1):
        raise UserError(f"--windows {windows} --window-frames {window_frames}: expected >= 1")
    if windows > 1 and window_frames is None:
        raise UserError(f"--windows {windows} needs --window-frames (latent frames a window)")
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction}: expected 0 <= fraction < 1")
    clips = {"adaptiveload": _own, "musubi": _musubi, "diffsynth": _diffsynth}[layout](root)
    if not clips:
        raise UserError(
            f"{root}: no {layout} latent cache files found; expected {_EXPECTED[layout]}"
        )
    val = _held_out([c.clip_id for c in clips], val_fraction, seed)
    rows, short = [], []
    for clip in clips:
        _check_shape(clip)
        frames = clip.shape[1]
        size = frames if window_frames is None else min(window_frames, frames)
        if window_frames is not None and frames < window_frames:
            short.append(clip.clip_id)
        starts = sorted(set(np.rint(np.linspace(0, frames - size, windows)).astype(int).tolist()))
        for start in starts:
            f, h, w = pixel_shape(size, clip.shape[2], clip.shape[3])
            sid = clip.clip_id if len(starts) == 1 and start == 0 else f"{clip.clip_id}#{start}"
            rows.append(
                {
                    "sample_id": sid,
                    "num_frames": f,
                    "height": h,
                    "width": w,
                    "latent_path": str(clip.latent_path),
                    "latent_key": clip.latent_key,
                    "latent_start": start,
                    "text_path": str(clip.text_path),
                    "text_key": clip.text_key,
                    "split": VAL_SPLIT if clip.clip_id in val else TRAIN_SPLIT,
                }
            )
    if short:
        warnings.warn(
            f"{root}: {len(short)} clip(s) shorter than a window of {window_frames} latent "
            f"frames (first: {short[0]}) are imported whole, as one sample each",
            CacheWarning,
            stacklevel=2,
        )
    manifest = validate_manifest(pd.DataFrame(rows), origin=str(root), frame=True)
    return Imported(manifest=manifest, clips=len(clips), short_clips=short)


_EXPECTED = {
    "adaptiveload": "*.safetensors files with a 'latent' tensor",
    "musubi": "<item>_<W>x<H>_<arch>.safetensors and <item>_<arch>_te.safetensors files",
    "diffsynth": "*.tensors.pth or <n>.pth files",
}


def _check_shape(clip: Clip) -> None:
    """A latent the model can take: 4 dims, even sides (Wan patches 2x2 latent pixels)."""
    shape = clip.shape
    if len(shape) != 4 or shape[2] % 2 or shape[3] % 2:
        raise UserError(
            f"{clip.latent_path}: tensor {clip.latent_key!r} has shape {list(shape)}; expected "
            "[C, F', H', W'] with even H' and W' (Wan's 2x2 patches): encode at a size that is "
            "a multiple of 16 pixels"
        )


def _drop_batch(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[1:] if len(shape) == 5 and shape[0] == 1 else shape


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file())


def _own(root: Path) -> list[Clip]:
    clips = []
    for path in _files(root, "*.safetensors"):
        shapes, meta = read_header(path)
        if LATENT_KEY not in shapes:
            continue  # a shared text file, or another file
        if TEXT_FILE in meta:
            text = (path.parent / meta[TEXT_FILE]).resolve()
            if not text.is_file():
                raise UserError(
                    f"{path}: its text_file {meta[TEXT_FILE]!r} ({text}) is not "
                    "there; write the shared embedding or fix the reference"
                )
            text_shapes, _ = read_header(text)
            _need(text, text_shapes, TEXT_KEY, "the shared text embedding under 'context'")
        else:
            text = path
            _need(path, shapes, TEXT_KEY, "'context' or a text_file reference in its metadata")
        clip_id = path.relative_to(root).with_suffix("").as_posix()
        clips.append(Clip(clip_id, path, LATENT_KEY, shapes[LATENT_KEY], text, TEXT_KEY))
    return clips


def _musubi(root: Path) -> list[Clip]:
    clips, unnamed = [], []
    for path in _files(root, "*.safetensors"):
        if path.stem.endswith("_te"):
            continue
        match = _MUSUBI_LATENT.match(path.stem)
        if match is None:
            if set(read_header(path)[0]) != {TEXT_KEY}:  # not an embedding (empty_text)
                unnamed.append(path.name)
            continue
        shapes, _ = read_header(path)
        keys = [k for k in shapes if _MUSUBI_LATENT_KEY.match(k)]
        if len(keys) != 1:
            raise UserError(
                f"{path}: expected one latents_<F>x<H>x<W>_<dtype> tensor "
                f"(found {', '.join(sorted(shapes)) or 'none'})"
            )
        text = path.with_name(f"{match['item']}_{match['arch']}_te.safetensors")
        if not text.is_file():
            raise UserError(
                f"{path}: its text encoder cache {text.name} is not in {text.parent}; "
                "run musubi-tuner's wan_cache_text_encoder_outputs.py"
            )
        text_shapes, _ = read_header(text)
        text_keys = [k for k in text_shapes if _MUSUBI_TEXT_KEY.match(k)]
        if len(text_keys) != 1:
            raise UserError(
                f"{text}: expected one varlen_t5_<dtype> tensor (found "
                f"{', '.join(sorted(text_shapes)) or 'none'})"
            )
        clip_id = path.relative_to(root).with_suffix("").as_posix()
        clips.append(Clip(clip_id, path, keys[0], shapes[keys[0]], text, text_keys[0]))
    if unnamed:  # another tool's files beside the cache, or a naming this importer lacks
        warnings.warn(
            f"{root}: {len(unnamed)} .safetensors file(s) not named as musubi-tuner's latent "
            f"caches (<item>_[<start>-<frames>_]<W>x<H>_<arch>) were left out, e.g. "
            f"{', '.join(sorted(unnamed)[:3])}",
            CacheWarning,
            stacklevel=3,
        )
    return clips


def _diffsynth(root: Path) -> list[Clip]:
    clips = []
    for path in _files(root, "*"):
        if path.suffix.lower() not in TORCH_SUFFIXES:
            continue
        shapes, _ = read_header(path)
        latent = next((k for k in _DIFFSYNTH_LATENT_KEYS if k in shapes), None)
        text = next((k for k in _DIFFSYNTH_TEXT_KEYS if k in shapes), None)
        if latent is None or text is None:
            raise UserError(
                f"{path}: expected a latent ({' or '.join(_DIFFSYNTH_LATENT_KEYS)}) and a text "
                f"embedding ({' or '.join(_DIFFSYNTH_TEXT_KEYS)}); found "
                f"{', '.join(sorted(shapes)) or 'none'}"
            )
        name = path.relative_to(root).as_posix()
        clip_id = name.removesuffix(".tensors.pth").removesuffix(path.suffix)
        clips.append(Clip(clip_id, path, latent, _drop_batch(shapes[latent]), path, text))
    return clips


def _need(path: Path, shapes: dict[str, tuple[int, ...]], key: str, what: str) -> None:
    if key not in shapes:
        raise UserError(
            f"{path}: no tensor {key!r} (found {', '.join(sorted(shapes)) or 'none'})"
            f"; expected {what}"
        )


def _held_out(clip_ids: list[str], fraction: float, seed: int) -> set[str]:
    """The clips of the held-out split: each with probability `fraction` by a hash of its id
    (stable when clips are added), at least one when the fraction is positive."""
    if fraction <= 0:
        return set()
    draws = {c: sample_seed(c, seed, "split") / float(1 << 63) for c in clip_ids}
    held = {c for c, u in draws.items() if u < fraction}
    if len(held) == len(clip_ids):
        raise UserError(
            f"--val-fraction {fraction}: every one of {len(clip_ids)} clips would be "
            "held out; lower it"
        )
    return held or {min(draws, key=draws.get)}
