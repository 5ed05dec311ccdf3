"""Linux's batched UDP calls (``sendmmsg`` / ``recvmmsg``) on real loopback sockets: bytes,
lengths and truncation exactly as one call per datagram gives them; and an engine without them
(the one-call-per-datagram path every other platform uses) all-reduces exactly too."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from transport import _mmsg, udp
from transport.config import TransportConfig
from transport.engine import Engine
from transport.events import DatagramRun
from transport.rendezvous import StaticPeers

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


def test_a_run_goes_out_and_comes_back_byte_for_byte(pair):
    rx, tx = pair
    rng = np.random.default_rng(1)
    n, hb = 40, 48
    hdr = rng.integers(0, 256, (n, hb), dtype=np.uint8)
    sizes = rng.integers(0, 3000, n).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    payload = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    order = rng.permutation(n)  # rows in any order, as a sender's run picks chunks
    table = _mmsg.SendTable(capacity=4)  # grows to fit
    counts, nbytes = table.fill(
        hdr.ctypes.data,
        hb,
        order,
        payload.ctypes.data,
        starts[order],
        sizes[order],
        np.zeros(n, dtype=np.int64),
        1,
    )
    assert counts.tolist() == [n] and nbytes.tolist() == [int(sizes.sum())]
    sent, err = table.send(tx.fileno(), _mmsg.sockaddr(rx.getsockname()), 0, n)
    assert (sent, err) == (n, 0)
    arena = np.zeros((64, 4096), dtype=np.uint8)
    got = _mmsg.RecvTable(arena)
    lengths, err = got.receive(rx.fileno(), 3, 64 - 3)
    assert err == 0
    assert lengths.tolist() == (hb + sizes[order]).tolist()
    for i, c in enumerate(order.tolist()):
        row = arena[3 + i]
        a, b = int(starts[c]), int(starts[c] + sizes[c])
        assert row[:hb].tobytes() == hdr[c].tobytes()
        assert row[hb : hb + sizes[c]].tobytes() == payload[a:b].tobytes()
    # Nothing left: an empty answer, not an error.
    lengths, err = got.receive(rx.fileno(), 0, 8)
    assert lengths.size == 0 and err == 0


def test_a_run_is_laid_out_grouped_by_path_in_run_order():
    """fill() is a stable counting sort: path 0's datagrams first, each path's in run order,
    with their header and payload addresses, and per-path datagram and byte counts."""
    rng = np.random.default_rng(2)
    n, hb = 300, 48
    chunks = rng.permutation(n)
    starts = rng.integers(0, 10**6, n).astype(np.int64)
    sizes = rng.integers(1, 65000, n).astype(np.int64)
    paths = rng.integers(0, 3, n).astype(np.int64)
    paths[paths == 1] = 2  # a path with no datagram
    table = _mmsg.SendTable(capacity=8)
    counts, nbytes = table.fill(1000, hb, chunks, 5000, starts, sizes, paths, 4)
    want = np.argsort(paths, kind="stable")
    assert table.order[:n].tolist() == want.tolist()
    assert counts.tolist() == np.bincount(paths, minlength=4).tolist()
    assert nbytes.tolist() == np.bincount(paths, weights=sizes, minlength=4).astype(int).tolist()
    iov = table.iov[:n]
    assert (iov[:, 0, 0] == 1000 + chunks[want] * hb).all() and (iov[:, 0, 1] == hb).all()
    assert (iov[:, 1, 0] == 5000 + starts[want]).all() and (iov[:, 1, 1] == sizes[want]).all()
    with pytest.raises(ValueError, match="path outside"):
        table.fill(1000, hb, chunks, 5000, starts, sizes, paths, 2)
    # Without n_paths, as many paths as the largest needs; a negative path is still refused.
    counts, nbytes = table.fill(1000, hb, chunks, 5000, starts, sizes, paths)
    assert counts.tolist() == np.bincount(paths).tolist() and len(counts) == 3
    assert table.order[:n].tolist() == want.tolist()
    paths[7] = -1
    with pytest.raises(ValueError, match="path outside"):
        table.fill(1000, hb, chunks, 5000, starts, sizes, paths)


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
    peers = []
    for host in ("127.0.0.1", "127.0.0.2"):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((host, 0))
        s.settimeout(5)
        peers.append(s)

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
    engines = [Engine(r, 2, cfg) for r in range(2)]
    try:
        table = {r: e.start() for r, e in enumerate(engines)}
        for e in engines:
            e.set_peers(StaticPeers(table))
            assert (e._udp._tx_table is not None) == batched
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
    engines = [Engine(r, 2, cfg, local_addrs=["::1"]) for r in range(2)]
    try:
        table = {r: e.start() for r, e in enumerate(engines)}
        for e in engines:
            e.set_peers(StaticPeers(table))
        rng = np.random.default_rng(4)
        data = [rng.standard_normal(100_003).astype(np.float32) for _ in range(2)]
        futs = [e.submit(1, 0, d) for e, d in zip(engines, data, strict=True)]
        for res, _ in (f.result(30) for f in futs):
            np.testing.assert_array_equal(res, data[0] + data[1])
        assert all(e.stats()["udp"]["tx_errors"] == 0 for e in engines)
    finally:
        for e in engines:
            e.close()


def test_a_control_datagram_goes_out_by_the_socket_or_queued_by_the_transport():
    """A single datagram (a control packet) goes out with the socket's own ``sendto`` (which
    releases the GIL); when the socket's buffer is full (EAGAIN) the loop's transport queues it
    instead, and a refused one is counted. Every accepted one reaches the peer."""
    import asyncio

    from transport.events import Datagram

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
    a sender's pass end as the end of its data (transport.receiver)."""
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
