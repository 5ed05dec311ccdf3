"""The ``gradlane`` command line: version, help, the ``gradlane.commands`` entry points (light
to load, a broken one skipped), progress bars, and a tiny run of the demo."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gradlane.integrations.cli.command import RunProgress
from gradlane.integrations.cli.main import commands, main
from gradlane.transport import __version__

ROOT = Path(__file__).resolve().parents[2]
#: gradlane's own subcommands (pyproject.toml, [project.entry-points."gradlane.commands"]).
OWN = {"demo", "netsim", "daemon", "stats", "bench", "testbed"}


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in OWN), out
    assert set(commands()) >= OWN


@pytest.mark.parametrize("argv", [["demo"], ["netsim"], ["daemon"], ["stats"], ["bench", "replay"],
                                  ["testbed"]])  # fmt: skip
def test_every_subcommand_declares_its_options(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    assert f"usage: gradlane {' '.join(argv)}" in capsys.readouterr().out


def test_unknown_subcommand_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_does_not_import_torch_or_numba():
    """Listing the commands loads every entry point: each must be light."""
    code = (
        "import sys; from gradlane.integrations.cli.main import main; "
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main([])\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "print('torch' in sys.modules, 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr


def _plugins(where: Path) -> dict[str, str]:
    """A distribution in ``where`` that registers three commands: one that works, one whose
    module is missing, one that is not a command. Its environment for a subprocess."""
    (where / "gradlane_hello_plugin.py").write_text(
        textwrap.dedent(
            """\
            from gradlane.integrations.cli.command import Command, emit

            def add_arguments(p):
                p.add_argument("--name", default="world")

            def run(args):
                emit(f"hello {args.name}")
                return 3

            COMMAND = Command(help="say hello", add_arguments=add_arguments, run=run)
            """
        )
    )
    info = where / "gradlane_test_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gradlane-test-plugins\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[gradlane.commands]\n"
        "broken = gradlane_no_such_plugin_module:COMMAND\n"
        "hello = gradlane_hello_plugin:COMMAND\n"
        "notacommand = json:dumps\n"
    )
    return dict(os.environ, PYTHONPATH=str(where))


def test_other_distributions_add_commands_and_a_broken_one_is_skipped(tmp_path):
    env = _plugins(tmp_path)
    cli = [sys.executable, "-m", "gradlane.integrations.cli.main"]

    def gradlane(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    helped = gradlane("--help")
    assert helped.returncode == 0, helped.stderr
    assert all(name in helped.stdout for name in [*OWN, "hello"]), helped.stdout
    assert "broken" not in helped.stdout and "notacommand" not in helped.stdout
    assert "skipping command 'broken' (gradlane_no_such_plugin_module:COMMAND)" in helped.stderr
    assert "ModuleNotFoundError" in helped.stderr
    assert "skipping command 'notacommand' (json:dumps): not a Command" in helped.stderr
    hello = gradlane("hello", "--name", "gradlane")
    assert hello.returncode == 3 and hello.stdout == "hello gradlane\n", hello.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_writes_only_each_finished_run(capsys):
    with RunProgress() as bars:
        bars.update("gloo", 2, 4)
        bars.update("gradlane", 0, 4, "compiling kernels, first run only")
        bars.update("gloo", 4, 4)
        bars.update("gradlane", 2, 4)
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("  gloo") and "4/4" in lines[0], err


def test_progress_on_a_terminal_draws_bars_with_their_note(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with RunProgress() as bars:
        bars.update("gradlane", 0, 4, "compiling kernels, first run only")
        shown = term.getvalue()
        for step in range(1, 5):
            bars.update("gradlane", step, 4)
    assert "gradlane" in shown and "0/4" in shown and "compiling kernels, first run only" in shown
    final = term.getvalue().rstrip("\n").rsplit("\r", 1)[-1]
    assert "4/4" in final and "compiling" not in final, final


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
