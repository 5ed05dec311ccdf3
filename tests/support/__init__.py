"""Helpers shared by the test tiers: in-memory wire, NumPy references, core drivers, processes."""
