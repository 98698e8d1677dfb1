"""Typed errors of the package.

Every error raised at a public boundary says what was wrong, the value received, what was
expected and how to fix it (style.md R8).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from traces.errors import TraceFormatError  # defined in the bottom layer; re-exported here

__all__ = [
    "ConfigError",
    "DependencyNotInstalled",
    "HdMoeError",
    "InfeasibleError",
    "InvalidAction",
    "SolverError",
    "TraceFormatError",
    "unknown_name",
]


class HdMoeError(Exception):
    """Base class of every error raised by hdamoe-env."""


class ConfigError(HdMoeError, ValueError):
    """A specification, preset name, knob or argument is invalid."""


class InfeasibleError(ConfigError):
    """A valid request that cannot be satisfied (e.g. a memory cap below what the placement needs)."""


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
    options = sorted(choices)
    hint = difflib.get_close_matches(str(name), options, n=1)
    msg = f"unknown {kind} {name!r}; expected one of {options}"
    if hint:
        msg += f" (did you mean {hint[0]!r}?)"
    return ConfigError(msg)
