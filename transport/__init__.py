"""gradlane's transport: wire format, numba kernels, sans-I/O protocol cores and I/O adapters.

This package never imports torch (ARCHITECTURE §2).
"""

__version__ = "0.1.0"
