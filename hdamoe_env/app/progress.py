"""The one progress helper of the application layer.

A tqdm bar on stderr when stderr is a terminal and tqdm is installed; otherwise nothing (so logs
and pipes stay free of ``\\r`` frames). Library code never shows progress itself: it accepts a
``progress`` factory or an ``on_*`` callback, and the commands pass this one in.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["bar", "factory", "wrap"]


class _Silent:
    """A bar that shows nothing (no terminal, no tqdm, or progress switched off)."""

    def update(self, n: int = 1) -> None:
        """Ignore progress."""

    def close(self) -> None:
        """Nothing to close."""


def bar(total: int | None, desc: str = "", *, enabled: bool = True, unit: str = "it") -> Any:
    """Return a progress bar with ``update(n)`` and ``close()``.

    Args:
        total: Number of steps (None: unknown).
        desc: Label.
        enabled: False gives a silent bar.
        unit: Unit shown by tqdm.
    """
    if not enabled or not sys.stderr.isatty():
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        return _Silent()
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)


def factory(enabled: bool = True) -> Callable[[int, str], Any]:
    """Return ``progress(total, desc)`` for library code that takes a bar factory."""
    return lambda total, desc: bar(total, desc, enabled=enabled)


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
