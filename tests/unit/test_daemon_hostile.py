"""Hostile IPC bodies and hostile segments, at the parts: every body decodes or raises an
IpcError whose REJECT answer can always be built, and a segment its owner truncated makes a
copy fail with a SegmentError, never a fault."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gradlane.transport.daemon import messages as ipc
from gradlane.transport.daemon.shm import SHM_DIR, Segment, SegmentError, SegmentFile
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
@pytest.fixture
def segment():
    seg = Segment.create(f"gradlane-test-{os.getpid()}-hostile", 4096)
    seg.array(np.float32, 1024)[:] = np.arange(1024, dtype=np.float32)
    seg.close()  # this process must not touch a mapping of a file it is about to truncate
    try:
        yield seg
    finally:
        seg.unlink()


def test_a_segment_file_checks_the_file_before_every_view(segment: Segment):
    f = SegmentFile.open(segment.name, 4096)
    try:
        out = f.view(np.float32, 512, 2048)
        np.testing.assert_array_equal(out, np.arange(512, 1024, dtype=np.float32))
        np.copyto(f.view(np.float32, 512, 0), np.full(512, 7.0, dtype=np.float32))
        assert (f.view(np.float32, 512, 0) == 7.0).all()
        with pytest.raises(SegmentError, match="does not fit"):
            f.view(np.float32, 1025, 0)  # past what is mapped
        with pytest.raises(SegmentError, match="does not fit"):
            f.view(np.float32, 4, 2)  # misaligned
    finally:
        del out
        f.close()
    with pytest.raises(SegmentError, match="closed"):
        f.view(np.float32, 4, 0)
    f.close()  # idempotent


def test_a_truncated_segment_is_refused_before_it_is_touched(segment: Segment):
    f = SegmentFile.open(segment.name, 4096)
    try:
        os.truncate(segment.path, 1000)
        # A view past the new end would fault (SIGBUS) when read: it is refused instead.
        with pytest.raises(SegmentError, match="truncated by its owner to 1000 B; 4096 B"):
            f.view(np.float32, 1024, 0)
        assert f.view(np.float32, 250, 0).shape == (250,)  # what the file still holds is fine
        with pytest.raises(SegmentError, match="holds 1000 B"):
            SegmentFile.open(segment.name, 4096)
    finally:
        f.close()


def test_a_segment_name_that_is_not_a_plain_file_is_refused():
    path = os.path.join(SHM_DIR, f"gradlane-test-{os.getpid()}-fifo")
    os.mkfifo(path, 0o600)
    try:
        with pytest.raises(SegmentError, match="not a plain file"):
            SegmentFile.open(os.path.basename(path))
    finally:
        os.unlink(path)
