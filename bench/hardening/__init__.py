"""The hardening campaign: ``python -m gradlane.bench.hardening`` attacks live engines and a
daemon on loopback and reports what held (see docs/hardening.md)."""
