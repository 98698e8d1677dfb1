"""The one progress helper of the application layer.

On a terminal: a tqdm bar on stderr (when tqdm is installed). Off a terminal (logs, pipes, CI):
no ``\\r`` frames, but one plain line per stage on stderr when it finishes —
``"{desc}: {n}/{total} {unit} in {s} s"`` — and, for a stage that runs long, a line every
:data:`LINE_INTERVAL_S` seconds, so a long placement is never silent. ``enabled=False``
(``--no-progress``) and :func:`set_quiet` (``hdamoe -q``) silence both. Library code never shows
progress itself: it accepts a ``progress`` factory or an ``on_*`` callback, and the commands pass
this one in.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["LINE_INTERVAL_S", "bar", "factory", "set_quiet", "stage", "wrap"]

#: Seconds between two progress lines of one long stage when stderr is not a terminal.
LINE_INTERVAL_S = 60.0

_QUIET = False


def set_quiet(quiet: bool) -> None:
    """Silence every bar and progress line of this process (``hdamoe -q``)."""
    global _QUIET
    _QUIET = bool(quiet)


class _Silent:
    """A bar that shows nothing (progress switched off)."""

    def update(self, n: int = 1) -> None:
        """Ignore progress."""

    def set_postfix_str(self, text: str) -> None:
        """Ignore the status text."""

    def close(self) -> None:
        """Nothing to close."""


class _Lines:
    """Off a terminal: one plain line per stage on stderr (and one per interval when long)."""

    def __init__(self, total: int | None, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit = total, desc or "progress", unit
        self.n = 0
        self.postfix = ""
        self.t0 = self.last = time.perf_counter()
        self.closed = False

    def _line(self, elapsed: float, final: bool) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        state = "" if final else " (running)"
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}{of} {self.unit} in {elapsed:.1f} s{state}{extra}",
              file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        """Count progress; print a line when the stage has run another interval."""
        self.n += n
        now = time.perf_counter()
        if now - self.last >= LINE_INTERVAL_S:
            self.last = now
            self._line(now - self.t0, final=False)

    def set_postfix_str(self, text: str) -> None:
        """Attach a short status text to the next line."""
        self.postfix = text

    def close(self) -> None:
        """Print the stage's line (once)."""
        if not self.closed:
            self.closed = True
            self._line(time.perf_counter() - self.t0, final=True)


def bar(total: int | None, desc: str = "", *, enabled: bool = True, unit: str = "it") -> Any:
    """Return a progress bar with ``update(n)``, ``set_postfix_str(text)`` and ``close()``.

    Args:
        total: Number of steps (None: unknown).
        desc: Label (the stage's name in the plain line).
        enabled: False gives a silent bar.
        unit: Unit shown.
    """
    if not enabled or _QUIET:
        return _Silent()
    if not sys.stderr.isatty():
        return _Lines(total, desc, unit)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: plain lines instead
        return _Lines(total, desc, unit)
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)


def factory(enabled: bool = True) -> Callable[[int, str], Any]:
    """Return ``progress(total, desc)`` for library code that takes a bar factory."""
    return lambda total, desc: bar(total, desc, enabled=enabled)


def stage(desc: str, *, enabled: bool = True) -> Any:
    """Return a bar for a stage without steps (one line with its duration when it ends)."""
    return bar(None, desc, enabled=enabled, unit="done")


def wrap(iterable: Iterable[Any], total: int | None = None, desc: str = "",
         *, enabled: bool = True) -> Iterable[Any]:
    """Iterate over ``iterable`` with a progress bar (see :func:`bar`)."""
    b = bar(total, desc, enabled=enabled)
    try:
        for item in iterable:
            yield item
            b.update(1)
    finally:
        b.close()
