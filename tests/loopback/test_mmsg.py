"""Linux's batched UDP calls (``sendmmsg`` / ``recvmmsg``) on real loopback sockets: bytes,
lengths and truncation exactly as one call per datagram gives them; and an engine without them
(the one-call-per-datagram path every other platform uses) all-reduces exactly too."""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from gradlane.transport.config import TransportConfig
from gradlane.transport.core.events import DatagramRun
from gradlane.transport.drivers.peers import StaticPeers
from gradlane.transport.drivers.udp import mmsg as _mmsg
from gradlane.transport.drivers.udp import sockets as udp
from gradlane.transport.drivers.udp.plane import UdpPlane

pytestmark = pytest.mark.skipif(not _mmsg.AVAILABLE, reason="sendmmsg/recvmmsg: Linux only")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        tx.bind(("127.0.0.1", 0))
        tx.setblocking(False)
        yield rx, tx
    finally:
        rx.close()
        tx.close()


_IP_RECVTOS = int(getattr(socket, "IP_RECVTOS", 13))


_SO_NO_CHECK = 11  # asm-generic/socket.h: a UDP socket sends no checksums (and no GSO)


def _two_path_receivers() -> list[socket.socket]:
    """A bound UDP socket on each loopback path address (127.0.0.1, 127.0.0.2), 5 s timeout."""
    peers = []
    for host in ("127.0.0.1", "127.0.0.2"):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((host, 0))
        s.settimeout(5)
        peers.append(s)
    return peers


def _kilobyte_run(
    n: int, seed: int, paths: np.ndarray, last: int | None = None
) -> tuple[DatagramRun, list[bytes]]:
    """A run of ``n`` datagrams to peer 0 (TOS 0): random 48-byte headers and 1000-byte
    payloads (the last ``last`` bytes long, if given) on ``paths``; and each one's bytes."""
    hb = 48
    rng = np.random.default_rng(seed)
    hdr = rng.integers(0, 256, (n, hb), dtype=np.uint8)
    payload = rng.integers(0, 256, n * 1000, dtype=np.uint8)
    chunks = np.arange(n, dtype=np.int64)
    sizes = np.full(n, 1000, dtype=np.int64)
    if last is not None:
        sizes[-1] = last
    run = DatagramRun(hdr.reshape(-1).data, hb, payload.data, chunks, chunks * 1000, sizes, 0,
                      paths, 0)  # fmt: skip
    want = [hdr[c].tobytes() + payload[c * 1000 : c * 1000 + int(sizes[c])].tobytes()
            for c in range(n)]  # fmt: skip
    return run, want


def _gso_here() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return _mmsg.gso_supported(s)


def _recv_tos(sock: socket.socket, size: int = 70000) -> tuple[bytes, int]:
    """One datagram and the TOS byte it arrived with (the socket has IP_RECVTOS set)."""
    data, anc, _, _ = sock.recvmsg(size, socket.CMSG_SPACE(4))
    tos = [c[2][0] for c in anc if c[0] == socket.IPPROTO_IP and c[1] == socket.IP_TOS]
    assert len(tos) == 1, anc
    return data, tos[0]


def _pairs(*arrays: np.ndarray) -> np.ndarray:
    """(address, length) rows of byte arrays, as SendBatch.append takes names and controls."""
    return np.array([(a.ctypes.data, a.shape[0]) for a in arrays], dtype=np.uint64)


def test_a_run_goes_out_and_comes_back_byte_for_byte(pair):
    rx, tx = pair
    rx.setsockopt(socket.IPPROTO_IP, _IP_RECVTOS, 1)
    rng = np.random.default_rng(1)
    n, hb = 40, 48
    hdr = rng.integers(0, 256, (n, hb), dtype=np.uint8)
    sizes = rng.integers(0, 3000, n).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    payload = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    order = rng.permutation(n)  # rows in any order, as a sender's run picks chunks
    batch = _mmsg.SendBatch(1, capacity=4)  # grows to fit
    name, ctl = _mmsg.sockaddr(rx.getsockname()), _mmsg.tos_cmsg(0xB8, v6=False)
    rows = _mmsg.RunRows(
        hdr.ctypes.data,
        hb,
        order,
        payload.ctypes.data,
        starts[order],
        sizes[order],
        np.zeros(n, dtype=np.int64),
    )
    assert batch.append(0, rows, _pairs(name), _pairs(ctl))
    assert batch.fill.tolist() == [n] and batch.nbytes.tolist() == [n * hb + int(sizes.sum())]
    sent, err = batch.send(tx.fileno(), 0, 0, n)
    assert (sent, err) == (n, 0)
    for c in order.tolist():  # every datagram byte for byte, marked with the control's TOS
        a, b = int(starts[c]), int(starts[c] + sizes[c])
        assert _recv_tos(rx) == (hdr[c].tobytes() + payload[a:b].tobytes(), 0xB8)
    tx.sendto(b"again", rx.getsockname())  # a plain send after it: the socket's own TOS (0)
    assert _recv_tos(rx) == (b"again", 0)


def test_recvmmsg_fills_rows_from_any_offset(pair):
    rx, tx = pair
    sizes = [0, 1, 48, 3000, 4096]
    for k in sizes:
        tx.sendto(bytes([k % 251]) * k, rx.getsockname())
    arena = np.zeros((64, 4096), dtype=np.uint8)
    got = _mmsg.RecvTable(arena)
    lengths, err = got.receive(rx.fileno(), 3, 64 - 3)
    assert err == 0 and lengths.tolist() == sizes
    for i, k in enumerate(sizes):
        assert arena[3 + i, :k].tobytes() == bytes([k % 251]) * k
    # Nothing left: an empty answer, not an error.
    lengths, err = got.receive(rx.fileno(), 0, 8)
    assert lengths.size == 0 and err == 0


def test_runs_are_appended_per_path_in_run_order():
    """append() puts each datagram after the rows of its path, in run order, with its header
    and payload addresses, its path's destination and control message, and which run and
    datagram it is; per-path byte counts add up; growing keeps the rows laid out before; a
    path outside the tables lays out nothing."""
    rng = np.random.default_rng(2)
    hb, n_paths = 48, 4
    batch = _mmsg.SendBatch(n_paths, capacity=8)
    names = np.arange(2 * n_paths, dtype=np.uint64).reshape(n_paths, 2) + 100
    runs = []
    for run_id in range(3):
        n = int(rng.integers(50, 200))
        chunks = rng.permutation(n)
        starts = rng.integers(0, 10**6, n).astype(np.int64)
        sizes = rng.integers(1, 65000, n).astype(np.int64)
        paths = rng.integers(0, 3, n).astype(np.int64)
        paths[paths == 1] = 2  # a path with no datagram
        controls = np.full((n_paths, 2), 7000 + run_id, dtype=np.uint64)
        rows = _mmsg.RunRows(1000 * run_id, hb, chunks, 5000, starts, sizes, paths)
        assert batch.append(run_id, rows, names, controls)
        runs.append((chunks, starts, sizes, paths))
    for q in range(n_paths):
        want = [(r, i) for r, (_, _, _, p) in enumerate(runs) for i in np.flatnonzero(p == q)]
        k = int(batch.fill[q])
        assert k == len(want)
        assert list(zip(batch.run[q, :k].tolist(), batch.order[q, :k].tolist(), strict=True)) == [
            (r, int(i)) for r, i in want
        ]
        iov = batch.iov[q, :k]
        for row, (r, i) in enumerate(want):
            chunks, starts, sizes, _ = runs[r]
            assert iov[row].tolist() == [
                [1000 * r + int(chunks[i]) * hb, hb],
                [5000 + int(starts[i]), int(sizes[i])],
            ]
            m = batch.msgs[q, row]
            assert (m["name"], m["namelen"]) == (100 + 2 * q, 101 + 2 * q)
            assert (m["control"], m["controllen"]) == (7000 + r, 7000 + r)
            assert m["iov"] == batch.iov[q, row].ctypes.data and m["iovlen"] == 2
        assert int(batch.nbytes[q]) == k * hb + sum(int(runs[r][2][i]) for r, i in want)
        assert batch.row_bytes(q, 0, k) == int(batch.nbytes[q])
    before = batch.fill.copy()
    bad = np.array([0, n_paths], dtype=np.int64)
    z = np.zeros(2, dtype=np.int64)
    assert not batch.append(9, _mmsg.RunRows(0, hb, z, 0, z, z, bad), names, names)
    assert batch.fill.tolist() == before.tolist()
    batch.clear()
    assert batch.fill.tolist() == [0] * n_paths and batch.nbytes.tolist() == [0] * n_paths


def test_gso_messages_hold_equal_sized_datagrams_of_one_run():
    """On a GSO path, a run's datagrams share a message while they have its first one's size (a
    shorter one ends it), up to the segment and byte limits; another run, or a larger
    datagram, starts a new message; a path without GSO keeps one datagram per message. Each
    GSO message points at its datagrams' consecutive iovecs and at a control area holding the
    run's TOS and the segment size; pointers stay right when the tables grow mid-pass."""
    hb = 48
    batch = _mmsg.SendBatch(2, capacity=8)  # grows during the first run
    batch.gso[:] = [True, False]
    names = np.array([[100, 16], [200, 16]], dtype=np.uint64)
    controls = np.array([[300, 24], [400, 24]], dtype=np.uint64)
    tpl = np.stack([_mmsg.gso_control(0xB8, False), _mmsg.gso_control(0xB8, False)])
    sizes0 = np.array([1000] * 30 + [500] + [1000] * 69 + [1000, 1200], dtype=np.int64)
    n0 = sizes0.shape[0]
    paths0 = np.zeros(n0, dtype=np.int64)
    paths0[-2:] = [1, 0]  # one datagram on the path without GSO; a larger one ends a message
    starts0 = np.arange(n0, dtype=np.int64) * 2000
    chunks0 = np.arange(n0, dtype=np.int64)
    rows0 = _mmsg.RunRows(10**6, hb, chunks0, 10**7, starts0, sizes0, paths0)
    assert batch.append(0, rows0, names, controls, tpl)
    sizes1 = np.full(3, 1000, dtype=np.int64)
    z3 = np.zeros(3, dtype=np.int64)
    rows1 = _mmsg.RunRows(10**6, hb, z3, 10**7, z3, sizes1, z3)
    assert batch.append(1, rows1, names, controls, tpl)
    # Path 0: 30 full + the short one; 62 full (63 would pass 65507 bytes); the last 7; the
    # 1200 alone (larger than the message's size); then run 1's three in a message of their own.
    assert batch.fill.tolist() == [5, 1]
    assert batch.count[0, :5].tolist() == [31, 62, 7, 1, 3]
    assert batch.run[0, :5].tolist() == [0, 0, 0, 0, 1]
    assert batch.row_datagrams(0, 0, 5) == n0 - 1 + 3
    assert batch.row_bytes(0, 0, 5) + batch.row_bytes(1, 0, 1) == int(batch.nbytes.sum())
    assert int(batch.nbytes.sum()) == (n0 + 3) * hb + int(sizes0.sum() + sizes1.sum())
    assert batch.row_order(0, 1).tolist() == list(range(31, 93))
    assert batch.row_order(1, 0).tolist() == [n0 - 2]
    ctl_len = _mmsg.GSO_CONTROL_BYTES
    for r, seg in enumerate([1048, 1048, 1048, 1248, 1048]):
        m = batch.msgs[0, r]
        k = int(batch.count[0, r])
        a = int(batch.slot0[0, r])
        assert m["iov"] == batch.iov[0, a].ctypes.data and m["iovlen"] == 2 * k
        assert (m["name"], m["namelen"]) == (100, 16)
        if k == 1:
            assert (m["control"], m["controllen"]) == (300, 24)
            continue
        assert (m["control"], m["controllen"]) == (batch.ctl[0, r].ctypes.data, ctl_len)
        ctl = batch.ctl[0, r]
        assert ctl[:24].tobytes() == _mmsg.tos_cmsg(0xB8, False).tobytes()
        assert ctl[24:40].tobytes() == struct.pack("<Qii", 18, 17, 103)  # SOL_UDP, UDP_SEGMENT
        assert int.from_bytes(ctl[40:42].tobytes(), "little") == seg
        first = batch.order[0, a]
        assert batch.iov[0, a].tolist() == [
            [10**6 + int(chunks0[first]) * hb if r < 4 else 10**6, hb],
            [10**7 + (int(starts0[first]) if r < 4 else 0), 1000 if r != 3 else 1200],
        ]
    m = batch.msgs[1, 0]
    assert m["iovlen"] == 2 and (m["control"], m["controllen"]) == (400, 24)
    small = np.full(130, 52, dtype=np.int64)  # 100-byte datagrams: the segment limit binds
    z = np.zeros(130, dtype=np.int64)
    assert batch.append(2, _mmsg.RunRows(0, hb, z, 0, z, small, z), names, controls, tpl)
    assert batch.count[0, 5:8].tolist() == [_mmsg.GSO_MAX_SEGMENTS, _mmsg.GSO_MAX_SEGMENTS, 2]
    batch.clear()
    assert batch.fill.tolist() == [0, 0] and batch.slots.tolist() == [0, 0]


def test_gro_table_finds_segment_sizes_and_splits_messages_across_calls():
    """The UDP_GRO control message is found among others (or missing: one datagram); a
    message of datagrams of its segment size (the last shorter) is split into arena rows
    across calls as rows run out; a datagram wider than a row is cut and reads as one byte
    longer than the row (the caller's "oversized")."""
    table = _mmsg.GroTable(2)
    other = struct.pack("<Qii", 20, 0, 1) + b"\0" * 8  # an IP_TOS-like one first (CMSG_SPACE 24)
    gro = struct.pack("<QiiI", 20, 17, 104, 100)
    ctl = np.zeros((2, 64), dtype=np.uint8)
    ctl[0, : len(other) + len(gro)] = np.frombuffer(other + gro, dtype=np.uint8)
    lengths = np.array([430, 70], dtype=np.int64)
    controllen = np.array([len(other) + len(gro), 0], dtype=np.int64)
    _mmsg._gro_sizes(lengths, controllen, ctl, table.lengths, table.segments)
    assert table.lengths.tolist() == [430, 70] and table.segments.tolist() == [100, 0]
    table.stage[0, :430] = np.arange(430) % 251
    table.stage[1, :70] = 7
    arena = np.zeros((3, 120), dtype=np.uint8)
    out = np.zeros(3, dtype=np.int64)
    assert table.split(2, 0, 0, arena, 0, out) == (3, 0, 3)
    assert out.tolist() == [100, 100, 100]
    assert [arena[i, :100].tolist() for i in range(3)] == [
        (np.arange(100 * i, 100 * i + 100) % 251).tolist() for i in range(3)
    ]
    assert table.split(2, 0, 3, arena, 0, out) == (3, 2, 0)
    assert out.tolist() == [100, 30, 70]
    assert arena[1, :30].tolist() == (np.arange(400, 430) % 251).tolist()
    assert arena[2, :70].tolist() == [7] * 70
    narrow = np.zeros((8, 50), dtype=np.uint8)
    out = np.zeros(8, dtype=np.int64)
    assert table.split(2, 0, 0, narrow, 2, out) == (6, 2, 0)  # from row 2: 6 rows
    assert out[:6].tolist() == [51, 51, 51, 51, 30, 51]
    assert narrow[2, :50].tolist() == (np.arange(50) % 251).tolist()


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _gso_here(), reason="this kernel has no UDP GSO")
def test_gro_hands_the_arena_every_datagram_of_coalesced_runs():
    """A receiving adapter with GRO gets a GSO sender's runs as coalesced messages and commits
    every datagram into its arena's rows, byte for byte and in order, across arena flushes
    (8 rows for 45 datagrams); a plain datagram in between comes through as itself."""
    import asyncio

    n = 44
    run, want = _kilobyte_run(n, 12, np.zeros(n, dtype=np.int64), last=321)
    got: list[bytes] = []

    class Arena:
        """8 rows; committed rows are kept and the arena emptied when full, as the
        endpoint processes a full batch."""

        rx_arena = np.zeros((8, 1100), dtype=np.uint8)
        rx_free = 0

        def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
            a = self.rx_free
            assert a + len(lengths) <= 8 and path == 0
            got.extend(self.rx_arena[a + i, :k].tobytes() for i, k in enumerate(lengths))
            self.rx_free = 0 if a + len(lengths) == 8 else a + len(lengths)

    async def run_it() -> tuple[udp.UdpCounters, udp.UdpCounters, list[bool]]:
        rx = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                          bufsize=1 << 20, arena=Arena())  # fmt: skip
        tx = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                          bufsize=1 << 20)  # fmt: skip
        try:
            (addr,) = await rx.open([("127.0.0.1", 0)])
            await tx.open([("127.0.0.1", 0)])
            tx.set_peers([[addr]])
            tx.send([run])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as plain:
                plain.sendto(b"plain", addr)
            tx.send([run])
            for _ in range(100):  # every datagram is on the socket already
                if not rx.poll():
                    continue
                if len(got) >= 2 * n + 1:
                    break
            return rx.counters, tx.counters, rx._gro_paths
        finally:
            await rx.wait_closed()
            await tx.wait_closed()

    c, t, flags = asyncio.run(run_it())
    assert flags == [True] and t.gso_sends >= 2
    assert got == [*want, b"plain", *want]
    assert c.rx_datagrams == 2 * n + 1 and c.rx_bytes == sum(map(len, got))
    assert c.gro_messages >= 2 and c.rx_errors == 0


class _TurningArena:
    """An endpoint's receive side that moves to its other arena when a commit fills one, as
    the endpoint does when held early data leaves too few rows: what each commit names is read
    from the arena that was current when the rows were filled."""

    def __init__(self, rows: int, width: int) -> None:
        self.arenas = [np.zeros((rows, width), dtype=np.uint8) for _ in range(2)]
        self.rx_arena = self.arenas[0]
        self.rx_free = 0
        self.got: list[bytes] = []
        self.turns = 0

    def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
        a = self.rx_free
        assert a + len(lengths) <= self.rx_arena.shape[0]
        self.got.extend(self.rx_arena[a + i, :k].tobytes() for i, k in enumerate(lengths))
        self.rx_free = a + len(lengths)
        if self.rx_free == self.rx_arena.shape[0]:  # full: the next rows are another arena's
            self.rx_arena[:] = 0xEE  # what a stale row pointer would read back
            self.rx_arena = self.arenas[self.turns % 2 == 0]
            self.rx_free = 0
            self.turns += 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["recvmmsg", "recv_into", "gro"])
def test_the_read_paths_follow_an_arena_that_changes_with_a_commit(monkeypatch, mode):
    """Within one wakeup's reads, the arena the core hands out may change at each commit (the
    endpoint's held early data moves the next batches to another arena): every path fills the
    rows of the arena current at that moment, so each datagram is committed byte for byte and
    in order, whichever arena its rows are in."""
    import asyncio

    if mode == "gro" and not _gso_here():
        pytest.skip("this kernel has no UDP GSO")
    if mode == "recv_into":
        monkeypatch.setattr(_mmsg, "AVAILABLE", False)
    n = 45
    run, want = _kilobyte_run(n, 21, np.zeros(n, dtype=np.int64), last=123)
    arena = _TurningArena(8, 1100)

    async def go() -> udp.UdpCounters:
        rx = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                          bufsize=1 << 20, arena=arena, gro=mode == "gro")  # fmt: skip
        tx = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                          bufsize=1 << 20, gso=mode == "gro")  # fmt: skip
        try:
            (addr,) = await rx.open([("127.0.0.1", 0)])
            await tx.open([("127.0.0.1", 0)])
            tx.set_peers([[addr]])
            tx.send([run])
            for _ in range(100):  # every datagram is on the socket already
                rx.poll()
                if len(arena.got) >= n:
                    break
            return rx.counters
        finally:
            await rx.wait_closed()
            await tx.wait_closed()

    c = asyncio.run(go())
    assert arena.got == want
    assert arena.turns == n // 8 and c.rx_datagrams == n and c.rx_errors == 0


def test_a_datagram_longer_than_a_row_reads_as_oversized(pair):
    rx, tx = pair
    for size in (100, 5000, 4096):
        tx.sendto(b"x" * size, rx.getsockname())
    table = _mmsg.RecvTable(np.zeros((8, 4096), dtype=np.uint8))
    lengths, err = table.receive(rx.fileno(), 0, 8)
    assert err == 0
    assert lengths.tolist() == [100, 4097, 4096]  # 4097: truncated (the caller's "oversized")


@pytest.mark.timeout(30)
def test_a_run_over_two_paths_reaches_each_and_refused_datagrams_are_counted():
    """The driver sends a run sprayed over two paths with one sendmmsg per path: each peer
    address gets exactly its path's datagrams, byte for byte and in run order; a path whose
    address the kernel refuses (port 0) counts each of its datagrams as a send error and the
    other path's still go out."""
    import asyncio

    hb, n = 48, 24
    rng = np.random.default_rng(5)
    hdr = rng.integers(0, 256, (n, hb), dtype=np.uint8)
    payload = rng.integers(0, 256, n * 1000, dtype=np.uint8)
    chunks = rng.permutation(n).astype(np.int64)
    sizes = rng.integers(1, 1000, n).astype(np.int64)
    paths = rng.integers(0, 2, n).astype(np.int64)
    run = DatagramRun(hdr.reshape(-1).data, hb, payload.data, chunks, chunks * 1000, sizes, 0,
                      paths, 0)  # fmt: skip
    want = [hdr[c].tobytes() + payload[c * 1000 : c * 1000 + s].tobytes()
            for c, s in zip(chunks.tolist(), sizes.tolist(), strict=True)]  # fmt: skip
    peers = _two_path_receivers()

    async def send(peer_addrs: list) -> udp.UdpCounters:
        u = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                         bufsize=1 << 20)  # fmt: skip
        try:
            await u.open([("127.0.0.1", 0), ("127.0.0.2", 0)])
            u.set_peers([peer_addrs])
            u.send([run])
            return u.counters
        finally:
            await u.wait_closed()

    try:
        assert udp._mmsg.AVAILABLE
        c = asyncio.run(send([p.getsockname() for p in peers]))
        assert c.tx_datagrams == n and c.tx_errors == 0
        assert c.tx_bytes == n * hb + int(sizes.sum())
        for q, sock in enumerate(peers):
            mine = [w for w, p in zip(want, paths.tolist(), strict=True) if p == q]
            assert [sock.recv(4096) for _ in mine] == mine
        c = asyncio.run(send([peers[0].getsockname(), ("127.0.0.1", 0)]))
        n1 = int((paths == 1).sum())
        assert c.tx_errors == n1 and c.tx_datagrams == n - n1
        assert [peers[0].recv(4096) for _ in range(n - n1)] == [
            w for w, p in zip(want, paths.tolist(), strict=True) if p == 0
        ]
    finally:
        for s in peers:
            s.close()


def test_sockaddr_layouts():
    v4 = _mmsg.sockaddr(("127.0.0.2", 0x1234))
    assert (
        v4.tobytes() == socket.AF_INET.to_bytes(2, "little") + b"\x12\x34\x7f\0\0\x02" + b"\0" * 8
    )
    v6 = _mmsg.sockaddr(("::1", 80, 0, 0))
    assert v6.shape == (28,) and v6[2:4].tolist() == [0, 80] and v6[23] == 1
    with pytest.raises(OSError):
        _mmsg.sockaddr(("not-an-address", 1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batched", [True, False])
def test_engines_all_reduce_exactly_with_and_without_batched_calls(monkeypatch, batched):
    if not batched:  # the path of platforms without the calls (read at UdpPaths creation)
        monkeypatch.setattr(udp._mmsg, "AVAILABLE", False)
    cfg = TransportConfig(n_paths=2, chunk_bytes=65000)
    engines = [UdpPlane(r, 2, cfg) for r in range(2)]
    try:
        table = {r: e.start() for r, e in enumerate(engines)}
        for e in engines:
            e.set_peers(StaticPeers(table))
            assert (e._udp._tx_batch is not None) == batched
        rng = np.random.default_rng(3)
        data = [rng.standard_normal(3_000_001).astype(np.float32) for _ in range(2)]
        futs = [e.submit(1, 0, d) for e, d in zip(engines, data, strict=True)]
        for res, rep in (f.result(60) for f in futs):
            np.testing.assert_array_equal(res, data[0] + data[1])
            assert not rep.degraded
        for e in engines:
            udp_stats = e.stats()["udp"]
            assert udp_stats["tx_errors"] == 0 and udp_stats["rx_errors"] == 0
    finally:
        for e in engines:
            e.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gso", [True, False])
def test_engines_all_reduce_exactly_with_mtu_sized_datagrams(gso):
    """1408-byte payloads (a 1500-byte MTU's): with GSO the runs leave as messages of many
    datagrams (``gso_sends``), and the sum is exact either way."""
    if gso and not _gso_here():
        pytest.skip("this kernel has no UDP GSO (UDP_SEGMENT, Linux >= 4.18)")
    cfg = TransportConfig(n_paths=2, chunk_bytes=1408, udp_gso=gso, socket_buffer_bytes=8 << 20)
    for u in _pair_all_reduce(cfg, 300_001, seed=7):
        assert u["tx_errors"] == 0 and u["gso_refused"] == 0
        assert (u["gso_sends"] > 0) == gso
        # GRO (on in both runs) coalesces what arrives as GSO messages, on loopback whole.
        assert (u["gro_messages"] > 0) == gso
        assert u["tx_datagrams"] >= 300_001 * 4 // 1408 // 2  # counted as datagrams


def _pair_all_reduce(cfg: TransportConfig, n: int, seed: int, **engine_kw) -> list[dict]:
    """Two engines all-reduce ``n`` random float32 values over loopback; asserts the exact sum
    and returns each engine's socket counters."""
    engines = [UdpPlane(r, 2, cfg, **engine_kw) for r in range(2)]
    try:
        table = {r: e.start() for r, e in enumerate(engines)}
        for e in engines:
            e.set_peers(StaticPeers(table))
        rng = np.random.default_rng(seed)
        data = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        futs = [e.submit(1, 0, d) for e, d in zip(engines, data, strict=True)]
        for res, rep in (f.result(60) for f in futs):
            np.testing.assert_array_equal(res, data[0] + data[1])
            assert not rep.degraded
        return [e.stats()["udp"] for e in engines]
    finally:
        for e in engines:
            e.close()


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _gso_here(), reason="this kernel has no UDP GSO")
def test_a_path_whose_kernel_refuses_gso_sends_one_datagram_per_message():
    """A socket without UDP checksums (SO_NO_CHECK) makes the kernel refuse every GSO send
    (EINVAL), as a device that cannot segment does: the refused messages' datagrams still go
    out, one by one, byte for byte; it is counted once per refused message and logged; the
    path stops using GSO (the next pass has no GSO message), the other path keeps it."""
    import asyncio

    n = 40
    paths = np.arange(n, dtype=np.int64) % 2
    run, want = _kilobyte_run(n, 9, paths)
    peers = _two_path_receivers()

    async def send() -> tuple[udp.UdpCounters, list[bool], int]:
        u = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                         bufsize=1 << 20)  # fmt: skip
        try:
            await u.open([("127.0.0.1", 0), ("127.0.0.2", 0)])
            assert u._tx_batch is not None and u._tx_batch.gso.tolist() == [True, True]
            u._socks[u._main[1]].setsockopt(socket.SOL_SOCKET, _SO_NO_CHECK, 1)
            u.set_peers([[p.getsockname() for p in peers]])
            u.send([run])
            refused = u.counters.gso_refused
            u.send([run])  # path 1 sends without GSO now: nothing more refused
            return u.counters, u._tx_batch.gso.tolist(), refused
        finally:
            await u.wait_closed()

    try:
        c, flags, refused = asyncio.run(send())
        assert flags == [True, False]
        assert refused >= 1 and c.gso_refused == refused
        assert c.tx_datagrams == 2 * n and c.tx_errors == 0
        assert c.gso_sends >= 2  # path 0's messages, both passes
        for q, sock in enumerate(peers):
            mine = [w for w, p in zip(want, paths.tolist(), strict=True) if p == q]
            assert [sock.recv(4096) for _ in 2 * mine] == 2 * mine
    finally:
        for s in peers:
            s.close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_engines_all_reduce_exactly_over_ipv6():
    """sendmmsg to a sockaddr_in6 built by _mmsg.sockaddr reaches the peer (and nothing else)."""
    cfg = TransportConfig(n_paths=1, chunk_bytes=8192)
    stats = _pair_all_reduce(cfg, 100_003, seed=4, local_addrs=["::1"])
    assert all(u["tx_errors"] == 0 and u["gso_refused"] == 0 for u in stats)


def test_a_control_datagram_goes_out_by_the_socket_or_queued_by_the_transport():
    """A single datagram (a control packet) goes out with the socket's own ``sendto`` (which
    releases the GIL); when the socket's buffer is full (EAGAIN) the loop's transport queues it
    instead, and a refused one is counted. Every accepted one reaches the peer."""
    import asyncio

    from gradlane.transport.core.events import Datagram

    class Full:
        """A socket whose buffer is always full."""

        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def sendto(self, data: bytes, dest: tuple) -> int:
            raise BlockingIOError

        def fileno(self) -> int:
            return self.sock.fileno()

    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))
    peer.settimeout(5)

    async def send(full: bool, dest: tuple) -> udp.UdpCounters:
        u = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                         bufsize=1 << 20)  # fmt: skip
        try:
            await u.open([("127.0.0.1", 0)])
            if full:
                u._socks = {tr: Full(s) for tr, s in u._socks.items()}
            u.set_peers([[dest]])
            u._send_each([Datagram(b"ack-%d" % int(full), 0, 0, 0)])
            return u.counters
        finally:
            await u.wait_closed()

    try:
        for full in (False, True):
            c = asyncio.run(send(full, peer.getsockname()))
            assert c.tx_datagrams == 1 and c.tx_errors == 0
            assert peer.recv(64) == b"ack-%d" % int(full)
        c = asyncio.run(send(False, ("127.0.0.1", 0)))  # port 0: the kernel refuses it
        assert c.tx_errors == 1
    finally:
        peer.close()


@pytest.mark.parametrize("batched", [True, False])
def test_poll_says_whether_it_read_every_socket_empty(batched):
    """poll() reads at most READ_BURST datagrams per socket; it answers True only when every
    socket gave fewer (what had arrived is all read), which the receiver needs before it takes
    a sender's pass end as the end of its data (gradlane.transport.core.receiver)."""
    import asyncio

    got: list[int] = []

    class Arena:
        """The receive side of an endpoint: an arena whose rows are committed and freed."""

        rx_arena = np.zeros((udp.READ_BURST * 2, 256), dtype=np.uint8)
        rx_free = 0

        def commit_datagrams(self, lengths: np.ndarray, path: int, now: float) -> None:
            got.extend(lengths.tolist())

    async def run() -> list[bool]:
        arena = Arena() if batched else None
        u = udp.UdpPaths(lambda: memoryview(bytearray(256)), lambda n, p, t: got.append(n),
                         lambda: None, bufsize=1 << 20, arena=arena)  # fmt: skip
        try:
            addr = (await u.open([("127.0.0.1", 0), ("127.0.0.2", 0)]))[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
                for _ in range(udp.READ_BURST + 5):
                    tx.sendto(b"x" * 100, addr)
            return [u.poll(), u.poll(), u.poll()]
        finally:
            await u.wait_closed()

    assert asyncio.run(run()) == [False, True, True]
    assert len(got) == udp.READ_BURST + 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["batched", "eagain", "one_at_a_time", "gso", "gso_eagain"])
def test_every_datagram_leaves_marked_with_its_class_tos(monkeypatch, mode):
    """The DSCP of a priority class reaches the IP header of every datagram: runs of three
    classes to two peers over two paths, and a control datagram, sent in one call. Batched,
    they go out with one sendmmsg per path (each message's TOS from its control message);
    when the kernel takes only part of a path's rows (EAGAIN), the rest go out queued on the
    transports of their (path, TOS); without the batched calls, on the socket of their TOS.
    With UDP GSO, a run's equal-sized datagrams on a path share messages (a shorter one ends
    a message) that the kernel cuts back into them. Each receiver reads exactly its
    datagrams, byte for byte and one by one, each with its run's TOS."""
    import asyncio

    from gradlane.transport.core.events import Datagram

    gso = mode.startswith("gso")
    if gso and not _gso_here():
        pytest.skip("this kernel has no UDP GSO (UDP_SEGMENT, Linux >= 4.18)")
    if mode == "one_at_a_time":
        monkeypatch.setattr(udp._mmsg, "AVAILABLE", False)
    if mode in ("batched", "gso"):  # the whole pass in one call per path (default: 16 rows)
        monkeypatch.setattr(udp, "MERGE_ROWS", 10**6)
    hb, tos_of = 48, (46 << 2, 26 << 2, 8 << 2)  # EF, AF31, CS1: the default classes' DSCP
    rng = np.random.default_rng(6)
    hdr = rng.integers(0, 256, (60, hb), dtype=np.uint8)
    payload = rng.integers(0, 256, 60 * 1200, dtype=np.uint8)
    runs, want = [], {}  # (peer, path) -> [(bytes, tos)] in send order
    for peer in range(2):
        for cls, tos in enumerate(tos_of):
            chunks = np.arange(10 * (3 * peer + cls), 10 * (3 * peer + cls) + 10, dtype=np.int64)
            sizes = rng.integers(1, 1200, 10).astype(np.int64)
            if gso:  # full-sized ones, a short one mid-run and one at the end
                sizes[:] = 1200
                sizes[[4, 9]] = rng.integers(1, 1200, 2)
            paths = rng.integers(0, 2, 10).astype(np.int64)
            run = DatagramRun(hdr.reshape(-1).data, hb, payload.data, chunks, chunks * 1200,
                              sizes, peer, paths, tos)  # fmt: skip
            runs.append(run)
            for c, n, q in zip(chunks.tolist(), sizes.tolist(), paths.tolist(), strict=True):
                wire = hdr[c].tobytes() + payload[c * 1200 : c * 1200 + n].tobytes()
                want.setdefault((peer, q), []).append((wire, tos))
    control = Datagram(b"control", 1, 0, tos_of[0])
    want[(1, 0)].insert(0, (b"control", tos_of[0]))  # single datagrams leave as they come
    receivers = {}
    for peer in range(2):
        for q, host in enumerate(("127.0.0.1", "127.0.0.2")):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((host, 0))
            s.setsockopt(socket.IPPROTO_IP, _IP_RECVTOS, 1)
            s.settimeout(5)
            receivers[(peer, q)] = s
    calls: list[tuple[int, int]] = []

    async def send() -> udp.UdpCounters:
        u = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                         bufsize=1 << 20, gso=gso)  # fmt: skip
        try:
            await u.open([("127.0.0.1", 0), ("127.0.0.2", 0)], tos_values=tos_of)
            u.set_peers([[receivers[(p, q)].getsockname() for q in range(2)] for p in range(2)])
            if u._tx_batch is not None:
                real = u._tx_batch.send

                def counted(fd: int, path: int, first: int, count: int) -> tuple[int, int]:
                    calls.append((path, count))
                    if mode.endswith("eagain") and first == 0 and count > 3:  # a full buffer
                        return real(fd, path, first, 3)[0], errno.EAGAIN
                    return real(fd, path, first, count)

                u._tx_batch.send = counted  # type: ignore[method-assign]
            u.send([runs[0], runs[1], control, *runs[2:]])
            await asyncio.sleep(0)  # the transports write what they queued on the next turn
            await asyncio.sleep(0.05)
            return u.counters
        finally:
            await u.wait_closed()

    try:
        c = asyncio.run(send())
        total = sum(len(v) for v in want.values())
        assert c.tx_datagrams == total and c.tx_errors == 0 and c.unroutable == 0
        assert c.tos_fallback == 0
        assert c.tx_bytes == sum(len(w) for v in want.values() for w, _ in v)
        if mode == "one_at_a_time":
            assert calls == []
        elif mode in ("batched", "gso"):  # one call per path for the whole pass
            assert sorted(p for p, _ in calls) == [0, 1]
        elif mode == "eagain":  # 16 rows at a time: runs of 10 go out in pairs, a call per path
            assert len(calls) <= 6 and sum(n for _, n in calls) >= total - 1
        if gso:  # messages of several datagrams went out: fewer rows than datagrams
            assert c.gso_sends > 0 and c.gso_refused == 0
            assert sum(n for _, n in calls) < total - 1
        else:
            assert c.gso_sends == 0
        for key, expected in want.items():
            got = [_recv_tos(receivers[key]) for _ in expected]
            if mode.endswith("eagain"):  # the queued rows follow what the kernel took
                assert sorted(got) == sorted(expected)
            else:
                assert got == expected
            receivers[key].setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing else arrived
                receivers[key].recv(70000)
    finally:
        for s in receivers.values():
            s.close()


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_an_ipv6_path_marks_its_datagrams_with_the_traffic_class():
    """Over IPv6 the control message is IPV6_TCLASS: each run's datagrams arrive with its TOS
    as their traffic class, in one sendmmsg for the pass."""
    import asyncio

    recv_tclass = int(getattr(socket, "IPV6_RECVTCLASS", 66))
    tclass = int(getattr(socket, "IPV6_TCLASS", 67))
    hb, tos_of = 48, (46 << 2, 8 << 2)
    hdr = np.arange(4 * hb, dtype=np.uint8).reshape(4, hb)
    payload = np.arange(4 * 100, dtype=np.uint8)
    runs = [
        DatagramRun(
            hdr.reshape(-1).data,
            hb,
            payload.data,
            np.array([2 * k, 2 * k + 1]),
            np.array([200 * k, 200 * k + 100]),
            np.array([100, 100]),
            0,
            np.zeros(2, dtype=np.int64),
            tos,
        )
        for k, tos in enumerate(tos_of)
    ]
    rx = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    rx.bind(("::1", 0))
    rx.setsockopt(socket.IPPROTO_IPV6, recv_tclass, 1)
    rx.settimeout(5)

    async def send() -> udp.UdpCounters:
        u = udp.UdpPaths(lambda: memoryview(bytearray(2048)), lambda *a: None, lambda: None,
                         bufsize=1 << 20)  # fmt: skip
        try:
            await u.open([("::1", 0)], tos_values=tos_of)
            u.set_peers([[rx.getsockname()]])
            u.send(runs)
            return u.counters
        finally:
            await u.wait_closed()

    try:
        c = asyncio.run(send())
        assert c.tx_datagrams == 4 and c.tx_errors == 0
        for k, tos in enumerate(tos_of):
            for j in range(2):
                data, anc, _, _ = rx.recvmsg(4096, socket.CMSG_SPACE(4))
                c_ = 2 * k + j
                assert data == hdr[c_].tobytes() + payload[100 * c_ : 100 * c_ + 100].tobytes()
                got = [x[2] for x in anc if x[0] == socket.IPPROTO_IPV6 and x[1] == tclass]
                assert got and int.from_bytes(got[0][:4], "little") == tos
    finally:
        rx.close()
