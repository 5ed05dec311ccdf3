"""Tier 2: real sockets on 127.0.0.0/8 (UDP and ZeroMQ), one process. Every wait has a timeout.

Filled by the engine/data-plane issue; the unit tier covers the sans-I/O cores beneath it.
"""
