"""A self-pipe that wakes a ZeroMQ poll loop from other threads (and signal handlers).

The daemon's and the IPC client's loops poll ZeroMQ sockets and this pipe's read end together;
any thread calls :meth:`Waker.wake`. Writes after :meth:`Waker.close` are ignored under a lock,
so a late wake can never hit a descriptor number the process has reused for another file.
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["Waker"]


class Waker:
    """A non-blocking pipe: :attr:`fd` to poll, :meth:`wake` from anywhere, :meth:`drain`."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self._open = True

    def wake(self) -> None:
        """Make :attr:`fd` readable (a full pipe is already readable: nothing lost)."""
        with self._lock:
            if self._open:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._w, b"w")

    def drain(self) -> None:
        """Consume every pending wake-up."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        """Close both ends; later wakes are no-ops. Idempotent."""
        with self._lock:
            if self._open:
                self._open = False
                os.close(self.fd)
                os.close(self._w)
