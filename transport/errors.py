"""Error taxonomy of the transport: one root, :class:`GradlaneError`, and a typed error per cause.

Remote garbage never propagates as a crash: decoders raise ``ProtocolError`` with a typed
``Reason``, the receive boundary catches it and counts it. ``PeerTimeout`` names who was late.
"""

from __future__ import annotations

from gradlane.scheduling.errors import ConfigError, GradlaneError

__all__ = ["ConfigError", "GradlaneError", "PeerTimeout", "ProtocolError", "TransferFailed"]


class ProtocolError(GradlaneError):
    """A datagram failed validation; ``reason`` is a ``wire.header.Reason``."""

    def __init__(self, reason: int, detail: str = "") -> None:
        from gradlane.transport.wire.header import Reason  # noqa: PLC0415 (header imports this module)

        self.reason = Reason(reason)
        super().__init__(f"{self.reason.name.lower()}: {detail}" if detail else self.reason.name)


class PeerTimeout(GradlaneError):
    """Peers did not deliver within the hard deadline of a transfer.

    ``ranks`` are the senders whose data was missing, ``step`` and ``bucket`` name the transfer.
    """

    def __init__(self, ranks: tuple[int, ...], step: int, bucket: int, phase: str, waited_s: float):
        self.ranks = ranks
        self.step = step
        self.bucket = bucket
        self.phase = phase
        self.waited_s = waited_s
        who = ", ".join(str(r) for r in ranks)
        super().__init__(
            f"rank(s) {who} did not deliver step {step} bucket {bucket} ({phase} phase) "
            f"within the hard deadline of {waited_s:.3f}s"
        )


class TransferFailed(GradlaneError):
    """A transfer or collective could not complete for a reason other than a late peer."""
