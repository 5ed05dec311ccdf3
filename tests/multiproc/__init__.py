"""Tier 3: several processes (torch.distributed DDP, daemons); every process is cleaned up.

Filled by the engine, DDP hook and daemon issues.
"""
