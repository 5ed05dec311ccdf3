"""tools/gpu_check.sh without a GPU: the one-line no-GPU path, and the Python side's logic
(junit parsing, the verdict, the link-tree install) on synthetic inputs."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with nvidia-smi")
@pytest.mark.timeout(120)
def test_without_a_gpu_it_says_so_and_does_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("OUT", None)
    env.pop("GPU_CHECK_PYTHON", None)
    run = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU here ("), lines
    assert "cuda available: False" in lines[0] and lines[0].endswith("; nothing to do")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nor ./gpu_check_out


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="3.2">
<testcase classname="tests.gpu.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.gpu.test_a" name="test_bad" time="0.5">
  <failure message="AssertionError: assert 1 == 2">def test_bad():
&gt;       assert 1 == 2
E       AssertionError: assert 1 == 2</failure></testcase>
<testcase classname="tests.gpu.test_a" name="test_later" time="0.1">
  <skipped type="pytest.skip" message="needs two GPUs">skipped</skipped></testcase>
<testcase classname="tests.gpu.test_b" name="test_setup" time="0.0">
  <error message="failed on setup with &quot;RuntimeError: CUDA error&quot;">trace</error>
</testcase>
<testcase classname="tests.gpu.test_b" name="test_teardown" time="0.7"/>
<testcase classname="tests.gpu.test_b" name="test_teardown" time="0.2">
  <error message="failed on teardown">trace</error></testcase>
<testcase time="0.000" />
</testsuite></testsuites>
"""


def test_junit_report_is_parsed_per_test(gc: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    report = gc.parse_junit(path)
    assert report["counts"] == {"passed": 1, "skipped": 1, "failed": 1, "error": 2, "total": 5}
    cases = {c["name"]: c for c in report["cases"]}
    assert cases["test_ok"]["outcome"] == "passed" and cases["test_ok"]["seconds"] == 1.5
    assert cases["test_bad"]["outcome"] == "failed"
    assert cases["test_bad"]["message"] == "AssertionError: assert 1 == 2"
    assert "assert 1 == 2" in cases["test_bad"]["details"]
    assert cases["test_later"]["outcome"] == "skipped"
    assert cases["test_setup"]["outcome"] == "error"
    assert "CUDA error" in cases["test_setup"]["message"]
    # The nameless record of a test interrupted by the timeout's SIGINT is no test.
    assert "" not in cases
    # Reported twice (a pass, then a teardown error): one case, the worse outcome, both times.
    assert cases["test_teardown"]["outcome"] == "error"
    assert cases["test_teardown"]["seconds"] == pytest.approx(0.9)


def _ok(gc: ModuleType) -> list:
    return [gc.Stage(n, "ok", 1.0, 60.0, 0) for n in gc.TIMEOUTS if n != "environment"]


def _tests(passed: int, failed: tuple[str, ...] = (), skipped: int = 0) -> dict:
    cases = [{"name": f"test_{i}", "outcome": "passed"} for i in range(passed)]
    cases += [{"name": n, "outcome": "failed"} for n in failed]
    cases += [{"name": f"test_s{i}", "outcome": "skipped"} for i in range(skipped)]
    counts = {"passed": passed, "failed": len(failed), "error": 0, "skipped": skipped}
    return {"counts": counts | {"total": len(cases)}, "cases": cases}


BENCH = {
    "summary": {
        "gpu_step_ratio_vs_default": {"2": 1.084},
        "gpu_exposed_comm_ratio_vs_default": 0.9,
    }
}


def test_verdict_pass(gc: ModuleType) -> None:
    passed, line, problems = gc.verdict(_ok(gc), _tests(7), BENCH, "H100", 212.4)
    assert passed and problems == []
    assert line == (
        "gpu_check: PASS — 7/7 GPU tests passed; step 1.08x default, "
        "exposed comm 0.90x default (H100, 212 s)"
    )


def test_verdict_takes_a_null_exposed_comm_ratio_as_not_applicable(gc: ModuleType) -> None:
    # The benchmark writes null when the default hook exposes no communication at all.
    bench = {"summary": {"gpu_step_ratio_vs_default": {"2": 1.1},
                         "gpu_exposed_comm_ratio_vs_default": {"2": None}}}  # fmt: skip
    passed, line, problems = gc.verdict(_ok(gc), _tests(7), bench, "H100", 200)
    assert passed and problems == []
    assert "step 1.10x default, exposed comm n/a (the default hook hides all of its own)" in line
    # Absent, not null: the benchmark did not say, which fails the check.
    bench = {"summary": {"gpu_step_ratio_vs_default": {"2": 1.1}}}
    passed, _, problems = gc.verdict(_ok(gc), _tests(7), bench, "H100", 200)
    assert not passed and problems == ["benchmark summary lacks gpu_exposed_comm_ratio_vs_default"]


def test_verdict_names_the_failed_tests(gc: ModuleType) -> None:
    stages = _ok(gc)
    stages[3] = gc.Stage("tests", "failed", 30.0, 150.0, 1, detail="failed (exit 1)")
    passed, line, _ = gc.verdict(stages, _tests(5, ("test_x", "test_y")), BENCH, "H100", 190)
    assert not passed
    assert line == (
        "gpu_check: FAIL — 2 of 7 GPU tests failed: test_x, test_y (H100, 190 s; see gpu_check.log)"
    )


def test_verdict_reports_a_timed_out_stage(gc: ModuleType) -> None:
    stages = _ok(gc)
    stages[2] = gc.Stage("warm-up", "timed_out", 150.0, 150.0, detail="timed out after 150 s")
    passed, line, problems = gc.verdict(stages, _tests(7), BENCH, "H100", 330)
    assert not passed and problems == ["warm-up timed out after 150 s"]
    assert line.startswith("gpu_check: FAIL — warm-up timed out after 150 s (H100, 330 s")
    # A timed-out pytest leaves no junit report: said once, as the stage's timeout.
    stages[3] = gc.Stage("tests", "timed_out", 150.0, 150.0, detail="timed out after 150 s")
    stages[4] = gc.Stage("benchmark", "skipped", detail="skipped (no time left)")
    _, _, problems = gc.verdict(stages, None, None, "H100", 340)
    assert problems == [
        "warm-up timed out after 150 s",
        "GPU tests timed out after 150 s",
        "benchmark skipped (no time left)",
    ]


def test_verdict_without_the_benchmark_json(gc: ModuleType, tmp_path: Path) -> None:
    bench = gc.read_bench(tmp_path / "gpu_step.json")
    passed, line, problems = gc.verdict(_ok(gc), _tests(7), bench, "H100", 200)
    assert not passed and problems == ["the benchmark wrote no gpu_step.json"]
    assert "FAIL — the benchmark wrote no gpu_step.json" in line
    # A summary without the GPU ratios is no measurement either.
    (tmp_path / "gpu_step.json").write_text('{"summary": {"step_ratio_vs_default": {"2": 1.1}}}')
    bench = gc.read_bench(tmp_path / "gpu_step.json")
    passed, _, problems = gc.verdict(_ok(gc), _tests(7), bench, "H100", 200)
    assert not passed and problems[0].startswith("benchmark summary lacks gpu_step_ratio")
    # A crashed benchmark is said as such, once.
    stages = _ok(gc)
    stages[4] = gc.Stage("benchmark", "failed", 5.0, 180.0, 2, detail="failed (exit 2)")
    _, _, problems = gc.verdict(stages, _tests(7), bench, "H100", 200)
    assert problems == ["benchmark failed (exit 2)"]


def test_link_tree_makes_the_package_importable(gc: ModuleType, tmp_path: Path) -> None:
    site = gc.build_site(tmp_path / "site")
    gc.build_site(site)  # again over the same tree: links are replaced, not an error
    env = gc.site_env(site, {"PATH": os.environ["PATH"]})  # no PYTHONPATH of this process
    # PYTHONPATH comes before site-packages: the link tree, not this venv's editable install,
    # provides the package (``gradlane`` is a namespace; its subpackages are regular ones).
    run = subprocess.run(
        [sys.executable, "-c", "import gradlane.scheduling as s; print(s.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(site / "gradlane" / "scheduling" / "__init__.py")


def test_link_tree_covers_every_package_dir(gc: ModuleType) -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    assert {f"gradlane.{k}": v for k, v in gc.PACKAGES.items()} == package_dir


def test_missing_wheel_names_the_script_that_fetches_it(gc: ModuleType, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "zmq.py").write_text("raise ImportError('no pyzmq here')\n")
    env = gc.site_env(tmp_path / "site", {"PATH": os.environ["PATH"], "PYTHONPATH": str(shadow)})
    stage = gc.install(sys.executable, tmp_path / "site", env, 60.0, io.StringIO(), tmp_path)
    assert stage.status == "failed" and "tools/gpu_wheels.sh" in stage.detail
    _, line, _ = gc.verdict([stage], None, None, "H100", 3)
    assert line.startswith("gpu_check: FAIL — install failed: pyzmq is not importable")


def _state(pid: int) -> str:
    """The process's state letter (``Z``: a zombie), or ``gone``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.timeout(60)
def test_a_stage_past_its_timeout_is_killed_with_its_children(
    gc: ModuleType, tmp_path: Path
) -> None:
    child = "import time; time.sleep(60)"
    parent = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "print('child', p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    log_path = tmp_path / "log"
    with log_path.open("w") as log:
        stage = gc.run_stage("tests", [sys.executable, "-c", parent], 2.0, dict(os.environ), log)
    assert stage.status == "timed_out" and stage.detail == "timed out after 2 s"
    assert stage.seconds < 20
    text = log_path.read_text()
    assert "==== [tests] timed out after 2 s in" in text
    pid = int(text.split("child ", 1)[1].split()[0])
    assert _state(pid) in ("gone", "Z")


def test_a_stage_that_fails_keeps_its_output_and_exit_code(gc: ModuleType, tmp_path: Path) -> None:
    log_path = tmp_path / "log"
    with log_path.open("w") as log:
        code = "print('to the log'); raise SystemExit(3)"
        stage = gc.run_stage("warm-up", [sys.executable, "-c", code], 30.0, dict(os.environ), log)
    assert (stage.status, stage.rc, stage.detail) == ("failed", 3, "failed (exit 3)")
    assert "to the log" in log_path.read_text()
