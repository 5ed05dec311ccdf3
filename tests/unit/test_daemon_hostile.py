"""Hostile IPC bodies and hostile segments, at the parts: every body decodes or raises an
IpcError whose REJECT answer can always be built; a segment's owner cannot shrink it, and any
descriptor that is not a sealed memfd of the daemon's user is refused with a SegmentError that
says why, before it is mapped."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.shm import PeerSegments, Segment, SegmentError
from hypothesis import given, settings
from hypothesis import strategies as st

HELLO = {"job": 1, "rank": 0, "world": 2, "local_rank": 0, "local_world": 2, "pid": 1}


def _with(raw_rank: str) -> bytes:
    """A HELLO body whose ``rank`` is the raw JSON text ``raw_rank``."""
    body = json.dumps({**HELLO, "rank": 0})
    return body.replace('"rank": 0', f'"rank": {raw_rank}').encode()


#: (body, reason) for the bodies that killed the daemon, and a few of their relatives.
HOSTILE = [
    (json.dumps({**HELLO, "k" * 5000: 1}).encode(), "bad_field"),
    (json.dumps({**HELLO, "rank": "s" * 5000}).encode(), "bad_field"),
    (json.dumps({**HELLO, "rank": list(range(3000))}).encode(), "bad_field"),
    (json.dumps({**HELLO, "rank": {str(i): "x" * 100 for i in range(300)}}).encode(), "bad_field"),
    (_with("9" * 5000), "malformed"),
    (_with("1" + "0" * 400), "bad_field"),
    (_with("[" * 2000 + "]" * 2000), "malformed"),
    (_with('{"a":' * 2000 + "1" + "}" * 2000), "malformed"),
    (b"[" * 30_000, "malformed"),
    (_with("NaN"), "malformed"),
    (_with("-Infinity"), "malformed"),
    (_with("1e999"), "bad_field"),
]


@pytest.mark.parametrize(("body", "why"), HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_are_typed_errors_whose_reject_fits(body: bytes, why: str):
    with pytest.raises(ipc.IpcError) as info:
        ipc.decode([b"HELLO", body])
    e = info.value
    assert e.why == why, e
    assert len(e.detail) <= ipc.MAX_DETAIL
    ipc.encode("REJECT", reason=e.why, detail=e.detail)  # the answer can always be built


def test_nesting_is_limited_but_brackets_in_strings_do_not_count():
    deep = {"a": 1}
    for _ in range(ipc.MAX_DEPTH - 2):  # with the body itself: MAX_DEPTH deep
        deep = {"a": deep}
    with pytest.raises(ipc.IpcError, match="bad_field"):  # parsed, then refused by the schema
        ipc.decode([b"HELLO", json.dumps({**HELLO, "rank": deep}).encode()])
    with pytest.raises(ipc.IpcError, match=f"nests {ipc.MAX_DEPTH + 1} deep"):
        ipc.decode([b"HELLO", json.dumps({**HELLO, "rank": {"a": deep}}).encode()])
    brackets = json.dumps({**HELLO, "rank": '[{"\\"' * 500})
    with pytest.raises(ipc.IpcError, match=r"bad_field: HELLO.rank='\[\{"):
        ipc.decode([b"HELLO", brackets.encode()])


def test_details_are_clipped():
    assert len(ipc.IpcError("malformed", "x" * 100_000).detail) == ipc.MAX_DETAIL
    assert ipc.clip("short") == "short"
    assert len(ipc.short(list(range(10_000)))) < 100
    assert "bits" in ipc.short(1 << 4000)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
        lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=20), kids),
        max_leaves=40,
    )
)
def test_any_json_value_in_a_field_decodes_or_raises_an_answerable_error(value: object):
    body = json.dumps({**HELLO, "rank": value}).encode()
    try:
        ipc.decode([b"HELLO", body])
    except ipc.IpcError as e:
        assert e.why in ipc.REASONS
        ipc.encode("REJECT", reason=e.why, detail=e.detail)


# -- segments the daemon does not own -------------------------------------------------------------
#: What every segment carries (:meth:`Segment.create`).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: A descriptor number this process does not hold (far above any soft RLIMIT_NOFILE).
NO_FD = 0x7FFFFFFF
WAIT_S = 60.0


def _name(what: str) -> str:
    return f"gradlane-test-{os.getpid()}-{what}"


@pytest.fixture
def peer() -> Iterator[PeerSegments]:
    """This process seen as a trainer by a daemon (it plays both: /proc/<own pid>/fd)."""
    p = PeerSegments(os.getpid())
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def opened() -> Iterator[list[int]]:
    """Descriptors a test opens; closed also when it fails."""
    fds: list[int] = []
    try:
        yield fds
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def test_the_owner_cannot_shrink_grow_or_reseal_its_segment():
    seg = Segment.create(_name("sealed"), 4096)
    try:
        assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 100)
        with pytest.raises(PermissionError):  # another open file of the same memory
            os.truncate(f"/proc/self/fd/{seg.fd}", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 8192)
        with pytest.raises(PermissionError):  # F_SEAL_SEAL: the seals are final
            fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(seg.fd).st_size == 4096
    finally:
        seg.close()


def test_the_daemon_maps_a_sealed_segment_once_and_shares_its_memory(peer: PeerSegments):
    seg = Segment.create(_name("b0.0-1"), 4096)
    grown = None
    try:
        seg.array(np.float32, 1024)[:] = np.arange(1024, dtype=np.float32)
        f = peer.get(seg.name, seg.fd, 4096)
        assert peer.get(seg.name, seg.fd, 4096) is f  # mapped on its first use only
        np.testing.assert_array_equal(
            f.view(np.float32, 512, 2048), np.arange(512, 1024, dtype=np.float32)
        )
        np.copyto(f.view(np.float32, 512, 0), np.full(512, 7.0, dtype=np.float32))
        assert (seg.array(np.float32, 512) == 7.0).all()
        with pytest.raises(SegmentError, match="does not fit"):
            f.view(np.float32, 1025, 0)  # past the segment
        with pytest.raises(SegmentError, match="does not fit"):
            f.view(np.float32, 4, 2)  # misaligned
        seg.close()  # the trainer drops it: the daemon's mapping keeps the memory
        assert f.view(np.float32, 1, 0)[0] == 7.0
        grown = Segment.create(_name("b0.0-2"), 8192)  # a new serial replaces the old one
        assert peer.get(grown.name, grown.fd, 8192).mapped == 8192
        with pytest.raises(SegmentError, match="released"):
            f.view(np.float32, 1, 0)
    finally:
        seg.close()
        if grown is not None:
            grown.close()


def _memfd(opened: list[int], seals: int, sealing: bool = True) -> tuple[int, str]:
    name = _name("b1.0-1")
    fd = os.memfd_create(name, (os.MFD_ALLOW_SEALING if sealing else 0) | os.MFD_CLOEXEC)
    opened.append(fd)
    os.ftruncate(fd, 4096)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd, name


def _missing(opened: list[int]) -> tuple[int, str, str]:
    return NO_FD, _name("b1.0-1"), f"descriptor {NO_FD} of trainer pid {os.getpid()} does not"


def _unsealed(opened: list[int]) -> tuple[int, str, str]:
    return (*_memfd(opened, 0), "not sealed against shrinking")


def _not_sealable(opened: list[int]) -> tuple[int, str, str]:
    return (*_memfd(opened, 0, sealing=False), r"not sealed against shrinking \(.* 0x1\)")


def _seals_not_final(opened: list[int]) -> tuple[int, str, str]:
    return (*_memfd(opened, fcntl.F_SEAL_SHRINK), "F_SEAL_SEAL needed")


def _write_sealed(opened: list[int]) -> tuple[int, str, str]:
    return (*_memfd(opened, SEALS | fcntl.F_SEAL_WRITE), "sealed against writing")


def _too_small(opened: list[int]) -> tuple[int, str, str]:
    fd, name = _memfd(opened, 0)
    os.ftruncate(fd, 64)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd, name, "holds 64 B, 4096 B needed"


def _wrong_name(opened: list[int]) -> tuple[int, str, str]:
    fd, name = _memfd(opened, SEALS)
    return fd, _name("b2.0-1"), f"is '/memfd:{name} \\(deleted\\)', not the memfd"


def _tmpfs_file(opened: list[int]) -> tuple[int, str, str]:
    """A plain file in /dev/shm, unlinked: shared memory its owner may truncate."""
    path = os.path.join("/dev/shm", _name("b1.0-1"))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    opened.append(fd)
    os.unlink(path)
    os.ftruncate(fd, 4096)
    return fd, os.path.basename(path), "not the memfd"


def _pipe(opened: list[int]) -> tuple[int, str, str]:
    r, w = os.pipe()
    opened += [r, w]
    return r, _name("b1.0-1"), r"is not a memfd \(pipe:"


REFUSED = [_missing, _unsealed, _not_sealable, _seals_not_final, _write_sealed, _too_small,
           _wrong_name, _tmpfs_file, _pipe]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=[c.__name__.strip("_") for c in REFUSED])
def test_a_descriptor_that_is_not_a_sealed_memfd_is_refused_by_why(
    peer: PeerSegments, opened: list[int], case: Callable[[list[int]], tuple[int, str, str]]
):
    fd, name, why = case(opened)
    with pytest.raises(SegmentError, match=why):
        peer.get(name, fd, 4096)
    seg = Segment.create(_name("b1.0-2"), 4096)  # refused ones were not kept: a sound one maps
    try:
        assert peer.get(seg.name, seg.fd, 4096).mapped == 4096
    finally:
        seg.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a memfd to another uid needs root")
def test_a_segment_of_another_user_is_refused(peer: PeerSegments, opened: list[int]):
    fd, name = _memfd(opened, SEALS)
    os.fchown(fd, 65534, 65534)
    with pytest.raises(SegmentError, match="belongs to uid 65534, the daemon runs as uid 0"):
        peer.get(name, fd, 4096)


def test_a_trainer_that_exited_is_reached_no_more():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)  # fmt: skip
    peer = None
    try:
        peer = PeerSegments(p.pid)
        assert peer.alive()
        assert p.stdin is not None
        p.stdin.close()
        p.wait(WAIT_S)
        assert not peer.alive()  # the directory held open names that process, not its pid
        with pytest.raises(SegmentError, match=f"trainer pid {p.pid} has exited"):
            peer.get(_name("b0.0-1"), 0, 8)
        with pytest.raises(SegmentError, match="not visible in /proc"):
            PeerSegments(p.pid)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(WAIT_S)
        if peer is not None:
            peer.close()
    assert peer.closed and not peer.alive()
    with pytest.raises(SegmentError, match="released"):
        peer.get(_name("b0.0-1"), 0, 8)


@pytest.mark.skipif(os.geteuid() != 0, reason="running a daemon as another user needs root")
def test_a_daemon_that_cannot_read_the_trainers_descriptors_says_what_is_needed():
    # The "daemon" drops to nobody after its imports; this process (root) is the trainer.
    code = (
        "import os, sys\n"
        "from gradlane.transport.daemon.shm import PeerSegments, SegmentError\n"
        "os.setgid(65534)\n"
        "os.setuid(65534)\n"
        "try:\n"
        "    PeerSegments(int(sys.argv[1]))\n"
        "except SegmentError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True,
                         text=True, timeout=WAIT_S, check=True)  # fmt: skip
    assert f"cannot read the descriptors of trainer pid {os.getpid()}" in out.stdout, out
    assert "run the daemon as the trainers' user" in out.stdout
