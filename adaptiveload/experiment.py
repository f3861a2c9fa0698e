"""Experiment files: load, fill defaults and validate against adaptiveload/experiment.schema.yaml.

The same schema serves Snakemake's `validate()` and every `adaptiveload ... --config` command,
so a bad field is reported the same way everywhere: file, field, what is expected.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Hashable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from adaptiveload.errors import UserError
from adaptiveload.io import read_text

# package data, so that an installed package validates with the same file as the checkout
SCHEMA_PATH = Path(__file__).resolve().parent / "experiment.schema.yaml"
# model.init_from of a run from Wan's seeded initialisation (the schema's default)
SCRATCH = "scratch"

@cache
def schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def schema_default(field: str) -> Any:
    """The schema's default of one field, by its dotted path ("train.steps"; "simulate.grid"
    for a field of a list's entries): the one place an experiment default is written, for the
    code that needs it outside an experiment file (dataclass and command-line defaults)."""
    node = schema()
    for name in field.split("."):
        node = node.get("items", node)
        try:
            node = node["properties"][name]
        except KeyError:
            raise KeyError(f"{field}: no such field in {SCHEMA_PATH.name}") from None
    if "default" not in node:
        raise KeyError(f"{field}: {SCHEMA_PATH.name} gives it no default")
    return copy.deepcopy(node["default"])


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


def _non_finite(value: Any, path: str = "") -> str | None:
    """The dotted path of the first NaN or infinite number in `value`, else None.

    JSON Schema bounds cannot refuse NaN (every comparison with it is false), and YAML
    writes it as `.nan`; this check runs with the schema everywhere the schema runs.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(top level)"
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, sub in items:
        found = _non_finite(sub, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def _require_finite(config: dict[str, Any], origin: str) -> None:
    bad = _non_finite(config)
    if bad:
        raise UserError(f"{origin}: field '{bad}': must be a finite number (not NaN or infinite)")


def validate(config: dict[str, Any], origin: str) -> dict[str, Any]:
    """Fill defaults into `config` in place and validate it; UserError names the bad field.

    Snakemake's validation of the pipeline config calls this too (see the Snakefile), so
    `snakemake -n` refuses what `adaptiveload` commands refuse.
    """
    _require_finite(config, origin)
    validator = _with_defaults(jsonschema.Draft202012Validator)(schema())
    # defaults are inserted before descending, so nested sections get theirs in the same pass
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        field = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise UserError(
            f"{origin}: field '{field}': {err.message}. "
            "See adaptiveload/experiment.schema.yaml for what is allowed."
        )
    return config


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last,
    silently dropping the value the user may have meant)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' given twice; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path, what: str = "experiment file") -> Any:
    """Parse a YAML file safely (no duplicate keys); UserError names the file and the line."""
    text = read_text(path, what)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise UserError(f"{path}: {where}not valid YAML ({exc.problem or exc.context})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None


# the key of a stage's view of an experiment (`view`): the fields it holds, nothing else
VIEW_KEY = "view"


def load(path: str | Path) -> dict[str, Any]:
    """Read an experiment YAML, fill defaults, validate. Raises UserError on bad input.

    A stage's view (what `view` writes: the file lists its fields under `view`) is validated
    the same way and returned with those fields only: a field outside it is absent, so a
    stage that reads one fails loudly (KeyError) instead of silently getting its default."""
    path = Path(path)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of fields at the top level")
    fields = raw.pop(VIEW_KEY, None)
    config = validate(raw, origin=str(path))
    return config if fields is None else select(config, fields)


def view(config: dict[str, Any], fields: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The file content of a view of the validated `config`: the `fields` (dotted paths, a
    section name for all of it) and the list of them, which `load` keeps to."""
    return {VIEW_KEY: list(fields), **select(config, fields)}


def select(config: dict[str, Any], fields: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The `fields` (dotted paths) of `config` and nothing else, nested as in `config`."""
    out: dict[str, Any] = {}
    for name in fields:
        *sections, last = name.split(".")
        source, target = config, out
        for section in sections:
            source, target = source[section], target.setdefault(section, {})
        if last in source:  # an optional field without a default (description) may be absent
            target[last] = copy.deepcopy(source[last])
    return out


def check_pipeline_config(config: dict[str, Any], files: list[str | Path]) -> None:
    """What the Snakefile runs beside Snakemake's `validate()`: the checks JSON Schema cannot
    express (duplicate keys in each config file, NaN/inf numbers), so `snakemake -n` refuses
    every config the `adaptiveload` commands refuse. UserError names the file and field."""
    for path in files:
        read_yaml(path)
    _require_finite(config, ", ".join(str(p) for p in files) or "config")


DEFAULT_EXPERIMENT = "default.yaml"  # what the Snakefile's `configfile:` names, in experiments/


def load_layered(path: str | Path) -> dict[str, Any]:
    """An experiment file as the pipeline sees it: layered over the default.yaml beside it
    (experiments/), the way Snakemake merges `--configfile`s (nested mappings merged,
    anything else replaced), then defaults filled and validated."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            both = isinstance(value, dict) and isinstance(base.get(key), dict)
            out[key] = merge(base[key], value) if both else value
        return out

    base = read_yaml(Path(path).parent / DEFAULT_EXPERIMENT)
    over = read_yaml(path) or {}
    if not isinstance(over, dict):
        raise UserError(f"{path}: expected a mapping of fields at the top level")
    return validate(merge(base, over), origin=str(path))
