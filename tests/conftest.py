"""Test-wide settings: Hypothesis profiles, and a marker per test tier.

Hypothesis is derandomized and deadline-free under CI: CI must be reproducible and a loaded
2-core machine must not turn a slow example into a failure; locally Hypothesis explores with
fresh seeds (``HYPOTHESIS_PROFILE=ci`` to mimic CI).

Every test is marked with its tier, the folder it lives in (``unit``, ``loopback``,
``multiproc``, ``netns``, ``gpu``), so ``pytest -m unit`` or ``pytest -m "not netns"`` selects
by tier without a marker on each test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

TESTS = Path(__file__).resolve().parent
#: The tier folders under tests/; each is also the name of its marker (pyproject.toml).
TIERS = ("unit", "loopback", "multiproc", "netns", "gpu")


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the tier folder directly under tests/ that holds it."""
    try:
        top = path.resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return top if top in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every collected test with its tier."""
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
