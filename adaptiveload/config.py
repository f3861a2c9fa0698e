"""Experiment files: load, fill defaults and validate against workflow/schemas/config.schema.yaml.

The same schema serves Snakemake's `validate()` and every `adaptiveload ... --config` command,
so a bad field is reported the same way everywhere: file, field, what is expected.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from adaptiveload.errors import UserError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "workflow" / "schemas" / "config.schema.yaml"


@cache
def schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _with_defaults(validator_class: type) -> type:
    """A validator that also fills in `default`s (the jsonschema FAQ recipe, nested-aware)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema_):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema_)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


def validate(config: dict[str, Any], origin: str) -> dict[str, Any]:
    """Fill defaults into `config` in place and validate it; UserError names the bad field."""
    validator = _with_defaults(jsonschema.Draft202012Validator)(schema())
    # defaults are inserted before descending, so nested sections get theirs in the same pass
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        field = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise UserError(
            f"{origin}: field '{field}': {err.message}. "
            f"See {SCHEMA_PATH.relative_to(SCHEMA_PATH.parent.parent.parent)} for what is allowed."
        )
    return config


def load(path: str | Path) -> dict[str, Any]:
    """Read an experiment YAML, fill defaults, validate. Raises UserError on bad input."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: experiment file not found") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of fields at the top level")
    return validate(raw, origin=str(path))


DEFAULT_EXPERIMENT = SCHEMA_PATH.parent.parent.parent / "experiments" / "default.yaml"


def load_layered(path: str | Path) -> dict[str, Any]:
    """An experiment file as the pipeline sees it: layered over experiments/default.yaml the
    way Snakemake merges `--configfile`s (nested mappings merged, anything else replaced),
    then defaults filled and validated."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            both = isinstance(value, dict) and isinstance(base.get(key), dict)
            out[key] = merge(base[key], value) if both else value
        return out

    base = yaml.safe_load(DEFAULT_EXPERIMENT.read_text())
    try:
        over = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: experiment file not found") from None
    return validate(merge(base, over or {}), origin=str(path))
