"""Test-wide settings: Hypothesis is derandomized and deadline-free under CI.

CI must be reproducible and a loaded 2-core machine must not turn a slow example into a
failure; locally Hypothesis explores with fresh seeds (``HYPOTHESIS_PROFILE=ci`` to mimic CI).
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
