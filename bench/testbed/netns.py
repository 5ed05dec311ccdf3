"""An emulated leaf-spine network on this machine: hosts, switches and links as network namespaces.

Theory of operation
-------------------
Every host ``h`` is a namespace with one interface per spine (``e0``, ``e1``, ...), like a
multi-rail GPU server; interface ``e{p}`` carries the host's *path address*
``10.200.{p}.{h+1}`` and a route that sends the path's subnet ``10.200.{p}.0/24`` to its leaf.
The leaf (one per host, a top-of-rack switch) forwards path ``p`` to spine ``p``, which forwards
to the destination's leaf. So traffic between two hosts' path-``p`` addresses always crosses
leaf, spine ``p``, leaf: every host pair has ``spines`` disjoint paths, and the one a packet takes
is chosen by the addresses a sender uses (gradlane's per-packet multipath sprays over them).
Each host also has an *ECMP address* ``10.200.100.{h+1}`` (on interface ``ec0``, so
``GLOO_SOCKET_IFNAME=ec0`` picks it): hosts and leaves route
it with multipath routes hashed on the 5-tuple, like ECMP in a datacenter fabric, so a baseline
such as gloo's TCP can use the fabric the way it would in production (each connection on one
spine, different connections spread).

All links are veth pairs with MTU 9000: gradlane's default 8 KiB chunks travel in one frame and
gloo's TCP gets the same jumbo MSS, which is also what keeps packet rates (and CPU) low enough
for a small machine. ``gso_max_segs 1`` on every interface makes each socket buffer one wire
packet, so queue limits in packets and random drops per packet mean what they say (a 64 KiB TSO
burst would otherwise be queued, shaped and dropped as one unit).

The bottlenecks are the switches' egress ports (htb at the link rate with a pfifo queue, or DSCP
classes with ``priority``; see :mod:`gradlane.bench.testbed.tc`), never the sending host's own
interface: a qdisc there pushes back on the local socket and TCP would never see a drop
(ARCHITECTURE §8).

Addresses (all in 10.200.0.0/16): path addresses ``10.200.{p}.{h+1}``; point-to-point transit
addresses ``10.200.{64+p}.{h+1}`` (leaf port facing host ``h``'s ``e{p}``), ``10.200.{128+p}.{h+1}``
(leaf ``h``'s port to spine ``p``) and ``10.200.{192+p}.{h+1}`` (spine ``p``'s port to leaf ``h``);
ECMP addresses ``10.200.100.{h+1}``.

Names: namespaces ``{prefix}-h{h}``, ``{prefix}-l{h}``, ``{prefix}-s{p}``; interfaces are created
directly inside them, so the root namespace never holds a testbed link. :func:`down_all` removes
everything by prefix: it kills the processes left inside the namespaces and deletes them.

Privileges: as root the namespaces are ordinary named ones (``ip netns``). Without root, where the
kernel allows unprivileged user namespaces, a holder process owns a user, mount and network
namespace with a private ``/run/netns``, and every command enters it with ``nsenter`` (see
:class:`_Runner`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradlane.bench.testbed.tc import PortShape, parse_qdisc_stats, port_commands
from gradlane.transport.errors import ConfigError, GradlaneError

__all__ = [
    "Host",
    "Testbed",
    "TestbedError",
    "TestbedSpec",
    "TestbedUnavailable",
    "down_all",
    "finish",
    "path_addr",
    "privilege",
    "read_ready",
    "root_namespaces",
    "state_path",
    "stop_process",
]

log = logging.getLogger(__name__)

MTU = 9000
MAX_HOSTS = 64
MAX_SPINES = 8
#: Seconds an ``ip``/``tc`` command may take before the testbed gives up on it.
CMD_TIMEOUT_S = 30.0
#: Seconds a process inside the testbed gets to exit after SIGTERM before SIGKILL.
TERM_GRACE_S = 3.0
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_HOST_SYSCTLS = (
    "net.ipv4.conf.all.rp_filter=0",
    "net.ipv4.conf.default.rp_filter=0",
    "net.ipv6.conf.all.disable_ipv6=1",
    "net.ipv6.conf.default.disable_ipv6=1",
    "net.ipv4.fib_multipath_hash_policy=1",  # ECMP by the 5-tuple, as datacenter switches do
)
_SWITCH_SYSCTLS = (*_HOST_SYSCTLS, "net.ipv4.ip_forward=1")
#: Third octet of the ECMP addresses (path subnets are 0..MAX_SPINES-1, transit 64 and up).
ECMP_NET = 100
#: Host interface that carries the ECMP address (for ``GLOO_SOCKET_IFNAME`` and the like).
ECMP_IFNAME = "ec0"
USERNS_ENV = "GRADLANE_TESTBED_USERNS"
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21  # linux/capability.h
NEEDS_ROOT = (
    "the testbed needs root (or unprivileged user namespaces, which this kernel does not allow)"
)


class TestbedError(GradlaneError):
    """Building, using or tearing down the testbed failed; the message names the command."""


class TestbedUnavailable(TestbedError):
    """This machine cannot run the testbed (no root and no user namespaces, or no iproute2)."""


def path_addr(path: int, host: int) -> str:
    """Host ``host``'s address on path ``path`` (routed via spine ``path``)."""
    return f"10.200.{path}.{host + 1}"


def _leaf_host_port(path: int, host: int) -> str:
    return f"10.200.{64 + path}.{host + 1}"


def _leaf_uplink(path: int, host: int) -> str:
    return f"10.200.{128 + path}.{host + 1}"


def _spine_port(path: int, host: int) -> str:
    return f"10.200.{192 + path}.{host + 1}"


def ecmp_addr(host: int) -> str:
    """Host ``host``'s ECMP address: routed over every spine, by a hash of each flow's ports."""
    return f"10.200.{ECMP_NET}.{host + 1}"


@dataclass(frozen=True)
class TestbedSpec:
    """Shape of the emulated network.

    Attributes:
        hosts: number of host namespaces (each with its own leaf switch), 2..64.
        spines: number of spines = number of disjoint paths between any two hosts, 1..8.
        link_mbit: rate of every link in Mbit/s (enforced on every switch egress port).
        queue_packets: queue limit per switch port in packets (of the highest class with
            ``priority``; lower classes get halving shares, see :mod:`gradlane.bench.testbed.tc`).
        priority: DSCP-selected htb classes on every switch port (lower classes drop first).
        prefix: start of every namespace name; 1..8 lowercase letters/digits, starting with a
            letter. :func:`down_all` removes by it, so concurrent runs need distinct prefixes.
        mtu: link MTU; 9000 (jumbo frames, see the module docstring) or 1500.
    """

    __test__ = False  # "Test..." is a class name here, not a pytest test class

    hosts: int = 4
    spines: int = 2
    link_mbit: float = 1000.0
    queue_packets: int = 1000
    priority: bool = False
    prefix: str = "gl"
    mtu: int = MTU

    def __post_init__(self) -> None:
        if not 2 <= self.hosts <= MAX_HOSTS:
            raise ConfigError(f"hosts must be in [2, {MAX_HOSTS}], got {self.hosts}")
        if not 1 <= self.spines <= MAX_SPINES:
            raise ConfigError(f"spines must be in [1, {MAX_SPINES}], got {self.spines}")
        if not 1.0 <= self.link_mbit <= 100_000.0:
            raise ConfigError(f"link_mbit must be in [1, 100000] Mbit/s, got {self.link_mbit}")
        if not 16 <= self.queue_packets <= 100_000:
            raise ConfigError(f"queue_packets must be in [16, 100000], got {self.queue_packets}")
        if not _PREFIX_RE.match(self.prefix):
            raise ConfigError(
                f"prefix {self.prefix!r}: use 1-8 lowercase letters or digits starting with a "
                "letter (namespace names are '<prefix>-h0' ..., interface names stay short)"
            )
        if self.mtu not in (1500, MTU):
            raise ConfigError(f"mtu must be 1500 or {MTU}, got {self.mtu}")

    def namespaces(self) -> list[str]:
        """Every namespace name of this testbed: hosts, leaves, spines."""
        p = self.prefix
        return (
            [f"{p}-h{h}" for h in range(self.hosts)]
            + [f"{p}-l{h}" for h in range(self.hosts)]
            + [f"{p}-s{s}" for s in range(self.spines)]
        )

    def port_shape(self) -> PortShape:
        """How every switch egress port is shaped."""
        return PortShape(self.link_mbit, self.queue_packets, self.priority, mtu=self.mtu)


def _has_admin_caps() -> bool:
    """True when this process may manage namespaces and links (CAP_SYS_ADMIN, CAP_NET_ADMIN).

    Checked on the effective capability set, not the uid: root in a container without them
    must take the user-namespace route like everyone else.
    """
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    eff = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("CapEff:")), "0")
    caps = int(eff, 16)
    return bool(caps & (1 << CAP_SYS_ADMIN)) and bool(caps & (1 << CAP_NET_ADMIN))


def privilege() -> str:
    """``"root"``, ``"userns"`` (unprivileged user namespaces work) or raise TestbedUnavailable.

    ``GRADLANE_TESTBED_USERNS=1`` picks the user-namespace mode also for root (to test it).
    """
    missing = [tool for tool in ("ip", "tc", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        raise TestbedUnavailable(f"the testbed needs iproute2 and util-linux; missing: {missing}")
    if _has_admin_caps() and os.environ.get(USERNS_ENV) != "1":
        return "root"
    try:
        probe = subprocess.run(
            ["unshare", "-Urmn", "true"], check=False, capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedUnavailable(f"{NEEDS_ROOT}: {exc}") from exc
    if probe.returncode != 0:
        raise TestbedUnavailable(f"{NEEDS_ROOT}: {probe.stderr.decode(errors='replace').strip()}")
    return "userns"


def state_path(prefix: str) -> Path:
    """Where ``gradlane testbed up`` records what it created for ``prefix``."""
    base = Path("/run/gradlane") if os.geteuid() == 0 else Path(tempfile.gettempdir())
    return base / f"gradlane-testbed-{prefix}.json"


def ip_plan(spec: TestbedSpec) -> tuple[list[str], dict[str, list[str]]]:
    """The ``ip -batch`` lines that wire ``spec``: veth pairs (run in the root namespace) and,
    per namespace, interfaces, addresses and routes (see the module docstring for the plan)."""
    pre = spec.prefix
    hosts = [f"{pre}-h{h}" for h in range(spec.hosts)]
    leaves = [f"{pre}-l{h}" for h in range(spec.hosts)]
    spines = [f"{pre}-s{s}" for s in range(spec.spines)]
    links = []
    per_ns: dict[str, list[str]] = {ns: ["link set lo up"] for ns in spec.namespaces()}

    def port(ns: str, dev: str, local: str, peer: str) -> None:
        per_ns[ns] += [
            f"link set {dev} mtu {spec.mtu} gso_max_segs 1 up",
            f"addr add {local} peer {peer}/32 dev {dev}",
        ]

    for h in range(spec.hosts):
        for p in range(spec.spines):
            links.append(
                f"link add e{p} netns {hosts[h]} type veth peer name h{p} netns {leaves[h]}"
            )
            links.append(
                f"link add s{p} netns {leaves[h]} type veth peer name l{h} netns {spines[p]}"
            )
            port(hosts[h], f"e{p}", path_addr(p, h), _leaf_host_port(p, h))
            per_ns[hosts[h]].append(
                f"route add 10.200.{p}.0/24 via {_leaf_host_port(p, h)} dev e{p} "
                f"src {path_addr(p, h)}"
            )
            port(leaves[h], f"h{p}", _leaf_host_port(p, h), path_addr(p, h))
            port(leaves[h], f"s{p}", _leaf_uplink(p, h), _spine_port(p, h))
            per_ns[leaves[h]].append(f"route add 10.200.{p}.0/24 via {_spine_port(p, h)} dev s{p}")
            port(spines[p], f"l{h}", _spine_port(p, h), _leaf_uplink(p, h))
            per_ns[spines[p]].append(
                f"route add {path_addr(p, h)}/32 via {_leaf_uplink(p, h)} dev l{h}"
            )
            per_ns[spines[p]].append(
                f"route add {ecmp_addr(h)}/32 via {_leaf_uplink(p, h)} dev l{h}"
            )
        # ECMP: the host hashes flows over its rails, the leaf over its uplinks (and rails down).
        rails = " ".join(
            f"nexthop via {_leaf_host_port(p, h)} dev e{p}" for p in range(spec.spines)
        )
        ups = " ".join(f"nexthop via {_spine_port(p, h)} dev s{p}" for p in range(spec.spines))
        downs = " ".join(f"nexthop via {path_addr(p, h)} dev h{p}" for p in range(spec.spines))
        per_ns[hosts[h]] += [
            # A veth of its own (not lo) so that tools binding by interface name, like
            # GLOO_SOCKET_IFNAME, find exactly this address.
            f"link add {ECMP_IFNAME} type veth peer name {ECMP_IFNAME[:-1]}x",
            f"link set {ECMP_IFNAME[:-1]}x up",
            f"link set {ECMP_IFNAME} up",
            f"addr add {ecmp_addr(h)}/32 dev {ECMP_IFNAME}",
            f"route add 10.200.{ECMP_NET}.0/24 src {ecmp_addr(h)} {rails}",
        ]
        per_ns[leaves[h]] += [
            f"route add {ecmp_addr(h)}/32 {downs}",
            f"route add 10.200.{ECMP_NET}.0/24 {ups}",
        ]
    return links, per_ns


class _Runner:
    """Runs ``ip``/``tc`` and programs inside testbed namespaces, as root or in a user namespace.

    As root the argv runs as is. Unprivileged, a holder process (``unshare -Urmn``) owns a user,
    a mount and a network namespace (the testbed's "root" namespace); a private tmpfs ``/run``
    holds the named network namespaces, and every command joins all three through ``nsenter``
    (the owner of a user namespace may enter it). The holder keeps the namespaces alive; killing
    it (after the processes inside) tears everything down.
    """

    def __init__(
        self, holder_pid: int | None = None, holder: subprocess.Popen[bytes] | None = None
    ) -> None:
        self.holder_pid = holder_pid
        self.holder = holder  # the Popen when this process started the holder (to reap it)
        self.prefix: list[str] = (
            []
            if holder_pid is None
            else ["nsenter", "-t", str(holder_pid), "-U", "-m", "-n", "--preserve-credentials"]
        )

    @classmethod
    def start(cls, mode: str) -> _Runner:
        """A runner for ``mode`` (see :func:`privilege`), starting the holder if needed."""
        if mode == "root":
            return cls()
        holder = subprocess.Popen(
            [
                "unshare",
                "-Urmn",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mount -t tmpfs tmpfs /run && mkdir -p /run/netns && echo ready "
                "&& exec sleep infinity",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # survives the CLI that started it, until `down`
        )
        line = _read_line(holder, CMD_TIMEOUT_S)
        if holder.stdout is not None:
            holder.stdout.close()  # it has said all it will say
        if line.strip() != "ready":
            stop_process(holder)
            raise TestbedUnavailable(f"{NEEDS_ROOT}: user namespace holder failed: {line!r}")
        return cls(holder.pid, holder)

    def ns_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return [*self.prefix, "ip", "netns", "exec", ns, *argv]

    def run(
        self, argv: list[str], *, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` (prefixed for the user namespace); raise TestbedError when it fails."""
        full = [*self.prefix, *argv]
        try:
            done = subprocess.run(
                full,
                check=False,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=CMD_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TestbedError(f"{' '.join(argv)}: {exc}") from exc
        if check and done.returncode != 0:
            detail = done.stderr.strip() or done.stdout.strip()
            where = f"\n{stdin}" if stdin else ""
            raise TestbedError(f"{' '.join(argv)} failed ({done.returncode}): {detail}{where}")
        return done

    def batch(self, tool: str, ns: str | None, lines: list[str]) -> None:
        """Run ``lines`` through one ``ip -batch`` or ``tc -batch`` (in ``ns`` when given)."""
        if lines:
            where = ["-n", ns] if ns else []
            self.run([tool, *where, "-batch", "-"], stdin="\n".join(lines) + "\n")

    def namespaces(self) -> list[str]:
        """Names of the network namespaces this runner sees."""
        out = self.run(["ip", "netns", "list"], check=False).stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def pids(self, ns: str) -> list[int]:
        """The processes inside ``ns``."""
        out = self.run(["ip", "netns", "pids", ns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_inside(self, ns: str) -> int:
        """SIGKILL every process left inside ``ns``; returns how many there were."""
        pids = self.pids(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)


def read_ready(proc: subprocess.Popen[Any], timeout: float, what: str) -> None:
    """Wait for ``proc`` (started with stdout/stderr pipes) to print ``ready``, or raise.

    The error carries the end of the process's stderr when it died before saying so.
    """
    line = _read_line(proc, timeout).strip()
    if line == "ready":
        return
    err = ""
    if proc.poll() is not None and proc.stderr is not None:
        err = proc.stderr.read()[-2000:]
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
    stop_process(proc)
    raise TestbedError(f"{what} did not start within {timeout:.0f}s (got {line!r}): {err}")


def finish(proc: subprocess.Popen[Any]) -> dict[str, Any]:
    """Stop ``proc`` (started with text pipes), reap it, close its pipes; returns the last JSON
    object it printed on stdout (its counters), or ``{}``."""
    stop_process(proc)
    record: dict[str, Any] = {}
    out = proc.stdout.read() if proc.stdout is not None else ""
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            record = value if isinstance(value, dict) else record
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    return record


def _read_line(proc: subprocess.Popen[Any], timeout: float) -> str:
    """First stdout line of ``proc`` within ``timeout`` seconds ('' on timeout or exit)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    line = proc.stdout.readline()
    return line.decode(errors="replace") if isinstance(line, bytes) else line


def stop_process(proc: subprocess.Popen[Any], grace: float = TERM_GRACE_S) -> int | None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; always reaps. Returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(grace)
    return proc.returncode


@dataclass
class Host:
    """One host namespace of a running testbed.

    Attributes:
        index: host number ``h``.
        netns: namespace name.
        addrs: ``addrs[p]`` is this host's address on path ``p`` (routed via spine ``p``).
        ecmp_addr: an address whose flows are hashed over the spines by their 5-tuple (as
            ECMP in a datacenter fabric does): one TCP connection stays on one spine, different
            connections spread. ``10.200.100.{h+1}`` on interface ``ec0``
            (:data:`ECMP_IFNAME`; ``GLOO_SOCKET_IFNAME=ec0`` makes gloo use it).
    """

    index: int
    netns: str
    addrs: list[str]
    ecmp_addr: str | None = None
    _bed: Testbed | None = field(default=None, repr=False, compare=False)

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host's namespace; the testbed reaps it at ``down``."""
        if self._bed is None:
            raise TestbedError(f"host {self.netns} belongs to no running testbed")
        return self._bed.spawn(self.netns, argv, **kw)

    def run(
        self, argv: list[str], timeout: float, *, check: bool = False, **kw: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside this host's namespace to completion (killed after ``timeout``)."""
        if self._bed is None:
            raise TestbedError(f"host {self.netns} belongs to no running testbed")
        argv = self._bed.runner.ns_argv(self.netns, argv)
        return subprocess.run(argv, check=check, timeout=timeout, **kw)


#: Testbeds up in this process (strong references: one dropped without ``down`` is still torn
#: down at exit).
_LIVE: set[Testbed] = set()


@atexit.register
def _down_live() -> None:  # pragma: no cover (runs at interpreter exit)
    for bed in list(_LIVE):
        bed.down()


class Testbed:
    """A running (after :meth:`up`) leaf-spine of namespaces; a context manager.

    ``with Testbed(spec) as bed:`` brings it up and always tears it down, also when the body
    raises; an ``atexit`` hook tears down any testbed still up when the interpreter exits.
    ``keep=True`` (the CLI's ``testbed up``) skips the atexit hook and records a state file so a
    later ``down`` finds it.
    """

    __test__ = False

    def __init__(self, spec: TestbedSpec, *, keep: bool = False) -> None:
        self.spec = spec
        self.keep = keep
        self.hosts: list[Host] = []
        self.runner = _Runner()
        self._procs: list[subprocess.Popen[Any]] = []
        self._handles: list[Any] = []  # cross traffic and impairments, stopped at down
        self._up = False

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Testbed:
        """Create the namespaces, links, addresses, routes and shapers; returns ``self``."""
        if self._up:
            return self
        mode = privilege()
        if mode == "root":
            clash = [n for n in _Runner().namespaces() if _owned(n, self.spec.prefix)]
            if clash:
                raise TestbedError(
                    f"namespaces with prefix {self.spec.prefix!r} already exist ({clash[:4]}...); "
                    f"remove them with `gradlane testbed down --prefix {self.spec.prefix}`"
                )
        else:
            state = load_state(self.spec.prefix)
            if state and state.get("holder_pid") and _is_holder(int(state["holder_pid"])):
                raise TestbedError(
                    f"a testbed with prefix {self.spec.prefix!r} already exists (holder pid "
                    f"{state['holder_pid']}); remove it with "
                    f"`gradlane testbed down --prefix {self.spec.prefix}`"
                )
        self.runner = _Runner.start(mode)
        self._up = True
        if not self.keep:
            _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        if self.keep:
            self._write_state()
        log.info("testbed %s up: %s", self.spec.prefix, self.spec)
        return self

    def down(self) -> None:
        """Stop traffic and impairments, kill every process inside, delete every namespace."""
        if not self._up:
            return
        self._up = False
        _LIVE.discard(self)
        for handle in reversed(self._handles):
            with contextlib.suppress(Exception):  # teardown goes on whatever one handle says
                handle.stop()
        self._handles.clear()
        # SIGTERM to all first, so the grace periods run side by side rather than in turn.
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self._procs:
            stop_process(proc)
        self._procs.clear()
        _remove(self.runner, self.spec.prefix)
        self.hosts = []
        with contextlib.suppress(FileNotFoundError):
            state_path(self.spec.prefix).unlink()

    @property
    def is_up(self) -> bool:
        """True between :meth:`up` and :meth:`down`."""
        return self._up

    # -- building --------------------------------------------------------------------------

    def _build(self) -> None:
        spec, r = self.spec, self.runner
        hosts = [f"{spec.prefix}-h{h}" for h in range(spec.hosts)]
        for ns in spec.namespaces():  # not batched: a batch's setns back fails in a user namespace
            r.run(["ip", "netns", "add", ns])
        for ns in spec.namespaces():
            sysctls = _SWITCH_SYSCTLS if ns not in hosts else _HOST_SYSCTLS
            r.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *sysctls])
        links, per_ns = ip_plan(spec)
        r.batch("ip", None, links)
        for ns, lines in per_ns.items():
            r.batch("ip", ns, lines)
        shape = spec.port_shape()
        for ns, devs in self.switch_ports().items():
            r.batch("tc", ns, [line for dev in devs for line in port_commands(dev, shape)])
        self.hosts = [
            Host(h, hosts[h], [path_addr(p, h) for p in range(spec.spines)], ecmp_addr(h), self)
            for h in range(spec.hosts)
        ]

    def switch_ports(self) -> dict[str, list[str]]:
        """Shaped egress ports per switch namespace (leaf: ``h{p}``, ``s{p}``; spine: ``l{h}``)."""
        spec = self.spec
        ports = {
            f"{spec.prefix}-l{h}": [f"h{p}" for p in range(spec.spines)]
            + [f"s{p}" for p in range(spec.spines)]
            for h in range(spec.hosts)
        }
        ports.update(
            {
                f"{spec.prefix}-s{p}": [f"l{h}" for h in range(spec.hosts)]
                for p in range(spec.spines)
            }
        )
        return ports

    def _write_state(self) -> None:
        path = state_path(self.spec.prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "spec": asdict(self.spec),
            "holder_pid": self.runner.holder_pid,
            "namespaces": self.spec.namespaces(),
            "hosts": [{"netns": h.netns, "addrs": h.addrs} for h in self.hosts],
            "created": time.time(),
        }
        path.write_text(json.dumps(state, indent=1) + "\n")

    # -- processes -------------------------------------------------------------------------

    def spawn(self, ns: str, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside namespace ``ns``; it is stopped and reaped at :meth:`down`."""
        if not self._up:
            raise TestbedError("the testbed is not up")
        proc = subprocess.Popen(self.runner.ns_argv(ns, argv), **kw)
        self._procs = [p for p in self._procs if p.poll() is None]
        self._procs.append(proc)
        return proc

    def own(self, handle: Any) -> Any:
        """Register a handle with ``stop()`` (cross traffic, impairment) to stop at :meth:`down`."""
        self._handles.append(handle)
        return handle

    def disown(self, handle: Any) -> None:
        """Forget a handle that was stopped by its owner."""
        with contextlib.suppress(ValueError):
            self._handles.remove(handle)

    def cross_traffic(self, spine: int, rate_mbit: float, **kw: Any) -> Any:
        """Start a cross-traffic flow over spine ``spine``; see
        :func:`gradlane.bench.testbed.crosstraffic.start`."""
        from gradlane.bench.testbed.crosstraffic import start  # crosstraffic imports this module

        return start(self, spine, rate_mbit, **kw)

    def load_spine(self, spine: int, rate_mbit: float, route: str = "spine", **kw: Any) -> Any:
        """Cross traffic on every link of spine ``spine`` (or one ``route="pair"``); see
        :func:`gradlane.bench.testbed.crosstraffic.load_spine`."""
        from gradlane.bench.testbed.crosstraffic import load_spine

        return load_spine(self, spine, rate_mbit, route, **kw)

    def impair(self, spine: int, loss: float = 0.0, delay_ms: float = 0.0, **kw: Any) -> Any:
        """Random loss and delay on everything crossing spine ``spine``; see
        :func:`gradlane.bench.testbed.impair.start`."""
        from gradlane.bench.testbed.impair import start  # impair imports this module

        return start(self, spine, loss=loss, delay_ms=delay_ms, **kw)

    # -- counters --------------------------------------------------------------------------

    def link_stats(self) -> dict[str, dict[str, Any]]:
        """Counters of every shaped switch port, keyed ``"<namespace>/<dev>"``.

        Each entry has ``sent_bytes``, ``sent_packets``, ``drops``, ``overlimits``,
        ``backlog_bytes``, ``qlen``, ``classes`` (per DSCP class) and ``link`` (which link the
        port sends on, e.g. ``"spine0->leaf1"``).
        """
        shape = self.spec.port_shape()
        out: dict[str, dict[str, Any]] = {}
        for ns, devs in self.switch_ports().items():
            text = self.runner.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"]).stdout
            stats = parse_qdisc_stats(text, dict.fromkeys(devs, shape))
            for dev, counters in stats.items():
                counters["link"] = _describe(ns, dev)
                out[f"{ns}/{dev}"] = counters
        return out


def _describe(ns: str, dev: str) -> str:
    """``"leaf1->host1.p0"`` style name of the link that switch port ``ns/dev`` sends on."""
    kind, num = ns.rsplit("-", 1)[1][0], ns.rsplit("-", 1)[1][1:]
    if kind == "s":
        return f"spine{num}->leaf{dev[1:]}"
    if dev.startswith("h"):
        return f"leaf{num}->host{num}.p{dev[1:]}"
    return f"leaf{num}->spine{dev[1:]}"


def _owned(ns: str, prefix: str) -> bool:
    return ns.startswith(prefix + "-")


def _remove(runner: _Runner, prefix: str) -> list[str]:
    """Kill what runs inside the prefix's namespaces, delete them; returns the names removed."""
    names = [n for n in runner.namespaces() if _owned(n, prefix)]
    for ns in names:
        runner.kill_inside(ns)
    for ns in names:
        runner.run(["ip", "netns", "del", ns], check=False)
    if runner.holder is not None:
        stop_process(runner.holder)
    elif runner.holder_pid is not None:  # started by another process (the CLI's `up`)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(runner.holder_pid, signal.SIGKILL)
    return names


def root_namespaces() -> dict[str, list[int]]:
    """As root: every named network namespace and the processes inside it."""
    runner = _Runner()
    return {ns: runner.pids(ns) for ns in runner.namespaces()}


def down_all(prefix: str) -> list[str]:
    """Remove every leftover of testbeds named ``prefix``; returns what was removed.

    Kills the processes inside the ``{prefix}-*`` namespaces and deletes them, kills the user
    namespace holder a state file names (unprivileged mode), and removes the state file.
    """
    if not _PREFIX_RE.match(prefix):
        raise ConfigError(f"prefix {prefix!r} is not a testbed prefix (see TestbedSpec.prefix)")
    removed: list[str] = []
    path = state_path(prefix)
    holder = None
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
        holder = json.loads(path.read_text())["holder_pid"]
    if holder is not None and _is_holder(int(holder)):
        removed += _remove(_Runner(int(holder)), prefix)
        removed.append(f"holder pid {holder}")
    elif privilege() == "root":
        removed += _remove(_Runner(), prefix)
    if path.exists():
        path.unlink()
        removed.append(str(path))
    return removed


def _is_holder(pid: int) -> bool:
    """True when ``pid`` is alive and still a ``sleep`` (a recycled pid is left alone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "sleep"
    except OSError:
        return False


def load_state(prefix: str) -> dict[str, Any] | None:
    """The state file ``testbed up`` wrote for ``prefix``, or ``None``."""
    try:
        return dict(json.loads(state_path(prefix).read_text()))
    except (FileNotFoundError, ValueError):
        return None


def attach(prefix: str) -> Testbed:
    """A :class:`Testbed` for the running testbed recorded under ``prefix`` (for status)."""
    state = load_state(prefix)
    if state is None:
        raise TestbedError(f"no testbed {prefix!r} is recorded at {state_path(prefix)}")
    bed = Testbed(TestbedSpec(**state["spec"]), keep=True)
    holder = state.get("holder_pid")
    bed.runner = _Runner(int(holder)) if holder is not None else _Runner()
    bed._up = True
    bed.hosts = [
        Host(i, h["netns"], list(h["addrs"]), None, bed) for i, h in enumerate(state["hosts"])
    ]
    return bed
