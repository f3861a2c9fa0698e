"""Where the kernel sources are found (the checkout's kernels/, else the installed package's
copy) and what their digest covers; the wheel's copy is tested in
tests/slow/repo/test_install.py."""

from __future__ import annotations

import shutil
from pathlib import Path

from repo_paths import ROOT

from adaptiveload.ops import kernel_build as kb
from adaptiveload.ops import kernel_sources as ks


def test_a_checkout_uses_its_top_level_kernels_folder() -> None:
    assert ks.SOURCE_DIR == ROOT / "kernels"
    names = [p.name for p in ks.source_files()]
    assert {*kb.SOURCES, "ln_modulate.h", "ln_modulate_dispatch_table.cpp"} <= set(names)
    assert "README.md" not in names and names == sorted(names)
    assert not (ROOT / "adaptiveload" / ks.KERNELS_DIR).exists()  # one copy in the tree


def test_an_installed_package_uses_its_packaged_copy(tmp_path: Path) -> None:
    """site-packages has neither pyproject.toml nor kernels/ beside the package; a folder with
    a pyproject.toml but no kernels/ is not taken for a checkout either."""
    package = tmp_path / "site" / "adaptiveload"
    (package / ks.KERNELS_DIR).mkdir(parents=True)
    assert ks.find_source_dir(package) == package / ks.KERNELS_DIR
    (tmp_path / "site" / "pyproject.toml").write_text("")
    assert ks.find_source_dir(package) == package / ks.KERNELS_DIR
    (tmp_path / "site" / ks.KERNELS_DIR).mkdir()
    assert ks.find_source_dir(package) == tmp_path / "site" / ks.KERNELS_DIR
    assert ks.source_files(tmp_path / "missing") == []


def test_digest_covers_the_sources_not_the_prose(tmp_path: Path) -> None:
    copy = tmp_path / "kernels"
    shutil.copytree(ks.SOURCE_DIR, copy)
    assert ks.sources_digest(copy) == ks.sources_digest()  # names and bytes, not the path
    (copy / "README.md").write_text("edited prose\n")
    (copy / "notes.txt").write_text("not a source\n")
    assert ks.sources_digest(copy) == ks.sources_digest()
    fwd = copy / "ln_modulate_fwd.cu"
    fwd.write_bytes(fwd.read_bytes() + b"\n")
    assert ks.sources_digest(copy) != ks.sources_digest()
