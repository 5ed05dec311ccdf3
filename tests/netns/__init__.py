"""Tier 4: network namespaces in 10.200.0.0/16 (needs root; skipped with a reason otherwise).

Filled by the emulated-testbed issue; every namespace, link and process is removed, also on failure.
"""
