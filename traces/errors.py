"""Errors of the trace layer (kept here so that ``traces`` imports nothing of the core)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "HdMoeError", "InputFileError", "TraceFormatError", "UnknownNameError", "unknown_name",
           "unknown_name_message"]


class HdMoeError(Exception):
    """Base class of every error raised by hdamoe-env (traces, core, agents, baselines, app).

    Defined in the bottom layer so that trace errors are ``HdMoeError``s too;
    ``hdamoe_env.config.errors`` re-exports it.
    """


class ConfigError(HdMoeError, ValueError):
    """A specification, preset name, knob or argument is invalid.

    Defined in the bottom layer so that the checks shared with the core (the batch size,
    ``traces.batching.check_batch``) raise it; ``hdamoe_env.config.errors`` re-exports it.
    """


class TraceFormatError(HdMoeError, ValueError):
    """A trace file or array is malformed.

    The message names the file, the array or layer key, the first offending row and what was
    expected.
    """


class InputFileError(HdMoeError, ValueError):
    """An input file cannot be read safely: missing, not a regular file (a FIFO, a device, a
    directory), larger than the input size cap, or JSON nested deeper than the depth cap."""


class UnknownNameError(HdMoeError, ValueError):
    """A registry name (model key, view, batching mode) is unknown; the message suggests a match."""


def unknown_name(kind: str, name: object, choices: Iterable[str]) -> UnknownNameError:
    """Build an :class:`UnknownNameError` for ``name``, suggesting the closest valid name.

    Args:
        kind: What was looked up ("model key", "view", ...).
        name: The name received.
        choices: The valid names.

    Returns:
        The error, to be raised by the caller.
    """
    return UnknownNameError(unknown_name_message(kind, name, choices))


def unknown_name_message(kind: str, name: object, choices: Iterable[str]) -> str:
    """Return "unknown KIND 'NAME'; expected one of [...] (did you mean 'X'?)" for any error class.

    The one implementation of the near-miss hint; ``hdamoe_env.config.errors.unknown_name`` wraps it in a
    ``ConfigError``.
    """
    options = sorted(choices)
    hint = difflib.get_close_matches(str(name), options, n=1)
    msg = f"unknown {kind} {name!r}; expected one of {options}"
    if hint:
        msg += f" (did you mean {hint[0]!r}?)"
    return msg
