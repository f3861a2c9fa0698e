"""Experiment files: load, fill defaults and validate against adaptiveload/config.schema.yaml.

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

# package data, so that an installed package validates with the same file as the checkout
SCHEMA_PATH = Path(__file__).resolve().parent / "config.schema.yaml"


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
            "See adaptiveload/config.schema.yaml for what is allowed."
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
