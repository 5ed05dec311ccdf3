"""The ``gradlane`` command line: version, help, and a tiny run of the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gradlane.integrations.cli.main import main
from gradlane.transport import __version__


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "netsim" in out


def test_unknown_subcommand_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_does_not_import_torch_or_numba():
    code = (
        "import sys; from gradlane.integrations.cli.main import main; "
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()): main([])\n"
        "print('torch' in sys.modules, 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_simulated_demo_runs_and_writes_its_summary(tmp_path, capsys):
    path = tmp_path / "demo.json"
    args = ["demo", "--network", "sim", "--ranks", "4", "--steps", "2", "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "baseline (TCP-like)" in out and "gradlane" in out
    summary = json.loads(path.read_text())["summary"]
    assert set(summary) >= {"step_p99_baseline_s", "step_p99_gradlane_s", "delivered_fraction"}
    assert 0.98 <= summary["delivered_fraction"] <= 1.0


def test_daemon_and_stats_fail_clearly_without_a_working_setup(tmp_path):
    run = [sys.executable, "-m", "gradlane.integrations.cli.main"]
    bad = subprocess.run(
        [*run, "daemon", "--hosts", "2", "--socket", str(tmp_path / "d.sock")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "peers" in bad.stderr, bad.stderr
    assert list(tmp_path.iterdir()) == []  # refused before it bound anything
    none = subprocess.run(
        [*run, "stats", "--metrics", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert none.returncode == 1 and "no gradlane metrics at" in none.stderr, none.stderr
