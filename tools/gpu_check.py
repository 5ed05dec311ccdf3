"""Check the DDP hook's CUDA path on a machine with one CUDA GPU, in one command.

    bash tools/gpu_check.sh [OUTDIR]      # OUTDIR: $OUT if set, else ./gpu_check_out

What it does, in order, each stage with its own timeout inside one budget of :data:`BUDGET_S`
(under 6 minutes; a stage gets what is left of the budget when that is less than its own):

1. *environment*: the python it runs under (``python3`` on PATH, the one with the CUDA build
   of torch; ``GPU_CHECK_PYTHON`` overrides it in the wrapper), its torch and CUDA versions,
   ``torch.cuda.is_available()`` (probed in a subprocess: this module imports no torch),
   ``nvidia-smi``'s name, memory and driver, the CPU count. Without a CUDA GPU it prints one
   line, ``gpu_check: no CUDA GPU here (...); nothing to do``, writes nothing and exits 0; when
   ``nvidia-smi`` sees a GPU that this python's torch cannot use, that is a FAIL.
2. *install*: the project without dependencies, network or a wheel build: a link tree
   ``$TMP/site/gradlane/{transport,scheduling,integrations,bench}`` -> the repository's
   folders on ``PYTHONPATH``, plus the pyzmq wheel from ``.whl/`` (``tools/gpu_wheels.sh``)
   installed into ``$TMP/site`` when pyzmq is not importable. The CLI's subcommands come from
   entry points and are not available this way; nothing here needs them.
3. *imports*: ``import gradlane.transport, gradlane.integrations, zmq``; when that fails the
   later stages are skipped (they could only fail the same way).
4. *warm-up*: compiles the numba kernels once (about a minute on a fresh machine), so that the
   tests and the benchmark load them from the cache; its time is recorded.
5. *tests*: ``pytest tests/gpu`` with a junit XML report, parsed into per-test outcomes.
6. *benchmark*: ``python -m gradlane.bench.perf.ddp_step --device cuda --ranks 2 --transports
   udp``; its summary's ``gpu_step_ratio_vs_default`` and ``gpu_exposed_comm_ratio_vs_default``.

A stage that times out (its whole process group is stopped: SIGINT, so that pytest still
writes the report of the tests that ran, then SIGTERM, then SIGKILL) or crashes is reported as
such, and the later stages still run. Everything goes to ``OUTDIR/gpu_check.json``
(environment, stages with their times, per-test outcomes with durations and failure messages,
the benchmark's summary, the verdict) and ``OUTDIR/gpu_check.log`` (all output of every stage);
beside them the junit report ``gpu_tests.xml`` and the benchmark's ``gpu_step.json``. The last
line printed is the verdict, e.g. (the first wrapped here)::

    gpu_check: PASS — 7/7 GPU tests passed;
        step 1.08x default, exposed comm 0.90x default (H100, 212 s)
    gpu_check: FAIL — 2 of 7 GPU tests failed: test_x, test_y (H100, 190 s; see gpu_check.log)

Exit code: 0 on PASS (and without a GPU), 1 on FAIL.

On a lent GPU machine (the device tool of a development session)
------------------------------------------------------------------
That machine reaches no package index and lacks pyzmq, so first, here on the CPU machine::

    bash tools/gpu_wheels.sh          # the pyzmq wheel into the git-ignored .whl/

then one device call, which carries ``.whl`` and leaves time for the machine's start::

    run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=420)

The working tree travels (tracked and untracked-not-ignored files); ``$OUT`` is set there, so
the four files above come back under the reply's ``files_at``; the verdict is the last line of
its ``output_tail``. The numba cache does not travel (``__pycache__`` is ignored), hence the
warm-up. Call ``give_back`` afterwards unless a rerun follows at once.

Standard library only, Python 3.10+.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
#: ``gradlane.<name>`` -> the repository folder it is installed from (pyproject's package-dir).
PACKAGES = {
    "transport": "transport",
    "scheduling": "scheduling",
    "integrations": "integrations",
    "bench": "bench",
}
#: The whole check's time budget, seconds: with a timed-out stage's kill, under 6 minutes,
#: inside the device call's 420 s.
BUDGET_S = 330.0
#: Each stage's own timeout, seconds.
TIMEOUTS = {
    "environment": 90.0,  # importing torch and initialising CUDA on a cold machine
    "install": 60.0,
    "imports": 60.0,
    "warm-up": 150.0,  # the numba compile: about a minute there
    "tests": 150.0,
    "benchmark": 180.0,  # two rank processes, each importing torch and starting CUDA
}
#: How a timed-out stage is stopped: each signal to its process group, then that long a wait.
KILL_STEPS = ((signal.SIGINT, 5.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0))
#: Less than this left of the budget: the stage is skipped rather than started.
MIN_STAGE_S = 5.0
#: Failing tests named in the verdict line; the JSON names all.
MAX_NAMED = 5
#: Characters kept of a failure's message and of its traceback in the JSON.
MAX_MESSAGE, MAX_DETAILS = 2000, 4000
#: The benchmark's summary keys the verdict reports (ratios to DDP's default all-reduce).
STEP_KEY, COMM_KEY = "gpu_step_ratio_vs_default", "gpu_exposed_comm_ratio_vs_default"
JSON_NAME, LOG_NAME, JUNIT_NAME, BENCH_NAME = (
    "gpu_check.json",
    "gpu_check.log",
    "gpu_tests.xml",
    "gpu_step.json",
)

#: Compiles (or loads from numba's cache) every kernel a collective uses.
WARM_UP = "from gradlane.transport.drivers.warmup import warm_up; warm_up()"
#: Run by the python under test: prints one JSON line. torch is imported here only.
PROBE = """
import json, platform, sys
out = {"python": sys.executable, "python_version": platform.python_version()}
try:
    import torch
except Exception as e:
    out["error"] = f"torch not importable: {type(e).__name__}: {e}"
else:
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cuda_available"] = bool(torch.cuda.is_available())
    if out["cuda_available"]:
        out["device_count"] = torch.cuda.device_count()
        out["device_name"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
print(json.dumps(out))
"""


# -- stages ----------------------------------------------------------------------------------------
@dataclass
class Stage:
    """What one stage did: ``status`` is ``ok``, ``failed``, ``timed_out`` or ``skipped``."""

    name: str
    status: str
    seconds: float = 0.0
    timeout_s: float | None = None
    rc: int | None = None
    command: list[str] = field(default_factory=list)
    #: Why it failed or was skipped, in a few words.
    detail: str = ""


def run_stage(
    name: str, cmd: list[str], timeout_s: float, env: dict[str, str], log: IO[str]
) -> Stage:
    """Run ``cmd`` in the repository root, its output appended to ``log``, killed (with every
    process it started: its own session) after ``timeout_s``."""
    log.write(f"\n==== [{name}] {' '.join(cmd)} (timeout {timeout_s:.0f} s)\n")
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stage = Stage(name, "timed_out", time.monotonic() - t0, timeout_s, None, cmd)
        stage.detail = f"timed out after {timeout_s:.0f} s"
    else:
        status = "ok" if rc == 0 else "failed"
        stage = Stage(name, status, time.monotonic() - t0, timeout_s, rc, cmd)
        if rc != 0:
            stage.detail = f"failed (exit {rc})" if rc > 0 else f"killed by signal {-rc}"
    log.write(f"==== [{name}] {stage.detail or stage.status} in {stage.seconds:.1f} s\n")
    log.flush()
    return stage


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """Stop the process group we started: SIGINT first, so that pytest still writes its junit
    report of the tests that ran (KeyboardInterrupt ends its session), then SIGTERM and SIGKILL
    for whatever is left of the group (:data:`KILL_STEPS`)."""
    for sig, grace_s in KILL_STEPS:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


def probe(python: str, timeout_s: float) -> dict[str, Any]:
    """The python's torch, CUDA and GPU (:data:`PROBE` in a subprocess), with ``nvidia-smi``'s
    rows and the CPU count; ``error`` says why torch could not be asked."""
    env: dict[str, Any]
    try:
        out = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        lines = out.stdout.strip().splitlines()
        env = json.loads(lines[-1]) if out.returncode == 0 and lines else {}
        if not env:
            env = {"python": python, "error": f"probe exit {out.returncode}: {out.stderr[-500:]}"}
    except subprocess.TimeoutExpired:
        env = {"python": python, "error": f"probe timed out after {timeout_s:.0f} s"}
    env.setdefault("cuda_available", False)
    env["nvidia_smi"] = nvidia_smi()
    env["cpu_count"] = os.cpu_count()
    env["platform"] = platform.platform()
    env["commit"] = _commit()
    return env


def nvidia_smi() -> list[str]:
    """``name, memory.total, driver_version`` per GPU; empty without ``nvidia-smi`` or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(
            ["nvidia-smi", *query], capture_output=True, text=True, timeout=30, check=False
        )
    except subprocess.TimeoutExpired:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out else []


def _commit() -> str | None:
    """The checkout's commit, where the tree came with its ``.git``."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# -- install ---------------------------------------------------------------------------------------
def build_site(site: Path, root: Path = ROOT) -> Path:
    """Make ``site/gradlane/<name>`` a link to each of the repository's package folders (a
    namespace package, as the strict editable install builds it); returns ``site``."""
    pkg = site / "gradlane"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, folder in PACKAGES.items():
        link = pkg / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(root / folder, target_is_directory=True)
    return site


def site_env(site: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment) with ``site`` first on ``PYTHONPATH``, unbuffered
    output and Hypothesis's reproducible profile."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    return env


def _imports(python: str, module: str, env: dict[str, str], timeout_s: float) -> bool:
    """Whether ``python`` imports ``module`` (within ``timeout_s``)."""
    try:
        out = subprocess.run(
            [python, "-c", f"import {module}"],
            env=env,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0


def pyzmq_wheel(wheels: Path = WHEELS) -> Path | None:
    """The pyzmq wheel ``tools/gpu_wheels.sh`` left in ``wheels`` (the newest name, if several)."""
    found = sorted(wheels.glob("pyzmq-*.whl"))
    return found[-1] if found else None


def install(
    python: str,
    site: Path,
    env: dict[str, str],
    timeout_s: float,
    log: IO[str],
    wheels: Path = WHEELS,
) -> Stage:
    """The link tree, and pyzmq from its wheel when this python cannot import it."""
    t0 = time.monotonic()
    build_site(site)
    log.write(f"\n==== [install] link tree {site / 'gradlane'} -> {ROOT}\n")
    if _imports(python, "zmq", env, timeout_s):
        log.write("==== [install] pyzmq already importable\n")
        return Stage("install", "ok", time.monotonic() - t0, timeout_s, 0)
    wheel = pyzmq_wheel(wheels)
    if wheel is None:
        detail = f"failed: pyzmq is not importable and {wheels} holds no pyzmq wheel: run "
        detail += "tools/gpu_wheels.sh on a machine with pip access, then carry .whl"
        log.write(f"==== [install] {detail}\n")
        return Stage("install", "failed", time.monotonic() - t0, timeout_s, None, detail=detail)
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--target", str(site), str(wheel)]
    left = max(timeout_s - (time.monotonic() - t0), MIN_STAGE_S)
    stage = run_stage("install", cmd, left, env, log)
    stage.seconds = time.monotonic() - t0
    stage.timeout_s = timeout_s
    return stage


# -- results ---------------------------------------------------------------------------------------
#: The worse outcome wins when junit reports a test twice (a teardown error after a pass).
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def parse_junit(path: Path) -> dict[str, Any]:
    """Per-test outcomes of a pytest junit XML report: ``cases`` (``name``, ``classname``,
    ``outcome``, ``seconds``, ``message``, ``details``: the report's traceback) and ``counts``
    per outcome plus ``total``."""
    cases: dict[tuple[str, str], dict[str, Any]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # the test running when pytest was interrupted: a record with no name
        outcome, message, details = "passed", "", ""
        for tag, name in (("skipped", "skipped"), ("failure", "failed"), ("error", "error")):
            node = case.find(tag)
            if node is not None and _RANK[name] > _RANK[outcome]:
                outcome = name
                details = (node.text or "").strip()
                message = node.get("message") or (details.splitlines() or [""])[-1]
        key = (case.get("classname", ""), case.get("name", ""))
        row: dict[str, Any] = {
            "name": key[1],
            "classname": key[0],
            "outcome": outcome,
            "seconds": float(case.get("time") or 0.0),
            "message": message[:MAX_MESSAGE],
            "details": details[-MAX_DETAILS:],  # the end of the traceback says the most
        }
        old = cases.get(key)
        if old is not None:
            row["seconds"] += old["seconds"]
            if _RANK[old["outcome"]] > _RANK[outcome]:
                row.update({k: old[k] for k in ("outcome", "message", "details")})
        cases[key] = row
    counts = {name: 0 for name in _RANK}
    for row in cases.values():
        counts[row["outcome"]] += 1
    counts["total"] = len(cases)
    return {"counts": counts, "cases": list(cases.values())}


def read_bench(path: Path) -> dict[str, Any]:
    """The benchmark's ``summary`` from its JSON (``error`` when there is none to read)."""
    if not path.is_file():
        return {"error": f"the benchmark wrote no {path.name}"}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"{path.name} is not JSON: {e}"}
    summary = data.get("summary") if isinstance(data, dict) else None
    if not isinstance(summary, dict):
        return {"error": f"{path.name} holds no summary"}
    return {"summary": summary}


def ratio(summary: dict[str, Any], key: str, ranks: int = 2) -> float | None:
    """``summary[key]`` as a number: a plain number, or the entry for ``ranks`` of a table keyed
    by rank count (the benchmark's other ratios are such tables)."""
    value = summary.get(key)
    if isinstance(value, dict):
        value = value.get(str(ranks), next(iter(value.values())) if len(value) == 1 else None)
    return float(value) if isinstance(value, (int, float)) else None


def null_entry(summary: dict[str, Any], key: str, ranks: int = 2) -> bool:
    """``summary[key]`` is there and says null (plainly, or in its entry for ``ranks``)."""
    if key not in summary:
        return False
    value = summary[key]
    if isinstance(value, dict):
        return str(ranks) in value and value[str(ranks)] is None
    return value is None


#: How the verdict names each stage.
LABELS = {"tests": "GPU tests"}


def verdict(
    stages: list[Stage],
    tests: dict[str, Any] | None,
    bench: dict[str, Any] | None,
    gpu: str,
    seconds: float,
) -> tuple[bool, str, list[str]]:
    """``(passed, the one-line verdict, the problems)`` from the stages' results.

    PASS needs no stage timed out, skipped or failed, at least one GPU test run and none failed
    or in error, and a benchmark summary holding both ratios (the exposed-communication one may
    be null: the default hook then hid all of its communication). Failing tests are named from the
    junit report (pytest then exits 1: that is not said again as a failed stage)."""
    problems: list[str] = []
    by_name = {s.name: s for s in stages}
    skipped: dict[str, list[str]] = {}  # why -> the stages skipped for it
    for stage in stages:
        label = LABELS.get(stage.name, stage.name)
        if stage.status == "skipped":
            skipped.setdefault(stage.detail, []).append(label)
        elif stage.status == "timed_out" or (
            stage.status == "failed" and stage.name not in ("tests", "benchmark")
        ):  # the tests' and the benchmark's failures are said below, from their results
            problems.append(f"{label} {stage.detail}")
    problems += [f"{', '.join(names)} {why}" for why, names in skipped.items()]

    run = by_name.get("tests")
    if tests is not None:
        counts = tests["counts"]
        bad = [c["name"] for c in tests["cases"] if c["outcome"] in ("failed", "error")]
        if bad:
            named = ", ".join(bad[:MAX_NAMED])
            if len(bad) > MAX_NAMED:
                named += f", +{len(bad) - MAX_NAMED} more"
            problems.append(f"{len(bad)} of {counts['total']} GPU tests failed: {named}")
        elif counts["passed"] == 0:
            problems.append(f"no GPU test ran ({counts['skipped']} skipped)")
        if run is not None and run.status == "failed" and run.rc != 1:
            problems.append(f"pytest {run.detail}")  # not 1 (tests failed): it broke
    elif run is not None and run.status in ("ok", "failed"):
        problems.append(f"GPU tests wrote no junit report ({run.detail or 'exit 0'})")

    run = by_name.get("benchmark")
    crashed = run is not None and run.status == "failed"
    step = comm = None
    if run is not None and run.status == "failed":
        problems.append(f"benchmark {run.detail}")
    elif bench is not None and "error" in bench:
        problems.append(bench["error"])
    if bench is not None and "summary" in bench:
        summary = bench["summary"]
        step, comm = ratio(summary, STEP_KEY), ratio(summary, COMM_KEY)
        # The exposed-communication ratio is null, by the benchmark's own account, when the
        # default hook hides all of its communication (nothing to divide by): not a failure.
        comm_na = comm is None and null_entry(summary, COMM_KEY)
        missing = [k for k, v in ((STEP_KEY, step), (COMM_KEY, comm)) if v is None]
        if comm_na:
            missing.remove(COMM_KEY)
        if missing and not crashed:
            problems.append(f"benchmark summary lacks {', '.join(missing)}")
    else:
        comm_na = False

    where = f"{gpu}, {seconds:.0f} s"
    if problems or tests is None or step is None or (comm is None and not comm_na):
        problems = problems or ["no GPU test report or no benchmark summary"]
        return False, f"gpu_check: FAIL — {'; '.join(problems)} ({where}; see {LOG_NAME})", problems
    counts = tests["counts"]
    ran = f"{counts['passed']}/{counts['total']} GPU tests passed"
    if counts["skipped"]:
        ran += f" ({counts['skipped']} skipped)"
    exposed = (
        "exposed comm n/a (the default hook hides all of its own)"
        if comm is None
        else f"exposed comm {comm:.2f}x default"
    )
    measured = f"step {step:.2f}x default, {exposed}"
    return True, f"gpu_check: PASS — {ran}; {measured} ({where})", problems


def gpu_label(env: dict[str, Any]) -> str:
    """A short name of the GPU for the verdict: ``H100 80GB HBM3`` from ``NVIDIA H100 ...``."""
    name = env.get("device_name") or (env.get("nvidia_smi") or ["GPU"])[0].split(",")[0]
    return str(name).removeprefix("NVIDIA ").strip() or "GPU"


# -- the check -------------------------------------------------------------------------------------
class Budget:
    """What is left of :data:`BUDGET_S`, handed out stage by stage."""

    def __init__(self, total_s: float) -> None:
        self.start = time.monotonic()
        self.total_s = total_s

    def elapsed(self) -> float:
        """Seconds since the check began."""
        return time.monotonic() - self.start

    def timeout(self, stage: str) -> float:
        """The stage's own timeout, or what is left of the budget if that is less."""
        return min(TIMEOUTS[stage], self.total_s - self.elapsed())


def _skipped(name: str, why: str) -> Stage:
    return Stage(name, "skipped", detail=f"skipped ({why})")


def check(outdir: Path, python: str) -> int:
    """The whole check (module docstring); returns the exit code."""
    budget = Budget(BUDGET_S)
    env_info = probe(python, TIMEOUTS["environment"])
    if not env_info.get("cuda_available"):
        return _no_gpu(env_info, python)

    outdir.mkdir(parents=True, exist_ok=True)
    gpu = gpu_label(env_info)
    print(
        f"gpu_check: python {env_info['python']} ({env_info['python_version']}), torch "
        f"{env_info['torch']} (CUDA {env_info['cuda']}), {env_info['device_name']}, "
        f"{env_info['cpu_count']} CPUs; budget {BUDGET_S:.0f} s; output in {outdir}",
        flush=True,
    )
    junit, bench_json = outdir / JUNIT_NAME, outdir / BENCH_NAME
    for stale in (junit, bench_json):
        stale.unlink(missing_ok=True)
    plan = {
        "imports": [python, "-c", "import gradlane.transport, gradlane.integrations, zmq"],
        "warm-up": [python, "-c", WARM_UP],
        "tests": [python, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-q",
                  f"--junitxml={junit}"],
        # Its own --timeout (per rank count) ends its ranks before the stage's kill would.
        "benchmark": [python, "-m", "gradlane.bench.perf.ddp_step", "--device", "cuda",
                      "--ranks", "2", "--transports", "udp", "--json", str(bench_json),
                      "--timeout", str(int(TIMEOUTS["benchmark"] - 20))],
    }  # fmt: skip
    stages = [Stage("environment", "ok", budget.elapsed(), TIMEOUTS["environment"])]
    tests: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    env = site_env(tmp / "site")
    with (outdir / LOG_NAME).open("w") as log:
        log.write(json.dumps(env_info, indent=1) + "\n")
        try:
            stages.append(install(python, tmp / "site", env, budget.timeout("install"), log))
            _report(stages[-1])
            imported = True
            for name, cmd in plan.items():
                left = budget.timeout(name)
                if not imported:
                    stage = _skipped(name, "the imports failed")
                elif left < MIN_STAGE_S:
                    stage = _skipped(name, f"no time left of the {BUDGET_S:.0f} s budget")
                else:
                    stage = run_stage(name, cmd, left, env, log)
                imported = imported and (name != "imports" or stage.status == "ok")
                stages.append(stage)
                _report(stage)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if junit.is_file():
            try:
                tests = parse_junit(junit)
            except ET.ParseError as e:
                log.write(f"==== [tests] unreadable junit report: {e}\n")
        if stages[-1].status in ("ok", "failed"):
            bench = read_bench(bench_json)
        seconds = budget.elapsed()
        passed, line, problems = verdict(stages, tests, bench, gpu, seconds)
        result = {
            "verdict": "PASS" if passed else "FAIL",
            "line": line,
            "problems": problems,
            "seconds": round(seconds, 1),
            "budget_s": BUDGET_S,
            "environment": env_info,
            "timings_s": {s.name: round(s.seconds, 1) for s in stages},
            "stages": [asdict(s) | {"seconds": round(s.seconds, 2)} for s in stages],
            "tests": tests,
            "benchmark": bench,
        }
        (outdir / JSON_NAME).write_text(json.dumps(result, indent=1) + "\n")
        log.write(f"\n{line}\n")
    print(line)
    return 0 if passed else 1


def _no_gpu(env_info: dict[str, Any], python: str) -> int:
    """The one line for a machine without a usable CUDA GPU: exit 0, or 1 (a FAIL) where
    ``nvidia-smi`` sees a GPU that this python's torch cannot use."""
    seen = env_info.get("error") or (
        f"torch {env_info.get('torch')}, cuda available: {env_info.get('cuda_available')}"
    )
    where = f"python {env_info.get('python', python)} {env_info.get('python_version', '')}"
    if env_info["nvidia_smi"]:
        print(
            f"gpu_check: FAIL — nvidia-smi sees {env_info['nvidia_smi'][0]} but {where.strip()} "
            f"cannot use it ({seen}): run it with the python of the CUDA build of torch "
            "(GPU_CHECK_PYTHON=...)"
        )
        return 1
    print(f"gpu_check: no CUDA GPU here ({where.strip()}, {seen}); nothing to do")
    return 0


def _report(stage: Stage) -> None:
    """One console line per stage (the log holds its output)."""
    took = f" in {stage.seconds:.0f} s" if stage.status != "skipped" else ""
    print(f"gpu_check: {stage.name}: {stage.detail or stage.status}{took}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``gpu_check.py [OUTDIR]``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("OUT") or "./gpu_check_out"
    ap.add_argument("outdir", nargs="?", default=default, help=f"results folder ({default})")
    args = ap.parse_args(argv)
    return check(Path(args.outdir).resolve(), sys.executable)


if __name__ == "__main__":
    sys.exit(main())
