"""Shared-memory segments for trainer ↔ daemon buckets (ARCHITECTURE §6): sealed memfds.

Theory of operation
-------------------
A trainer's segment is an anonymous memory file (``memfd_create``) that its owner cannot
shrink: :meth:`Segment.create` sizes it, then seals it (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``: no truncation, no growth, no change to the seals), maps it and keeps its
descriptor. The daemon maps it too; a load or store through a mapping past a file's end raises
``SIGBUS``, which kills the whole process (Python cannot turn it into an exception) and with it
every rank the daemon serves. With the seal no such end exists: a trainer's ``ftruncate`` fails
with ``EPERM``, before, during or after the daemon's copy.

Segments have no name in the file system. The daemon reaches a trainer's descriptors through
``/proc/<pid>/fd`` (:class:`PeerSegments`, one per trainer process, opened when it says HELLO:
the pid is the socket peer's, from the kernel). A SUBMIT names the descriptor and the memfd's
name; :meth:`SegmentFile.open` opens that descriptor without side effects (``O_PATH``), then
checks, on what it opened, that it is a regular file of the daemon's own user whose memfd name
is the one the message gives, reopens it read-write through ``/proc/self/fd``, checks that
``F_SEAL_SHRINK`` and ``F_SEAL_SEAL`` are set (and no write seal), that it holds the bucket,
and maps it. Anything else is a :class:`SegmentError` that says why; the daemon counts it and
answers FAIL. The mapping then keeps the memory: the daemon holds no descriptor per segment.

Cleanup is the kernel's: a memfd's memory is freed with its last descriptor and mapping, so a
trainer that exits or crashes leaves nothing behind once the daemon has dropped its mappings
(:meth:`PeerSegments.close`, when the rank leaves or its process is gone); nothing is ever
created under ``/dev/shm``. Reaching another process's descriptors needs what ``ptrace``'s read
check needs: the daemon runs as the trainers' user (or with ``CAP_SYS_PTRACE``), the trainers
are dumpable, and ``/proc`` shows them (no ``hidepid`` for another user). :class:`PeerSegments`
checks that at HELLO and says what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import stat

import numpy as np
from gradlane.transport.errors import ConfigError, GradlaneError

__all__ = ["PeerSegments", "Segment", "SegmentError", "SegmentFile", "check_name"]

#: Every gradlane segment name: a fixed prefix, then safe characters only (no '/', no '..').
_NAME = re.compile(r"gradlane-[A-Za-z0-9_.-]{1,200}\Z")
# Linux's values (linux/fcntl.h): fcntl names them on Linux only, and this module must import
# everywhere (a memfd is then refused when it is created or reached, with a message).
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_SEAL_SEAL, _SEAL_SHRINK, _SEAL_GROW, _SEAL_WRITE, _SEAL_FUTURE_WRITE = 0x1, 0x2, 0x4, 0x8, 0x10
#: The seals a segment must carry: no shrinking, and no change to the seals from now on.
REQUIRED_SEALS = _SEAL_SHRINK | _SEAL_SEAL
#: Seals that would make the daemon's write-back fail.
_WRITE_SEALS = _SEAL_WRITE | _SEAL_FUTURE_WRITE


class SegmentError(GradlaneError):
    """A segment could not be created, reached, verified or used (names it and says why)."""


def check_name(name: str) -> str:
    """``name`` if it is a valid segment name, else :class:`SegmentError`."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise SegmentError(f"{name!r} is not a gradlane shared-memory segment name")
    return name


class Segment:
    """One of this process's segments: a sealed memfd of ``size`` bytes, mapped read-write.

    Its descriptor :attr:`fd` stays open until :meth:`close`: the daemon reaches the segment
    through it (``/proc/<pid>/fd/<fd>``), and the memory lives until it and every mapping are
    gone.
    """

    def __init__(self, name: str, size: int, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._fd: int | None = fd
        self._mm: mmap.mmap | None = mm

    @property
    def fd(self) -> int:
        """The segment's descriptor in this process (what a SUBMIT names)."""
        if self._fd is None:
            raise SegmentError(f"segment {self.name} is closed")
        return self._fd

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create, seal and map a new segment of ``size`` bytes (> 0), mode 0600."""
        check_name(name)
        if size <= 0:
            raise ConfigError(f"segment {name}: size {size} must be > 0")
        try:
            fd = os.memfd_create(name, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        except (AttributeError, OSError) as e:  # AttributeError: not Linux
            raise SegmentError(
                f"cannot create shared memory {name}: daemon mode needs Linux memfd_create "
                f"with sealing ({e})"
            ) from None
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, _F_ADD_SEALS, REQUIRED_SEALS | _SEAL_GROW)
            mm = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            raise SegmentError(
                f"cannot size and seal shared memory {name} ({size} B): {e}"
            ) from None
        return cls(name, size, fd, mm)

    def array(self, dtype: np.dtype | type, count: int, offset: int = 0) -> np.ndarray:
        """A 1-D view of ``count`` elements at byte ``offset`` (bounds checked)."""
        if self._mm is None:
            raise SegmentError(f"segment {self.name} is closed")
        return _view(self._mm, self.name, self.size, dtype, count, offset)

    def close(self) -> None:
        """Unmap and close the descriptor (views still alive keep the mapping until they are
        gone; the daemon's mapping keeps the memory until it drops it). Idempotent."""
        fd, self._fd = self._fd, None
        mm, self._mm = self._mm, None
        if fd is not None:
            os.close(fd)
        if mm is not None:
            # A NumPy view still alive keeps the map: the GC unmaps it with the last view.
            with contextlib.suppress(BufferError):
                mm.close()


class SegmentFile:
    """A trainer's segment as the daemon maps it: opened through the trainer's descriptor,
    verified (see the module's docstring), mapped; no descriptor is kept.

    :meth:`view` refuses, with a :class:`SegmentError`, any range the mapping does not cover;
    the seal guarantees the file keeps covering the mapping.
    """

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm: mmap.mmap | None = mm
        self.mapped = len(mm)
        """Bytes mapped (the segment's size)."""

    @classmethod
    def open(cls, proc_dir: int, pid: int, fd: int, name: str, min_size: int = 1) -> SegmentFile:
        """Map descriptor ``fd`` of process ``pid`` (``proc_dir``: its open ``/proc/<pid>``),
        which must be the sealed memfd ``name`` of the daemon's user holding at least
        ``min_size`` bytes; else :class:`SegmentError` saying which check failed."""
        check_name(name)
        where = f"descriptor {fd} of trainer pid {pid}"
        try:
            # O_PATH: a device, FIFO or socket at that number is looked at, never opened.
            path_fd = os.open(f"fd/{fd}", os.O_PATH | os.O_CLOEXEC, dir_fd=proc_dir)
        except FileNotFoundError:
            raise SegmentError(f"{where} does not exist (segment {name})") from None
        except ProcessLookupError:
            raise SegmentError(f"trainer pid {pid} has exited (segment {name})") from None
        except OSError as e:
            raise SegmentError(f"cannot reach {where}: {e.strerror}") from None
        try:
            st = os.fstat(path_fd)
            link = os.readlink(f"/proc/self/fd/{path_fd}")
            shown = _clip(link)  # a path the trainer chose: it goes into the reply
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"{where} is not a memfd ({shown})")
            if st.st_uid != os.geteuid():
                raise SegmentError(
                    f"{where} ({shown}) belongs to uid {st.st_uid}, the daemon runs as uid "
                    f"{os.geteuid()}"
                )
            if link != f"/memfd:{name} (deleted)":
                raise SegmentError(f"{where} is {shown!r}, not the memfd {name!r}")
            rw = os.open(f"/proc/self/fd/{path_fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise SegmentError(f"cannot open {where} ({name}): {e.strerror}") from None
        finally:
            os.close(path_fd)
        try:
            return cls(name, _map_sealed(rw, f"{where} ({name})", min_size))
        finally:
            os.close(rw)

    def view(self, dtype: np.dtype | type, count: int, offset: int = 0) -> np.ndarray:
        """A 1-D view of ``count`` elements at byte ``offset`` (bounds checked)."""
        mm = self._mm
        if mm is None:
            raise SegmentError(
                f"segment {self.name} was released (its trainer left or replaced it)"
            )
        return _view(mm, self.name, self.mapped, dtype, count, offset)

    def close(self) -> None:
        """Unmap (views still alive keep the mapping until they are gone). Idempotent."""
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()


class PeerSegments:
    """The segments of one trainer process as the daemon reaches them: its ``/proc/<pid>``
    directory, held open, and the segments mapped so far, by name.

    Opening checks that the daemon may read the process's descriptors (:class:`SegmentError`
    saying what is needed if not). Holding the directory ties every later lookup to that
    process: once it has exited, lookups fail even if its pid is reused.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._segments: dict[str, SegmentFile] = {}
        try:
            self._dir: int | None = os.open(
                f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
            )
        except OSError as e:
            raise SegmentError(_unreachable(pid, e)) from None
        try:
            _probe(self._dir)
        except OSError as e:
            self.close()
            raise SegmentError(_unreachable(pid, e)) from None

    def get(self, name: str, fd: int, nbytes: int) -> SegmentFile:
        """The segment ``name`` (descriptor ``fd`` in the trainer) holding at least ``nbytes``:
        mapped on its first use, then reused (the seal keeps it whole)."""
        if self._dir is None:
            raise SegmentError(f"the segments of trainer pid {self.pid} were released")
        seg = self._segments.get(name)
        if seg is not None and seg.mapped >= nbytes:
            return seg
        # Names are <prefix>b<bucket>.<index>-<serial>: a new serial replaces that slot's
        # older segment (the trainer grew it), so drop the old mapping (and one too small).
        base = name.rsplit("-", 1)[0]
        for old in [n for n in self._segments if n.rsplit("-", 1)[0] == base]:
            self._segments.pop(old).close()
        seg = self._segments[name] = SegmentFile.open(self._dir, self.pid, fd, name, nbytes)
        return seg

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._dir is None

    def alive(self) -> bool:
        """Whether the process still exists (a zombie does, until its parent reaps it)."""
        if self._dir is None:
            return False
        try:
            os.stat("fd", dir_fd=self._dir)
        except OSError:  # ESRCH once the process is gone
            return False
        return True

    def close(self) -> None:
        """Unmap every segment and close the directory (the trainer's memory is freed when it
        drops its own descriptors and mappings). Idempotent."""
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        d, self._dir = self._dir, None
        if d is not None:
            os.close(d)


def _view(
    mm: mmap.mmap, name: str, size: int, dtype: np.dtype | type, count: int, offset: int
) -> np.ndarray:
    dt = np.dtype(dtype)
    if offset < 0 or count < 0 or offset % dt.itemsize or offset + count * dt.itemsize > size:
        raise SegmentError(
            f"segment {name} ({size} B): {count} x {dt.name} at offset {offset} does not fit"
        )
    return np.frombuffer(mm, dtype=dt, count=count, offset=offset)


def _clip(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis says it was cut)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _map_sealed(fd: int, what: str, min_size: int) -> mmap.mmap:
    """Map ``fd`` read-write after checking its seals (read first: the size checked after them
    can no longer shrink)."""
    try:
        seals = fcntl.fcntl(fd, _F_GET_SEALS)
    except OSError:  # EINVAL: a file system without seals
        raise SegmentError(f"{what} is not a memfd (it cannot be sealed)") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise SegmentError(
            f"{what} is not sealed against shrinking (F_SEAL_SHRINK and F_SEAL_SEAL needed, "
            f"seals are {seals:#x}): a truncate during the copy would kill the daemon"
        )
    if seals & _WRITE_SEALS:
        raise SegmentError(f"{what} is sealed against writing (seals {seals:#x})")
    size = os.fstat(fd).st_size
    if size < max(min_size, 1):
        raise SegmentError(f"{what} holds {size} B, {max(min_size, 1)} B needed")
    try:
        return mmap.mmap(fd, size)
    except (OSError, ValueError) as e:
        raise SegmentError(f"cannot map {what}: {e}") from None


def _probe(proc_dir: int) -> None:
    """Read one descriptor link of the process: the check ``/proc/<pid>/fd/<n>`` applies."""
    fds = os.open("fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc_dir)
    try:
        for entry in os.listdir(fds):
            with contextlib.suppress(FileNotFoundError):  # closed meanwhile: try the next
                os.readlink(entry, dir_fd=fds)
                return
    finally:
        os.close(fds)


def _unreachable(pid: int, e: OSError) -> str:
    if isinstance(e, (FileNotFoundError, ProcessLookupError)):
        return (
            f"trainer pid {pid} is not visible in /proc (it exited, or /proc is mounted with "
            "hidepid and it runs as another user): run the daemon as the trainers' user, in "
            "their pid namespace or a parent of it"
        )
    return (
        f"the daemon (uid {os.geteuid()}) cannot read the descriptors of trainer pid {pid} "
        f"(/proc/{pid}/fd: {e.strerror}); its shared-memory segments are reached there: run "
        "the daemon as the trainers' user (or with CAP_SYS_PTRACE), keep the trainers dumpable "
        "(no prctl(PR_SET_DUMPABLE, 0)), and check that no security module forbids it"
    )
