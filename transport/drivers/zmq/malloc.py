"""glibc malloc parameters for the ZeroMQ plane: freed receive buffers stay mapped.

Theory of operation
-------------------
libzmq receives every message larger than its decoder's 8 KB buffer into a buffer of its own,
``malloc``'d on its I/O thread and freed once the plane has split the frame into the core's
arena (:mod:`gradlane.transport.drivers.zmq.frames`). Under glibc's initial parameters a batch
frame (up to 1 MiB) is above the mmap threshold (128 KiB): it is mapped and unmapped on its
own, so every page of every received frame is faulted in and zeroed by the kernel again.
Measured in a fresh process with two ranks all-reducing 25 MB over TCP: about 150,000 page
faults a second, all in libzmq's I/O thread, some 10% of the machine.

glibc adjusts those parameters itself once the process frees a mapped chunk: the mmap
threshold becomes that chunk's size and the trim threshold twice it (up to 32 and 64 MiB). A
process that has already freed a large buffer (a training loop's tensors, a benchmark's
arrays) therefore does not fault, and one that has not does, so the plane's speed would depend
on what the process happened to allocate before. :func:`retain_freed_memory` sets both to
those largest values (mmap threshold 32 MiB, trim threshold 64 MiB) once, up front: what glibc
converges to by itself in most long-running numeric processes, reached before the first frame.

The parameters are the process's (glibc has one set), and setting them turns off glibc's own
adjustment, which would only have raised them to the same values.
:class:`~gradlane.transport.drivers.zmq.plane.ZmqPlane` calls it when it starts, unless
``ZmqPlane(tune_malloc=False)`` or ``GRADLANE_NO_MALLOC_TUNING=1``; with another C library it
does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "retain_freed_memory"]

log = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Allocations below this come from the heap, not a mapping of their own: the largest value
#: glibc's own adjustment reaches (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of a heap kept before glibc gives it back to the kernel: twice the
#: mmap threshold, as glibc's own adjustment sets it.
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_lock = threading.Lock()
_outcome: dict[str, bool] = {}  # "applied": the first call's outcome, fixed for the process


def _disabled() -> bool:
    return os.environ.get("GRADLANE_NO_MALLOC_TUNING", "") not in ("", "0")


def retain_freed_memory() -> bool:
    """Set glibc's malloc parameters as the module docstring says, once per process; True
    when they are set (now or by an earlier call), False under another C library, when
    ``GRADLANE_NO_MALLOC_TUNING`` asks not to, or when glibc refuses a value."""
    if _disabled():
        return False
    with _lock:
        if "applied" not in _outcome:
            _outcome["applied"] = _apply()
        return _outcome["applied"]


def _apply() -> bool:
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has mallopt as a no-op stub)
    except (OSError, AttributeError):
        log.debug("not glibc: malloc parameters left as they are")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = True
    for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ):
        if mallopt(param, value) != 1:
            log.warning("glibc refused mallopt(%d, %d): malloc parameters partly set", param, value)
            ok = False
    return ok
