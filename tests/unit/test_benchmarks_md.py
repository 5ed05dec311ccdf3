"""docs/benchmarks.md and the README's results table are generated from bench/results/*.json
(tools/benchmarks_md.py): a figure in the docs is always the one in its results file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "benchmarks_md.py"


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_md", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_are_up_to_date(tool: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    code = tool.main(["--check"])
    assert code == 0, capsys.readouterr().err + " (run: python tools/benchmarks_md.py)"


def test_every_results_file_has_a_section(tool: ModuleType) -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        assert f": {path.name}\n" in page, path.name
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        assert f"(../bench/results/{png.name})" in page, png.name


def test_a_section_says_what_was_not_recorded(tool: ModuleType, tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    doc = {
        "config": {"reps": 3, "cpus": 2, "host_load": [0.5, 0.25, 0.125]},
        "summary": {"ratio_vs_gloo": {"2x25": 1.23456}, "wall_s": 1.5},
        "rows": [{"transport": "gloo", "median_s": 0.02, "times_s": [0.02, 0.03]}],
    }
    (results / "mine.json").write_text(json.dumps(doc))
    (results / "mine_cdf.png").write_bytes(b"")
    out = tmp_path / "benchmarks.md"
    args = ["--results", str(results), "--out", str(out), "--readme", str(tmp_path / "none")]

    assert tool.main(args) == 0
    page = out.read_text()
    assert "- commit: not recorded" in page and "- command: not recorded" in page
    assert "CPU model not recorded; 2 cores; load average 0.50 / 0.25 / 0.12" in page
    assert "| ratio_vs_gloo | 1.235 |" in page  # a {case: value} summary as a grid
    assert "| wall_ms | 1500 |" in page  # seconds shown in milliseconds
    assert "| gloo | 20 |" in page and "times_ms" not in page  # per-repetition lists left out
    assert "[mine_cdf.png](../bench/results/mine_cdf.png)" in page
    assert tool.main([*args, "--check"]) == 0

    doc["summary"]["wall_s"] = 2.0  # the results change: the page is stale until regenerated
    (results / "mine.json").write_text(json.dumps(doc))
    assert tool.main([*args, "--check"]) == 1


def test_readme_block_is_replaced_between_its_markers(tool: ModuleType) -> None:
    text = f"intro\n{tool.BEGIN}\nold table\n{tool.END}\noutro\n"
    new = tool.with_readme_block(text, f"{tool.BEGIN}\nnew table\n{tool.END}")
    assert new == f"intro\n{tool.BEGIN}\nnew table\n{tool.END}\noutro\n"
    assert tool.with_readme_block("no markers\n", "x") == "no markers\n"


def test_the_generator_imports_neither_torch_nor_numpy() -> None:
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1]); "
        "assert not {'torch', 'numpy'} & set(sys.modules), 'imported torch or numpy'"
    )
    subprocess.run([sys.executable, "-c", code, str(TOOL)], check=True, timeout=120)
