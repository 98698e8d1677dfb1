"""Judgement knobs of the ``faithful`` profile as explicit uncertainties with credible ranges.

A cost-model value that no source fixes is not a silent single default: it is listed here with
the range a reader could defend and the reason for that range (docs/PHYSICS.md repeats both).
Consumers: ``hdamoe crossover --robust`` samples every uncertainty jointly (Latin hypercube) and
reports, per cell, whether the winner survives; the profile keeps one point of each range (its
default) so single runs stay reproducible.

Every knob named here is a field of :class:`~hdamoe_env.config.profiles.Conventions`; a
sample is applied through a derived profile name (``faithful+tile_cols=32+...``), so every record
still names the conventions that produced it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.config.profiles import Conventions, get_profile

__all__ = ["UNCERTAINTIES", "Uncertainty", "latin_hypercube", "sample_profiles"]


@dataclass(frozen=True, slots=True)
class Uncertainty:
    """One judgement knob with its credible range.

    Attributes:
        knob: Field name of ``Conventions``.
        low: Smallest credible value.
        high: Largest credible value.
        reason: Why this range (one sentence; PHYSICS.md gives the sources).
        scale: ``"linear"`` or ``"log"`` (sample uniformly in the value or in its logarithm).
        integer: Round samples to integers (tile sizes).
        choices: If set, the knob takes only these values (e.g. powers of two for tile
            widths); samples snap to the nearest choice (in the sampling scale).
    """

    knob: str
    low: float
    high: float
    reason: str
    scale: str = "linear"
    integer: bool = False
    choices: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.scale not in ("linear", "log"):
            raise ConfigError(f"Uncertainty.scale={self.scale!r}; expected 'linear' or 'log'")
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low <= self.high):
            raise ConfigError(f"Uncertainty {self.knob}: need finite low <= high, got "
                              f"[{self.low}, {self.high}]")
        if self.scale == "log" and self.low <= 0:
            raise ConfigError(f"Uncertainty {self.knob}: a log-scale range needs low > 0")

    def value_at(self, u: float) -> Any:
        """Map a quantile ``u`` in [0, 1) to a value of the range (respecting scale and choices)."""
        if self.scale == "log":
            lo, hi = math.log(self.low), math.log(self.high)
            x = math.exp(lo + u * (hi - lo))
        else:
            x = self.low + u * (self.high - self.low)
        if self.choices:
            key = (lambda c: abs(math.log(c) - math.log(x))) if self.scale == "log" else (
                lambda c: abs(c - x))
            x = min(self.choices, key=key)
        if self.integer:
            return int(round(x))
        return float(x)


#: The credible ranges of the ``faithful`` judgement knobs (docs/PHYSICS.md, "Uncertainties").
UNCERTAINTIES: dict[str, Uncertainty] = {
    u.knob: u for u in (
        Uncertainty("tile_tokens", 1, 32, "reconfigurable arrays (8-row units) to fixed GPU-like "
                    "16-32-row tiles", scale="log", integer=True, choices=(1, 2, 4, 8, 16, 32)),
        Uncertainty("tile_cols", 16, 128, "16-wide reconfigurable arrays to fixed 128-wide "
                    "systolic arrays", scale="log", integer=True, choices=(16, 32, 64, 128)),
        Uncertainty("gemm_overhead_s", 10e-9, 1e-6, "a pipelined array fill (tens of cycles) "
                    "to a kernel launch per GEMM (about 1 us)", scale="log"),
        Uncertainty("hop_latency_s", 1e-9, 5e-9, "1-cycle router+link at 1 GHz to a 3-stage "
                    "router at 1 GHz plus a 2-cycle link", scale="linear"),
        Uncertainty("ni_latency_hops", 0.25, 1.0, "latency of a network-interface port in hop "
                    "latencies: a 1-cycle local-port crossing of a 4-cycle router to a full router "
                    "pipeline per port; BookSim 2.0 measures 3 of 4 cycles (docs/PHYSICS.md §16)",
                    scale="linear"),
        Uncertainty("msg_alpha_s", 20e-9, 500e-9, "a hardware NI injection to a DMA descriptor "
                    "set-up by a core", scale="log"),
        Uncertainty("col_granularity", 8, 64, "8-column reconfigurable systolic tiles of the "
                    "3D-NMP logic die (arXiv 2604.04253) to a fixed 64-wide array",
                    scale="log", integer=True, choices=(8, 16, 32, 64)),
        Uncertainty("dram_efficiency", 0.70, 0.95, "sustained streaming reads: refresh alone "
                    "costs several percent (AMD PG276, tRFC/tREFI), HBM controllers sustain at "
                    "most 90 % of peak at >= 75 % page hits and 50 % below (AMD UG1556)",
                    scale="linear"),
        Uncertainty("nonmoe_ctx_len", 512, 8192, "short chat turns (Azure conversation 20th "
                    "percentile 526) to long code/agent contexts (Azure code 95th percentile "
                    "7035 tokens, 8k context windows)", scale="log", integer=True),
    )
}


def latin_hypercube(n: int, dims: int, rng: np.random.Generator) -> np.ndarray:
    """Return an ``(n, dims)`` Latin-hypercube sample of [0, 1)^dims.

    Each column has exactly one point in each of the n equal strata, in a random order.
    """
    if n < 1 or dims < 0:
        raise ConfigError(f"latin_hypercube needs n >= 1 and dims >= 0, got n={n}, dims={dims}")
    u = (rng.random((n, dims)) + np.arange(n)[:, None]) / n
    for j in range(dims):
        u[:, j] = u[rng.permutation(n), j]
    return u


def sample_profiles(base: str | Conventions, n: int, rng: np.random.Generator,
                    knobs: Mapping[str, Uncertainty] | None = None) -> list[Conventions]:
    """Draw ``n`` derived profiles, every uncertainty sampled jointly by Latin hypercube.

    Args:
        base: Base profile (name or ``Conventions``).
        n: Number of samples.
        rng: The caller's generator.
        knobs: Uncertainties to sample (default :data:`UNCERTAINTIES`).

    Raises:
        ConfigError: An uncertainty names a knob ``Conventions`` does not have.
    """
    table = dict(UNCERTAINTIES if knobs is None else knobs)
    fields = set(Conventions.__dataclass_fields__) - {"name"}
    for name in table:
        if name not in fields:
            raise unknown_name("convention knob", name, fields)
    names = sorted(table)
    u = latin_hypercube(n, len(names), rng)
    profile = get_profile(base)
    return [profile.derive(**{k: table[k].value_at(float(u[i, j])) for j, k in enumerate(names)})
            for i in range(n)]
