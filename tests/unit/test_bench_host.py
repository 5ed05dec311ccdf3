"""Every benchmark's JSON ``host``: CPU model, cores, load at the start and the end, and a
warning, printed at once, when the start is busy (1-minute load above 0.5 per core)."""

from __future__ import annotations

import io
import os

import pytest
from gradlane.bench import host as host_mod
from gradlane.bench.host import QUIET_LOAD_PER_CORE, HostWatch

from tools.benchmarks_md import machine


def test_a_quiet_start_records_the_host_without_a_warning(monkeypatch) -> None:
    loads = iter([(0.1, 0.2, 0.3), (0.4, 0.5, 0.6)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(loads))
    out = io.StringIO()
    watch = HostWatch(out)
    rec = watch.record()
    assert out.getvalue() == "" and watch.quiet
    assert rec["load_start"] == [0.1, 0.2, 0.3] and rec["load_end"] == [0.4, 0.5, 0.6]
    assert rec["cpus"] == os.cpu_count() and rec["cpu_model"] == host_mod.cpu_model()
    assert rec["quiet"] is True and rec["warning"] is None


def test_a_busy_start_is_warned_at_once_and_recorded(monkeypatch) -> None:
    busy = QUIET_LOAD_PER_CORE * (os.cpu_count() or 1) + 0.5
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, busy, busy))
    out = io.StringIO()
    rec = HostWatch(out).record()
    assert out.getvalue().startswith("WARNING: busy machine")
    assert rec["quiet"] is False and "distorted" in rec["warning"]
    line = machine({"host": rec})[0]
    assert rec["cpu_model"] in line and f"{busy:.2f} at the start" in line
    assert "busy machine" in line


@pytest.mark.parametrize("text", ["model name\t: Some CPU @ 2.0GHz\n", ""])
def test_cpu_model_reads_proc_cpuinfo_or_falls_back(monkeypatch, tmp_path, text: str) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k),
    )
    got = host_mod.cpu_model()
    assert got == "Some CPU @ 2.0GHz" if text else isinstance(got, str)
