"""Numeric limits of a run: what the boundary accepts, and the memory pre-flight.

Every value that enters a run from a user (a command-line option, a keyword of the Python API, a
field of a file) is checked once, at the boundary (``hdamoe_env.config.run``), against the limits
declared here. The limits are not physics: they are the widest ranges in which the cost model's
numbers still mean something (a NoC hop of a second, or a link of 10^300 GB/s, is not a chip the
model describes) and in which the simulator finishes in bounded time and memory. Each bound names
its reason; docs/PHYSICS.md ("Input bounds") repeats them.

The memory estimates are deliberately coarse upper bounds measured on the simulator: a decode
batch of B tokens costs about ``3 × 8 × B × (k·D + E)`` bytes at its peak (the per-token expert
and node tables of the DES and the gating), a synthetic trace about ``24 × rows × L × k`` bytes
while it is generated (≈ 750 rows per request), and the NoC tables about ``8 × D²`` bytes per
table (routes between every pair of nodes).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hdamoe_env.config.errors import ConfigError, ResourceLimitError
# the input-file caps are enforced by the bottom layer's reader (traces.io); declared there once
from traces.io import MAX_INPUT_BYTES, MAX_JSON_DEPTH, max_input_bytes

__all__ = ["HARDWARE_BOUNDS", "MAX_INPUT_BYTES", "MAX_JSON_DEPTH", "MAX_MESH_NODES",
           "MAX_MESH_SIDE", "ROWS_PER_REQUEST", "SEED_MAX", "SKEW_RANGE", "Bound",
           "available_bytes", "batch_bytes", "check_bound", "check_fits", "max_input_bytes",
           "mesh_bytes", "trace_bytes"]


@dataclass(frozen=True, slots=True)
class Bound:
    """A closed range ``[low, high]`` of one input value, with its unit and reason.

    Attributes:
        low: Smallest accepted value.
        high: Largest accepted value.
        unit: Unit of the value (for messages).
        reason: Why this range (one sentence).
    """

    low: float
    high: float
    unit: str
    reason: str


#: Accepted ranges of the ``HardwareSpec`` fields a user can set (setting, overrides).
HARDWARE_BOUNDS: dict[str, Bound] = {
    "compute_tflops": Bound(1e-3, 1e5, "TFLOPS per node",
                            "from a microcontroller to far beyond any single die"),
    "link_bw_gbps": Bound(1e-3, 1e6, "GB/s per link",
                          "from a serial debug link to 1000x today's fastest die-to-die links"),
    "mem_bw_gbps": Bound(1e-3, 1e7, "GB/s per node",
                         "from a serial flash to 1000x a stacked-DRAM vault"),
    "hop_latency_ns": Bound(0.0, 1e6, "ns per hop",
                            "0 (ideal) to 1 ms; an on-chip hop takes about 1-10 ns and a "
                            "board-level hop about 1 µs"),
    "node_dram_gib": Bound(1e-6, 1e6, "GiB per node",
                           "a few KiB to 1 PiB; beyond it the cap never binds"),
}

#: Skew power τ of a synthetic trace: p^τ stays representable (no underflow to all-zero rows).
SKEW_RANGE = Bound(1e-2, 1e2, "", "p^τ of the fitted popularity underflows beyond 100 and "
                   "is uniform to 1e-3 below 0.01")

#: Largest seed: NumPy's legacy seeding and SB3's ``set_random_seed`` take 32-bit seeds.
SEED_MAX = 2**32 - 1

#: Nodes per mesh side and in total: the NoC tables grow with D² (routes between every pair).
MAX_MESH_SIDE = 1024
MAX_MESH_NODES = 16384

_BASE = 400 * 2**20                 # interpreter, numpy, numba and the model tables
ROWS_PER_REQUEST = 750


def check_bound(name: str, value: object, bound: Bound, fix: str = "") -> float:
    """Return ``value`` as a float when it is a finite number inside ``bound``.

    Args:
        name: What the value is (for the message), e.g. ``"--hop-latency-ns"``.
        value: The value received.
        bound: The accepted range.
        fix: How to fix it (appended to the message).

    Raises:
        ConfigError: Not a number, not finite, or outside the range (the message names the
            value, the range, its reason and ``fix``).
    """
    where = f"[{bound.low:g}, {bound.high:g}]" + (f" {bound.unit}" if bound.unit else "")
    if isinstance(value, bool) or not isinstance(value, int | float) and not hasattr(
            value, "__float__"):
        raise ConfigError(f"{name} must be a number in {where}, got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(number) and bound.low <= number <= bound.high):
        raise ConfigError(f"{name}={value!r} is outside {where} ({bound.reason})"
                          + (f"; {fix}" if fix else ""))
    return number


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


def mesh_bytes(num_nodes: int) -> int:
    """Peak bytes of the NoC tables of ``num_nodes`` nodes (a few D×D tables of int64)."""
    return _BASE + 4 * 8 * int(num_nodes) ** 2


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
