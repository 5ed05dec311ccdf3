"""Linux's batched UDP calls (``sendmmsg`` / ``recvmmsg``) on real loopback sockets: bytes,
lengths and truncation exactly as one call per datagram gives them; and an engine without them
(the one-call-per-datagram path every other platform uses) all-reduces exactly too."""

from __future__ import annotations

import errno
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


_IP_RECVTOS = int(getattr(socket, "IP_RECVTOS", 13))


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
    assert batch.append(
        0,
        hdr.ctypes.data,
        hb,
        order,
        payload.ctypes.data,
        starts[order],
        sizes[order],
        np.zeros(n, dtype=np.int64),
        _pairs(name),
        _pairs(ctl),
    )
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
        assert batch.append(run_id, 1000 * run_id, hb, chunks, 5000, starts, sizes, paths,
                            names, controls)  # fmt: skip
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
    assert not batch.append(9, 0, hb, z, 0, z, z, bad, names, names)
    assert batch.fill.tolist() == before.tolist()
    batch.clear()
    assert batch.fill.tolist() == [0] * n_paths and batch.nbytes.tolist() == [0] * n_paths


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["batched", "eagain", "one_at_a_time"])
def test_every_datagram_leaves_marked_with_its_class_tos(monkeypatch, mode):
    """The DSCP of a priority class reaches the IP header of every datagram: runs of three
    classes to two peers over two paths, and a control datagram, sent in one call. Batched,
    they go out with one sendmmsg per path (each message's TOS from its control message);
    when the kernel takes only part of a path's rows (EAGAIN), the rest go out queued on the
    transports of their (path, TOS); without the batched calls, on the socket of their TOS.
    Each receiver reads exactly its datagrams, byte for byte, each with its run's TOS."""
    import asyncio

    from transport.events import Datagram

    if mode == "one_at_a_time":
        monkeypatch.setattr(udp._mmsg, "AVAILABLE", False)
    if mode == "batched":  # the whole pass in one call per path (by default, 16 rows at a time)
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
                         bufsize=1 << 20)  # fmt: skip
        try:
            await u.open([("127.0.0.1", 0), ("127.0.0.2", 0)], tos_values=tos_of)
            u.set_peers([[receivers[(p, q)].getsockname() for q in range(2)] for p in range(2)])
            if u._tx_batch is not None:
                real = u._tx_batch.send

                def counted(fd: int, path: int, first: int, count: int) -> tuple[int, int]:
                    calls.append((path, count))
                    if mode == "eagain" and first == 0 and count > 3:  # a full socket buffer
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
        elif mode == "batched":  # one call per path for the whole pass
            assert sorted(p for p, _ in calls) == [0, 1]
        else:  # 16 rows at a time: runs of 10 go out in pairs, each pair one call per path
            assert len(calls) <= 6 and sum(n for _, n in calls) >= total - 1
        for key, expected in want.items():
            got = [_recv_tos(receivers[key]) for _ in expected]
            if mode == "eagain":  # the queued rows follow the 3 the kernel took, in order
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
