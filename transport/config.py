"""Configuration of the transport cores (STYLE rule 8: one dataclass per component, validated).

``TransportConfig`` gathers the knobs of one rank's protocol endpoint and nests the policy
configs of :mod:`scheduling`. CLI flags, ``GRADLANE_*`` environment variables and TOML files
all build it through :meth:`TransportConfig.from_mapping`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Integral, Real
from typing import Any

import numpy as np
from gradlane.scheduling.loss import LossConfig
from gradlane.scheduling.pacing import PacingConfig
from gradlane.scheduling.paths import PathConfig
from gradlane.scheduling.precision import PrecisionConfig
from gradlane.scheduling.priority import PriorityConfig
from gradlane.transport.errors import ConfigError
from gradlane.transport.wire.header import HEADER_SIZE, ITEMSIZE, MAX_UDP_PAYLOAD
from gradlane.transport.wire.tag import TagKey

__all__ = [
    "ENV_PREFIX",
    "SECRET_OFF",
    "TransportConfig",
    "check_secret",
    "check_types",
    "env_field",
    "env_settings",
    "loopback_config",
    "parse_env_value",
]


@dataclass(frozen=True)
class TransportConfig:
    """Knobs of one rank's transport endpoint.

    Payload size per packet: ~1408 B for an MTU of 1500, ~8 KiB for jumbo frames, up to ~64 KiB
    on loopback. ``loss.loss_bound = 0`` makes every transfer fully reliable.
    """

    job: int = 1
    """Job token (u32): packets carrying another token are dropped and counted."""
    secret: str | None = None
    """Shared secret: when set, every packet carries a keyed MAC (docs/wire-format.md) and
    forged or foreign ones are rejected; ``"off"`` (:data:`SECRET_OFF`): unkeyed checksums, and
    the DDP hook shares no secret of its own; None: unkeyed here, but the DDP hook shares a
    random secret through the job's store. Never printed (``repr`` hides it)."""
    chunk_bytes: int = 8192
    """Payload bytes per DATA packet (a multiple of 4)."""
    n_paths: int = 1
    """Paths toward every peer (one per local NIC/address, or spine)."""
    multipath: bool = True
    """Spray packets over every path; when False each peer pair uses one hashed path (ECMP)."""
    ack_every: int = 16
    """Acknowledge after this many new packets from one sender..."""
    ack_delay_s: float = 0.0002
    """...or after this long, whichever comes first."""
    reorder_window_s: float = 0.001
    """A chunk is lost once one sent this much later on the same path has been acknowledged."""
    min_rto_s: float = 0.002
    """Lower bound of the retransmission timeout."""
    burst_packets: int = 64
    """Most datagrams handed out per ``datagrams_to_send`` call and path."""
    nic_rate_Bps: float = 0.0  # noqa: N815 (B = bytes)
    """Total sending rate of this rank (its NIC), shared by all peers; 0 = no local cap."""
    tx_quantum_packets: int = 4
    """Send when this many packets' worth of pacing tokens have accrued, at the NIC's pacer and
    toward a peer (like a GSO burst): fewer, larger batches and fewer passes for the same rate.
    Class 0 and a transfer's last few packets wait for one packet's tokens."""
    tx_quantum_min_packets: int = 0
    """0: the quantum is fixed. Else the quantum follows loss between this and
    ``tx_quantum_packets`` (:class:`~gradlane.scheduling.pacing.BurstControl`: halved on a loss
    event, at most once per ``min_rto_s``; one packet more per ``tx_quantum_grow_s`` without
    one), and the pacers' depths scale with it: short bursts where a queue drops their tails,
    long ones (fewer passes) where none does."""
    tx_quantum_grow_s: float = 0.1
    """With ``tx_quantum_min_packets``: time without a loss event per packet the quantum grows
    back."""
    tx_quantum_loss_thresh: float = 0.02
    """With ``tx_quantum_min_packets``: a loss event is more than this share of the datagrams
    sent lost (in a window of at least four full quanta and ``min_rto_s``), as BBRv2's 2%: a
    stray loss does not cut the bursts. 0: every loss does."""
    rx_coalesce_s: float = 0.0
    """Hold received datagrams up to this long to process them as one batch (like NIC
    interrupt moderation); 0 processes at the next driver call. While a batch waits, a socket
    wakeup only reads (the UDP plane runs no service pass unless something else is due)."""
    tick_s: float = 0.001
    """Period of the sender's housekeeping (retransmission timeouts, path health, resends)."""
    skip_late_droppable: bool = True
    """Let the sender skip droppable chunks that would miss the soft deadline (within budget)."""
    rotate: bool = False
    """Randomised Hadamard rotation of buckets, so a lost chunk becomes small spread-out noise."""
    rotate_block: int = 1024
    """Block of the rotation (a power of two)."""
    step_window: int = 64
    """Steps ahead of/behind the newest seen that packets may claim; others are stale."""
    ack_wait_s: float = 0.001
    """A collective whose outgoing data is not all acknowledged when its result is complete
    waits up to this long for the last acknowledgements before it hands the buffers back;
    only what is still owed then is copied out (peers may still ask for it). The wait is
    usually free — the peers that owe those acknowledgements finish later anyway — and it
    saves copying, at the end of every collective, the part of the shard still in flight
    (half of it, typically). 0 copies at once."""
    linger_s: float = 2.0
    """How long a finished transfer is remembered, to answer late packets with STOP; never less
    than ``loss.hard_deadline_s``, until which its sender may still ask."""
    early_buffer_bytes: int = 256 << 20
    """Bytes of packets for transfers not yet started locally that are held for later."""
    seed: int = 0
    """Seed of the endpoint's random generator (path choice tie-breaks)."""
    deterministic_sum: bool = False
    """Add the contributions to each shard in rank order, whatever order they arrive in, so a
    job's sums are the same bits on every run (as gloo's are). Contributions that come before
    their turn wait in a staging buffer (one float32 copy of the shard per peer, kept for
    reuse): about 5% more time at 4 ranks x 25 MB on loopback (docs/configuration.md); with
    two ranks the order cannot matter and nothing is staged. Off: arrival order, whose float32
    rounding differs from run to run by about 1e-8 relative."""
    socket_buffer_bytes: int = 16 << 20
    """SO_RCVBUF / SO_SNDBUF asked for every UDP socket (forced past ``net.core.rmem_max`` when
    the process may; otherwise capped by it, with a warning). Datagrams that overflow a receive
    buffer are lost and resent: size it for the bursts a rank receives at once."""
    udp_gso: bool = True
    """Send runs of equal-sized datagrams to one peer as one UDP GSO message (Linux >= 4.18)
    where the kernel has it: the stack is crossed once per message, not per datagram — what
    makes MTU-sized chunks (1.4 KB on a 1500-byte MTU) affordable. A path whose kernel or
    device refuses it falls back to one datagram per message by itself (counted as
    ``gso_refused``). No effect when every datagram is over half the 64 KB GSO limit (the
    loopback default)."""
    udp_gro: bool = True
    """Receive with UDP GRO (Linux >= 5.0) where datagrams are at most 4 KB: the kernel hands
    over a run of a peer's equal-sized datagrams as one message, which the UDP plane splits into
    its receive arena (a copy of bytes still in cache). Not for larger datagrams, where the
    copy costs about what the kernel saves (``udp.GRO_MAX_ROW``)."""
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    paths: PathConfig = field(default_factory=PathConfig)
    pacing: PacingConfig = field(default_factory=PacingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """The wire precision of float32 buckets' chunks (default: all float32, bit-exact sums);
    a policy's name alone (``precision="adaptive"``) selects it with the defaults."""

    def __post_init__(self) -> None:
        if isinstance(self.precision, str):  # a policy's name alone: precision="adaptive"
            object.__setattr__(self, "precision", PrecisionConfig(policy=self.precision))
        check_types(self)
        check_secret(self.secret)
        for name, kind in _NESTED.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ConfigError(
                    f"{name} must be a {kind.__name__}, got {type(value).__name__} "
                    f"(build nested settings from a mapping with TransportConfig.from_mapping)"
                )
        if not 0 <= self.job <= 0xFFFFFFFF:
            raise ConfigError(f"job={self.job}: the job token is a u32 (0..4294967295)")
        if self.chunk_bytes % 4 or not 64 <= self.chunk_bytes <= MAX_UDP_PAYLOAD - HEADER_SIZE:
            raise ConfigError(
                f"chunk_bytes={self.chunk_bytes}: use a multiple of 4 between 64 and "
                f"{MAX_UDP_PAYLOAD - HEADER_SIZE} (1408 for MTU 1500, 8192 for jumbo frames)"
            )
        if not 1 <= self.n_paths <= 64:
            raise ConfigError(f"n_paths={self.n_paths}: between 1 and 64 paths")
        if self.ack_every < 1 or self.ack_delay_s <= 0:
            raise ConfigError("ack_every must be >= 1 and ack_delay_s > 0")
        if self.min_rto_s <= 0 or self.reorder_window_s < 0:
            raise ConfigError("min_rto_s must be > 0 and reorder_window_s >= 0")
        if self.nic_rate_Bps < 0 or self.tick_s <= 0:
            raise ConfigError("nic_rate_Bps must be >= 0 (0 = uncapped) and tick_s > 0")
        if self.tx_quantum_packets < 1 or self.rx_coalesce_s < 0:
            raise ConfigError("tx_quantum_packets must be >= 1 and rx_coalesce_s >= 0")
        if not 0.0 < self.tx_quantum_grow_s < math.inf:
            raise ConfigError(f"tx_quantum_grow_s={self.tx_quantum_grow_s}: must be > 0")
        if not 0.0 <= self.tx_quantum_loss_thresh < 1.0:
            raise ConfigError(
                f"tx_quantum_loss_thresh={self.tx_quantum_loss_thresh}: must be in [0, 1)"
            )
        if not 0 <= self.tx_quantum_min_packets <= self.tx_quantum_packets:
            raise ConfigError(
                f"tx_quantum_min_packets={self.tx_quantum_min_packets}: between 0 (a fixed "
                f"quantum) and tx_quantum_packets={self.tx_quantum_packets}"
            )
        if self.burst_packets < 1:
            raise ConfigError(f"burst_packets={self.burst_packets}: at least 1")
        if self.socket_buffer_bytes < 4096:
            raise ConfigError(f"socket_buffer_bytes={self.socket_buffer_bytes}: at least 4096")
        if self.rotate_block < 1 or self.rotate_block & (self.rotate_block - 1):
            raise ConfigError(f"rotate_block={self.rotate_block}: must be a power of two")
        if self.rotate and self.precision.policy != "f32":
            raise ConfigError(
                f"rotate and precision policy {self.precision.policy!r} cannot be combined: "
                "a lossy chunk's error feedback would be in the wrong step's rotation; turn "
                "one of them off"
            )
        if not 0.0 <= self.ack_wait_s <= 1.0:
            raise ConfigError(f"ack_wait_s={self.ack_wait_s}: between 0 and 1 s (0 = no wait)")
        if self.step_window < 1:
            raise ConfigError("step_window must be >= 1")
        if self.linger_s < 0:
            raise ConfigError(f"linger_s={self.linger_s}: must be >= 0 seconds")
        if self.early_buffer_bytes < 0:
            raise ConfigError(
                f"early_buffer_bytes={self.early_buffer_bytes}: must be >= 0 (0 = hold nothing)"
            )
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed={self.seed}: a non-negative integer below 2**63")

    def __repr__(self) -> str:
        # The secret keys every packet's MAC: a log line or a traceback must not carry it.
        shown = (
            f"{f.name}={_masked(f.name, getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if f.repr
        )
        return f"{type(self).__name__}({', '.join(shown)})"

    @cached_property
    def tag_key(self) -> TagKey:
        """The tag key all ranks of this job derive from ``secret`` (unkeyed for None, '' and
        ``"off"``): derived once per config (the sender reads it for every transfer)."""
        return TagKey.from_secret(None if self.secret == SECRET_OFF else self.secret)

    def chunk_elems(self, dtype: int) -> int:
        """Elements per DATA packet for a wire dtype."""
        return self.chunk_bytes // ITEMSIZE[dtype]

    @property
    def slot_bytes(self) -> int:
        """Arena row size: header plus the largest payload, rounded up to 8 bytes."""
        return (HEADER_SIZE + self.chunk_bytes + 7) // 8 * 8

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TransportConfig:
        """Build from a flat or nested mapping (TOML table, parsed flags).

        Nested tables ``priority``, ``loss``, ``paths``, ``pacing`` and ``precision`` fill the
        policy configs; unknown keys are an error that names them. ``precision`` may also be
        just a policy's name (``precision = "adaptive"``).
        """
        nested = _NESTED
        own = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key == "precision" and isinstance(value, str):
                kwargs[key] = PrecisionConfig(policy=value)  # a policy's name alone
                continue
            if key in nested and isinstance(value, nested[key]):
                kwargs[key] = value
            elif key in nested:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"[{key}] must be a table of settings")
                sub = nested[key]
                known = {f.name for f in dataclasses.fields(sub)}
                bad = sorted(set(value) - known)
                if bad:
                    raise ConfigError(f"unknown [{key}] setting(s) {bad}; valid: {sorted(known)}")
                tuples = {f.name for f in dataclasses.fields(sub) if isinstance(f.default, tuple)}
                kwargs[key] = sub(**{k: _tuple(v, k in tuples) for k, v in value.items()})
            elif key in own:
                kwargs[key] = value
            else:
                raise ConfigError(f"unknown setting {key!r}; valid: {sorted(own)}")
        return cls(**kwargs)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> TransportConfig:
        """Build from ``GRADLANE_*`` variables (``GRADLANE_LOSS__LOSS_BOUND=0.02`` for nested).

        A variable names its field case-insensitively (``GRADLANE_NIC_RATE_BPS`` sets
        ``nic_rate_Bps``) and its value is parsed by the field's declared type
        (:func:`parse_env_value`): a secret stays a string even when it is all digits, and a
        list setting takes comma-separated values (``GRADLANE_PRIORITY__PINNED_LAYERS=0,2``).
        ``overrides`` (field names, nested tables as mappings) win over the environment.
        """
        env = os.environ if environ is None else environ
        tree: dict[str, Any] = {}
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or var in _NOT_CONFIG:
                continue
            if var.startswith(_NOT_CONFIG_PREFIXES):
                continue
            parts = var[len(ENV_PREFIX) :].split("__")
            if len(parts) == 1:
                name, hint = env_field(cls, parts[0], var)
                if name == "precision":  # a policy's name: GRADLANE_PRECISION=adaptive
                    tree.setdefault(name, {})["policy"] = raw.strip()
                    continue
                if name in _NESTED:
                    raise ConfigError(
                        f"{var}: [{name}] is a table; set one of its fields as "
                        f"{ENV_PREFIX}{name.upper()}__<FIELD>"
                    )
                tree[name] = parse_env_value(var, raw, hint)
            elif len(parts) == 2 and parts[0].lower() in _NESTED:
                table = parts[0].lower()
                name, hint = env_field(_NESTED[table], parts[1], var)
                tree.setdefault(table, {})[name] = parse_env_value(var, raw, hint)
            else:
                raise ConfigError(
                    f"unknown setting {var}: use {ENV_PREFIX}<FIELD> or "
                    f"{ENV_PREFIX}<TABLE>__<FIELD> with a table in {sorted(_NESTED)}"
                )
        for key, value in overrides.items():
            if key in _NESTED and isinstance(value, Mapping) and isinstance(tree.get(key), dict):
                tree[key] = {**tree[key], **value}
            else:
                tree[key] = value
        return cls.from_mapping(tree)


#: The nested policy configs and their types (checked at construction: a plain dict there
#: would only fail deep inside a running data plane).
_NESTED: dict[str, type] = {
    "priority": PriorityConfig,
    "loss": LossConfig,
    "paths": PathConfig,
    "pacing": PacingConfig,
    "precision": PrecisionConfig,
}

#: The prefix of every gradlane environment variable.
ENV_PREFIX = "GRADLANE_"

#: The ``secret`` that means unkeyed tags (``GRADLANE_SECRET=off``); unlike None, it also keeps
#: the DDP hook from sharing a secret of its own.
SECRET_OFF = "off"
#: Values that read as a switch rather than a secret: refused, so that ``GRADLANE_SECRET=false``
#: is not silently taken as the (guessable) secret "false".
_SWITCH_WORDS = frozenset({"off", "false", "no", "none", "null", "0", "disable", "disabled",
                           "unkeyed", "auto", "on", "true", "yes", "1"})  # fmt: skip
#: Fields whose value no message may show.
_HIDDEN = frozenset({"secret"})


def check_secret(secret: str | None) -> None:
    """``ConfigError`` for a ``secret`` that reads as a switch (``"false"``, ``"none"``,
    ``"Off"``, ``" off"``, ``"auto"``, ...) but is not exactly :data:`SECRET_OFF`: such a value
    names itself in the message (it is no secret)."""
    if secret is None or secret == SECRET_OFF:
        return
    if isinstance(secret, str) and secret.strip().lower() in _SWITCH_WORDS:
        raise ConfigError(
            f"secret={secret!r} reads as a switch, not a secret: for unkeyed packet tags write "
            f"exactly {SECRET_OFF!r} (GRADLANE_SECRET={SECRET_OFF}); left unset, the DDP hook "
            "shares a secret through the job's store; otherwise give a real secret"
        )


def _masked(name: str, value: Any) -> str:
    """``repr(value)``, but a set secret shows as ``<hidden>``."""
    if name in _HIDDEN and value and value != SECRET_OFF:
        return "<hidden>"
    return repr(value)


#: GRADLANE_* variables that are not transport settings (read by other components).
_NOT_CONFIG = frozenset(
    {
        "GRADLANE_FASTMATH",
        "GRADLANE_MODE",
        "GRADLANE_LOG",
        "GRADLANE_NO_MMSG",
        "GRADLANE_NO_GSO",
        "GRADLANE_NO_GRO",
        "GRADLANE_TESTBED_USERNS",
    }
)
#: Prefixes of other components' settings (the DDP hook's, the daemon's).
_NOT_CONFIG_PREFIXES = ("GRADLANE_HOOK__", "GRADLANE_DAEMON__")

_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def _hints(cls: type) -> dict[str, Any]:
    """Declared types of the init fields of dataclass ``cls`` (annotations are strings here:
    resolved once per class)."""
    found = _HINTS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    return found


_HINTS: dict[type, dict[str, Any]] = {}


def env_field(cls: type, key: str, var: str) -> tuple[str, Any]:
    """The field of dataclass ``cls`` that ``key`` (from variable ``var``) names, matched
    case-insensitively, and its declared type; a ``ConfigError`` listing the valid names."""
    hints = _hints(cls)
    by_lower = {name.lower(): name for name in hints}
    name = by_lower.get(key.lower())
    if name is None:
        prefix = var[: len(var) - len(key)]
        valid = sorted(prefix + n.upper() for n in hints)
        raise ConfigError(f"unknown setting {var}; valid: {valid}")
    return name, hints[name]


def env_settings(cls: type, environ: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The fields of dataclass ``cls`` set by ``<prefix><FIELD>`` variables (one level, field
    names matched case-insensitively, values parsed by :func:`parse_env_value`)."""
    out: dict[str, Any] = {}
    for var, raw in environ.items():
        if var.startswith(prefix):
            name, hint = env_field(cls, var[len(prefix) :], var)
            out[name] = parse_env_value(var, raw, hint)
    return out


def parse_env_value(var: str, raw: str, hint: Any) -> Any:
    """Environment variable ``var``'s text ``raw`` as a value of the declared type ``hint``.

    ``bool``: true/yes/on/1 or false/no/off/0; ``int``, ``float``: Python literals; ``str``:
    the text, stripped; ``str | None`` (a secret): the text as it is, '' = None; ``X | None``:
    '' or ``none`` = None; a ``Literal``: one of its values; ``tuple[X, ...]``: comma-separated
    (``;`` between the rows of a tuple of tuples). A list element that does not parse is passed
    on as text, for the component's own check to judge with what it means; any other value
    that does not parse is a ``ConfigError`` naming the variable.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and type(None) in args:
            if inner[0] in (str, bytes):
                return (raw.encode() if inner[0] is bytes else raw) if raw else None
            if raw.strip().lower() in ("", "none"):
                return None
            return parse_env_value(var, raw, inner[0])
        return raw.strip()
    if origin is tuple:
        item = args[0] if args else str
        if typing.get_origin(item) is tuple:
            rows = [r for r in raw.split(";") if r.strip()]
            return tuple(parse_env_value(var, r, item) for r in rows)
        parts = [p.strip() for p in raw.split(",") if p.strip()]
        return tuple(_lenient(var, p, item) for p in parts)
    if origin is typing.Literal:
        text = raw.strip()
        for choice in args:
            if str(choice) == text:
                return choice
        raise ConfigError(f"{var}={raw!r}: one of {', '.join(map(str, args))}")
    if hint is bool:
        low = raw.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ConfigError(f"{var}={raw!r}: a boolean (true/false, yes/no, on/off, 1/0)")
    if hint in (int, float):
        try:
            return hint(raw.strip())
        except ValueError:
            what = "an integer" if hint is int else "a number"
            raise ConfigError(f"{var}={raw!r}: {what}") from None
    if hint is bytes:
        return raw.encode()
    if hint is str:
        return raw.strip()
    raise ConfigError(f"{var}: this setting cannot come from the environment (use TOML or code)")


def check_types(config: object) -> None:
    """``ConfigError`` for a field of dataclass ``config`` whose value is not of its declared
    scalar type (an int for ``int``, a number for ``float``, a bool for ``bool``, text for
    ``str``; ``None`` where allowed), naming the field, the value and the type wanted: a string
    where a number belongs would otherwise fail later inside a comparison."""
    for name, hint in _hints(type(config)).items():
        value = getattr(config, name)
        args = typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
            if value is None:
                continue
            rest = [a for a in args if a is not type(None)]
            check = _SCALAR_CHECKS.get(rest[0]) if len(rest) == 1 else None
        else:
            check = _SCALAR_CHECKS.get(hint)
        if check is not None and not check[0](value):
            shown = "<hidden>" if name in _HIDDEN else repr(value)
            raise ConfigError(f"{name}={shown}: must be {check[1]}, got a {type(value).__name__}")


#: Per scalar type: a test of a value, and the words for it.
_SCALAR_CHECKS: dict[Any, tuple[Any, str]] = {
    int: (lambda v: isinstance(v, Integral) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, Real) and not isinstance(v, bool), "a number"),
    bool: (lambda v: isinstance(v, bool | np.bool_), "a boolean"),
    str: (lambda v: isinstance(v, str), "text"),
}


def _lenient(var: str, raw: str, hint: Any) -> Any:
    """A list element: parsed by ``hint``, else kept as text (see :func:`parse_env_value`)."""
    try:
        return parse_env_value(var, raw, hint)
    except ConfigError:
        return raw


def _tuple(value: Any, wanted: bool = False) -> Any:
    """TOML arrays become tuples. For a tuple setting (``wanted``) a string is split at commas
    (a flag's list) and a lone value becomes a one-tuple."""
    if isinstance(value, list | tuple):
        return tuple(value)
    if not wanted:
        return value
    if isinstance(value, str):
        return tuple(_number(part.strip()) for part in value.split(",") if part.strip())
    return (value,)


def _number(text: str) -> Any:
    """``text`` as an int or a float where it is one, else the text."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def loopback_config(**overrides: Any) -> TransportConfig:
    """A config for ranks on one host (loopback): two paths (127.0.0.1 and 127.0.0.2), the
    largest datagrams the loopback MTU allows (65000-byte chunks: fewest packets per byte, the
    one lever that matters when each datagram costs a system call), and pacing that starts at
    memory speed (10 GB/s per path, 16 MiB bursts) at a fixed rate: on one host there is no
    network to congest, and the interpreter's scheduling jitter reads as queueing delay to a
    delay-based controller, which would throttle a large all-reduce well below its speed.
    Sending passes of up to 256 datagrams per path (fewer, larger batches; the 16 MiB burst is
    what lets a pass reach 256), and 64 MiB socket buffers (forced when permitted): smaller
    ones overflow when several ranks send large buckets at once. What still overflows them
    is recovered like any loss.
    ``overrides`` replace any field (e.g. ``loss=LossConfig(...)``).
    """
    values: dict[str, Any] = {
        "n_paths": 2,
        "chunk_bytes": 65000,
        "burst_packets": 256,
        "socket_buffer_bytes": 64 << 20,
        "pacing": PacingConfig(controller="fixed", initial_rate_Bps=1e10, burst_bytes=16 << 20),
    }
    values.update(overrides)
    return TransportConfig(**values)
