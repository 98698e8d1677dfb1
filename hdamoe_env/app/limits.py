"""Up-front resource estimates: refuse a run that cannot fit in memory before it starts.

The estimates are deliberately coarse upper bounds measured on the simulator:
a decode batch of B tokens costs about ``3 × 8 × B × (k·D + E)`` bytes at its peak (the
per-token expert and node tables of the DES and the gating), a synthetic trace about
``24 × rows × L × k`` bytes while it is generated (≈ 730 rows per request).
"""

from __future__ import annotations

import os

from hdamoe_env.config.errors import ResourceLimitError

__all__ = ["available_bytes", "batch_bytes", "check_fits", "trace_bytes"]

_BASE = 400 * 2**20                 # interpreter, numpy, numba and the model tables
ROWS_PER_REQUEST = 750


def available_bytes() -> int:
    """Return the memory available to a new run (``MemAvailable``; total RAM as a fallback)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def batch_bytes(batch: int, num_experts: int, top_k: int, num_nodes: int) -> int:
    """Peak bytes of simulating decode steps of ``batch`` tokens."""
    return _BASE + 3 * 8 * int(batch) * (top_k * num_nodes + num_experts)


def trace_bytes(requests: int, num_layers: int, top_k: int) -> int:
    """Peak bytes of generating a synthetic trace of ``requests`` requests."""
    return _BASE + 24 * ROWS_PER_REQUEST * int(requests) * num_layers * top_k


def check_fits(need: int, what: str, fix: str, available: int | None = None) -> None:
    """Raise when ``need`` bytes exceed the available memory.

    Raises:
        ResourceLimitError: With the estimate, the available memory and ``fix``.
    """
    have = available_bytes() if available is None else available
    if need > have:
        raise ResourceLimitError(f"{what} needs about {need / 2**30:.1f} GiB of memory but "
                                 f"{have / 2**30:.1f} GiB are available; {fix}")
