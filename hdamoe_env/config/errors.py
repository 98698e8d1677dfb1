"""Typed errors of the package.

Every error raised at a public boundary says what was wrong, the value received, what was
expected and how to fix it (style.md R8).
"""

from __future__ import annotations

from collections.abc import Iterable

# defined in the bottom layer (so trace errors share the base class); re-exported here
from traces.errors import (ConfigError, HdMoeError, InputFileError, TraceFormatError,
                           UnknownNameError, unknown_name_message)

__all__ = [
    "ConfigError",
    "DependencyNotInstalled",
    "HdMoeError",
    "InfeasibleError",
    "InputFileError",
    "IntegrityError",
    "InvalidAction",
    "LockedError",
    "OutputPathError",
    "ResourceLimitError",
    "SolverError",
    "TraceFormatError",
    "UnknownNameError",
    "UntrustedFileError",
    "unknown_name",
]


class InfeasibleError(ConfigError):
    """A valid request that cannot be satisfied (e.g. a memory cap below what the placement needs)."""


class OutputPathError(ConfigError):
    """An output path cannot be used: a directory given as a file (or the reverse), a parent that
    is not a directory or not writable, or existing files the command would overwrite."""


class IntegrityError(HdMoeError):
    """A file does not match the checksum recorded for it (modified, replaced or corrupted)."""


class UntrustedFileError(ConfigError):
    """A file that can run code when loaded (an SB3 ``.zip``) is neither signed by this user's
    key nor loaded with explicit consent (``--trust-model`` / ``trust=True``)."""


class LockedError(OutputPathError):
    """An output is being written by another process (the message names it: pid, host, command)."""


class ResourceLimitError(ConfigError):
    """A run would need more memory than the machine can give it (estimate in the message)."""


class InvalidAction(HdMoeError, ValueError):
    """An action passed to ``HdMoeEnv.step`` is outside the action space or violates its mask."""


class SolverError(HdMoeError, RuntimeError):
    """An optimiser stopped without a usable solution."""


class DependencyNotInstalled(HdMoeError, ImportError):
    """An optional dependency (an extra of the distribution) is missing."""


def unknown_name(kind: str, name: object, choices: Iterable[str]) -> ConfigError:
    """Build a ``ConfigError`` for an unknown registry name, suggesting a near miss.

    Args:
        kind: What was looked up ("model preset", "topology", ...).
        name: The name received.
        choices: The valid names.

    Returns:
        The error (to be raised by the caller).
    """
    return ConfigError(unknown_name_message(kind, name, choices))
