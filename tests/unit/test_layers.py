"""The dependency rule of ARCHITECTURE §2 holds for the whole tree (tools/check_layers.py)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
assert _spec is not None and _spec.loader is not None
check_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_layers)


def test_the_tree_keeps_the_layering_rule():
    assert check_layers.violations(ROOT) == []


def test_the_checker_catches_a_breach(tmp_path):
    for pkg in check_layers.PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "scheduling" / "bad.py").write_text("import socket\nfrom time import time\n")
    (tmp_path / "transport" / "bad.py").write_text("import torch.nn\nprint('x')\n")
    found = check_layers.violations(tmp_path)
    assert any("scheduling/bad.py:1" in v and "socket" in v for v in found)
    assert any("scheduling/bad.py:2" in v and "time" in v for v in found)
    assert any("transport/bad.py:1" in v and "torch" in v for v in found)
    assert any("transport/bad.py:2" in v and "print" in v for v in found)


def test_imported_modules_reads_relative_and_absolute_imports():
    tree = ast.parse("import a.b\nfrom c.d import e\nfrom . import f\n")
    assert check_layers.imported_modules(tree) == [(1, "a"), (2, "c")]
