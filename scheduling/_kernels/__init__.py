"""Compiled passes of the scheduling policies (private): loss decisions and path updates."""
