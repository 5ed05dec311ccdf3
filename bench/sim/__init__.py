"""A deterministic discrete-event network simulator that drives the real sans-I/O cores."""
