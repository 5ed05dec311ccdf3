"""Named shared-memory segments for trainer ↔ daemon buckets (ARCHITECTURE §6).

A segment is a plain file under ``/dev/shm`` opened with ``os.open`` and mapped with ``mmap``:
cleanup is explicit (whoever knows the name unlinks it; unlinking twice is harmless) and
Python's ``multiprocessing.resource_tracker`` never unlinks or warns behind our back, as it does
for ``multiprocessing.shared_memory``. Names are checked against one pattern before they touch
the file system, so a name from an IPC message cannot reach outside ``/dev/shm``.

The trainer maps its own segments (:class:`Segment`). The daemon reaches a trainer's segment
through :class:`SegmentFile`, which keeps the file's descriptor beside its mapping and checks the
file's size (``fstat``) before every use: a load or store through a mapping past a truncated
end raises ``SIGBUS``, which kills the whole process (Python cannot turn it into an exception)
and with it every rank the daemon serves. A segment truncated by its owner after its SUBMIT is
therefore refused by name. The check cannot stop a truncate that lands during the copy itself
(a few milliseconds); only a segment its owner cannot shrink closes that window (a sealed
memfd, ``F_SEAL_SHRINK``), which the IPC does not pass yet.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import mmap
import os
import re
import stat

import numpy as np
from gradlane.transport.errors import ConfigError, GradlaneError

__all__ = ["SHM_DIR", "Segment", "SegmentError", "SegmentFile", "check_name", "remove_prefix"]

#: Where POSIX shared memory lives on Linux.
SHM_DIR = os.environ.get("GRADLANE_SHM_DIR", "/dev/shm")
#: Every gradlane segment name: a fixed prefix, then safe characters only (no '/', no '..').
_NAME = re.compile(r"gradlane-[A-Za-z0-9_.-]{1,200}\Z")


class SegmentError(GradlaneError):
    """A segment could not be created, opened or used (names it and says why)."""


def check_name(name: str) -> str:
    """``name`` if it is a valid segment name, else :class:`SegmentError`."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise SegmentError(f"{name!r} is not a gradlane shared-memory segment name")
    return name


class Segment:
    """One mapped segment ``/dev/shm/<name>`` of ``size`` bytes.

    :meth:`create` makes a new one (mode 0600, fails if the name exists); :meth:`open` maps an
    existing one read-write and checks it holds at least ``min_size`` bytes.
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._mm: mmap.mmap | None = mm

    @property
    def path(self) -> str:
        """The segment's file."""
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create and map a new segment of ``size`` bytes (> 0), readable by this user only."""
        check_name(name)
        if size <= 0:
            raise ConfigError(f"segment {name}: size {size} must be > 0")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise SegmentError(f"cannot create shared memory {path}: {e.strerror}") from None
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            _unlink(path)
            raise SegmentError(f"cannot size shared memory {path} to {size} B: {e}") from None
        os.close(fd)  # the mapping keeps the memory; no descriptor per segment
        return cls(name, size, mm)

    @classmethod
    def open(cls, name: str, min_size: int = 1) -> Segment:
        """Map the existing segment ``name``; :class:`SegmentError` if absent or too small."""
        check_name(name)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            what = "does not exist" if e.errno == errno.ENOENT else e.strerror
            raise SegmentError(f"shared memory {path} {what}") from None
        try:
            size = os.fstat(fd).st_size
            if size < max(min_size, 1):
                raise SegmentError(f"shared memory {path} holds {size} B, {min_size} B needed")
            mm = mmap.mmap(fd, size)
        except OSError as e:
            raise SegmentError(f"cannot map shared memory {path}: {e}") from None
        finally:
            os.close(fd)
        return cls(name, size, mm)

    def array(self, dtype: np.dtype | type, count: int, offset: int = 0) -> np.ndarray:
        """A 1-D view of ``count`` elements at byte ``offset`` (bounds checked)."""
        if self._mm is None:
            raise SegmentError(f"segment {self.name} is closed")
        dt = np.dtype(dtype)
        if (
            offset < 0
            or count < 0
            or offset % dt.itemsize
            or offset + count * dt.itemsize > self.size
        ):
            raise SegmentError(
                f"segment {self.name} ({self.size} B): {count} x {dt.name} at offset {offset} "
                "does not fit"
            )
        return np.frombuffer(self._mm, dtype=dt, count=count, offset=offset)

    def close(self) -> None:
        """Unmap (views still alive keep the mapping until they are gone). Idempotent."""
        mm, self._mm = self._mm, None
        if mm is not None:
            # A NumPy view still alive keeps the map: the GC unmaps it with the last view.
            with contextlib.suppress(BufferError):
                mm.close()

    def unlink(self) -> None:
        """Remove the name (the memory lives until every mapping is gone). Idempotent."""
        _unlink(self.path)


class SegmentFile:
    """Another process's segment ``/dev/shm/<name>``, mapped, with its descriptor kept to check
    the file's size before every use (see the module's docstring).

    :meth:`view` refuses, with a :class:`SegmentError`, any range the file no longer holds.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self._fd: int | None = fd
        self._mm: mmap.mmap | None = mm
        self.mapped = len(mm)
        """Bytes mapped (the file's size when it was opened)."""

    @property
    def path(self) -> str:
        """The segment's file."""
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def open(cls, name: str, min_size: int = 1) -> SegmentFile:
        """Open and map the existing plain file ``name`` read-write; :class:`SegmentError` if it
        is absent, not a plain file, or holds fewer than ``min_size`` bytes."""
        check_name(name)
        path = os.path.join(SHM_DIR, name)
        try:
            # O_NONBLOCK: a FIFO planted under a segment's name must not block the open.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            what = "does not exist" if e.errno == errno.ENOENT else e.strerror
            raise SegmentError(f"shared memory {path} {what}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"shared memory {path} is not a plain file")
            if st.st_size < max(min_size, 1):
                raise SegmentError(
                    f"shared memory {path} holds {st.st_size} B, {max(min_size, 1)} B needed"
                )
            try:
                mm = mmap.mmap(fd, st.st_size)
            except (OSError, ValueError) as e:
                raise SegmentError(f"cannot map shared memory {path}: {e}") from None
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm)

    @property
    def size(self) -> int:
        """The file's size now (its owner may change it at any time)."""
        if self._fd is None:
            raise SegmentError(f"segment {self.name} is closed")
        try:
            return os.fstat(self._fd).st_size
        except OSError as e:
            raise SegmentError(f"shared memory {self.path}: {e.strerror}") from None

    def require(self, nbytes: int) -> None:
        """:class:`SegmentError` unless the file holds at least ``nbytes`` bytes now."""
        size = self.size
        if size < nbytes:
            raise SegmentError(
                f"shared memory {self.path} was truncated by its owner to {size} B; "
                f"{nbytes} B were submitted"
            )

    def view(self, dtype: np.dtype | type, count: int, offset: int = 0) -> np.ndarray:
        """A 1-D view of ``count`` elements at byte ``offset``, after checking that the mapping
        covers them and that the file still holds them."""
        mm = self._mm
        if mm is None:
            raise SegmentError(f"segment {self.name} is closed")
        dt = np.dtype(dtype)
        end = offset + count * dt.itemsize
        if offset < 0 or count < 0 or offset % dt.itemsize or end > self.mapped:
            raise SegmentError(
                f"segment {self.name} ({self.mapped} B mapped): {count} x {dt.name} at offset "
                f"{offset} does not fit"
            )
        self.require(end)
        return np.frombuffer(mm, dtype=dt, count=count, offset=offset)

    def close(self) -> None:
        """Close the descriptor and the mapping (views still alive keep the mapping until they
        are gone). Idempotent."""
        fd, self._fd = self._fd, None
        mm, self._mm = self._mm, None
        if fd is not None:
            os.close(fd)
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()

    def unlink(self) -> None:
        """Remove the name (the memory lives until its owner's mapping is gone). Idempotent."""
        _unlink(self.path)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def remove_prefix(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; returns the names removed."""
    check_name(prefix)
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        _unlink(path)
        removed.append(os.path.basename(path))
    return removed
