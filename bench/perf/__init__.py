"""Micro- and macro-benchmarks that print JSON and compare against a baseline in the same run:
kernels, the sans-I/O core's CPU, the loopback all-reduce, the DDP step and the UDP floor."""
