"""``python -m gradlane.bench.hardening``: see :mod:`gradlane.bench.hardening.cli`."""

import sys

from gradlane.bench.hardening.cli import main

sys.exit(main())
