"""Errors of the trace layer (kept here so that ``traces`` imports nothing of the core)."""

from __future__ import annotations

__all__ = ["TraceFormatError"]


class TraceFormatError(ValueError):
    """A trace file or array is malformed.

    The message names the file, the array or layer key, the first offending row and what was
    expected.
    """
