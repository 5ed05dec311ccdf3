"""The repository installs as one import package, ``gradlane``, and lists every subpackage."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("transport", "scheduling", "integrations", "bench")


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)


def test_every_package_folder_is_listed_under_its_gradlane_name():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {
        "gradlane." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in TOPS
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    data_only = {"gradlane.bench.replay.traces"}  # shipped data, no code
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == data_only, "these listed packages have no folder"


def test_the_only_top_level_name_is_gradlane():
    cfg = _pyproject()["tool"]["setuptools"]
    assert {p.split(".")[0] for p in cfg["packages"]} == {"gradlane"}
    assert cfg["package-dir"] == {f"gradlane.{top}": top for top in TOPS}


def test_there_is_no_gradlane_folder_to_shadow_the_namespace():
    # ``gradlane`` is a namespace assembled by the mapping; a folder of that name at the root
    # would shadow it for anything run from the repository.
    assert not (ROOT / "gradlane").exists()
