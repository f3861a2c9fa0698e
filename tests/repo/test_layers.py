"""The package's layers: every module belongs to one, and none imports from a layer above its
own (function-level imports included). A new module names its layer here."""

from __future__ import annotations

import ast
from pathlib import Path

import adaptiveload

PACKAGE = Path(adaptiveload.__file__).resolve().parent

# bottom to top; a prefix names a package's modules, an exact name one module
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("adaptiveload", "adaptiveload.errors", "adaptiveload.io", "adaptiveload.progress",
              "adaptiveload.tokens", "adaptiveload.metrics", "adaptiveload.extras",
              "adaptiveload.provenance", "adaptiveload.experiment", "adaptiveload.step_table",
              "adaptiveload.lifecycle", "adaptiveload.pipeline")),
    ("ops", ("adaptiveload.ops",)),
    ("model", ("adaptiveload.model",)),
    ("data", ("adaptiveload.data",)),
    ("costmodel", ("adaptiveload.costmodel",)),
    ("planning", ("adaptiveload.planning",)),
    ("integrations", ("adaptiveload.integrations",)),
    ("calibration", ("adaptiveload.calibration",)),
    ("training", ("adaptiveload.training",)),
    ("tracking", ("adaptiveload.tracking",)),
    ("analysis", ("adaptiveload.analysis",)),
    ("cli", ("adaptiveload.cli", "adaptiveload.__main__", "adaptiveload.jobshell")),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The index of `module`'s layer: its exact name, else the longest package prefix."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            exact = module == name
            inside = module.startswith(name + ".") and name != "adaptiveload"
            if (exact or inside) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return best[1] if best else None


def imports(path: Path, module: str) -> set[str]:
    """The adaptiveload modules `path` imports, anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            targets = [name]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t == "adaptiveload" or t.startswith("adaptiveload."))
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"add these modules to a layer in tests/repo/test_layers.py: {missing}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for module, path in MODULES.items():
        own = layer_of(module)
        for target in sorted(imports(path, module)):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{module} ({LAYERS[own][0]}) imports {target} "
                              f"({LAYERS[theirs][0]})")
    assert not upward, "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The test above can fail: a function-level import of the CLI from `ops` is caught."""
    fake = tmp_path / "adaptiveload" / "ops" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from adaptiveload.cli import app\n"
                    "    from . import ln_modulate\n")
    module = ".".join(fake.relative_to(tmp_path).with_suffix("").parts)
    assert imports(fake, module) == {"adaptiveload.cli", "adaptiveload.ops"}
    assert layer_of("adaptiveload.cli") > layer_of(module) == layer_of("adaptiveload.ops")
    assert layer_of("adaptiveload.ops.csrc_missing") == layer_of("adaptiveload.ops")
    assert layer_of("adaptiveload.nowhere") is None
