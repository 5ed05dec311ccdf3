"""The gradlane error taxonomy's root, shared by every package.

It lives in ``scheduling`` (the bottom layer) so that pure policy code can raise
``ConfigError`` without importing the transport; ``gradlane.transport.errors`` re-exports it.
"""

from __future__ import annotations


class GradlaneError(Exception):
    """Base class of every error gradlane raises on purpose."""


class ConfigError(GradlaneError, ValueError):
    """A configuration value is invalid; the message says which and what would be valid."""
