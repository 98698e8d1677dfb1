"""Matched-quality search over the gating scale (pure search logic, no simulator).

Hardware-aware gating (paper-model.md §11) trades routing fidelity for speed: at scale s the
coefficients are s × (r_comp, r_comm), s = 0 is plain top-k and s = 1 the tuned defaults of §11.7.
A speed-up is only comparable to the ungated model at a stated quality, so this module finds, for
a quality target such as "top-1 routing retention >= 99 %", the strongest scale that still meets it.

The objective (e.g. top-1 retention measured on training decode steps) is a callable
``objective(scale) -> float`` that is non-increasing in the scale in expectation but only
approximately monotone on a finite sample. The search is therefore robust rather than a plain
bisection:

1. evaluate the objective on an ascending grid of scales starting at 0 (the grid's last scale is
   the strongest one considered; :data:`DEFAULT_SCALE_GRID` stops at the tuned default 1.0);
2. take the **largest** grid scale that meets the target — every stronger grid scale fails, even
   where the objective is not monotone;
3. refine by bisection between that scale and its stronger grid neighbour, keeping the lower end
   a scale that was measured to meet the target.

The found scale therefore always meets the target on the objective it was searched with; a target
no scale of the grid meets except 0 gives 0 (no gating). [decision] The grid ends at 1.0: the
matched-quality variant weakens HDA-MoE's gating, it never gates harder than the tuned method.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hdamoe_env.config.errors import ConfigError

__all__ = ["DEFAULT_SCALE_GRID", "MatchedLevel", "find_matched_level", "monotone_violations"]

#: Scales 0, 2^-10, ..., 2^-1, 1 (multipliers of the default gating coefficients).
DEFAULT_SCALE_GRID: tuple[float, ...] = (0.0, *(2.0 ** -e for e in range(10, 0, -1)), 1.0)


@dataclass(frozen=True)
class MatchedLevel:
    """Result of :func:`find_matched_level`.

    Attributes:
        target: The quality target (objective >= target).
        level: The strongest scale found that meets the target (0.0: no gating).
        value: The objective at ``level``.
        grid: The grid scales, ascending.
        grid_values: The objective at every grid scale (same order).
        evaluated: Every (scale, value) pair evaluated, in evaluation order (grid, then bisection).
        capped: True when the grid's strongest scale meets the target (the search did not find
            where the target stops being met; the level is the grid's end).
        violations: Grid neighbours (lower, higher) where the objective increased by more than
            the tolerance of :func:`monotone_violations` (0 for a monotone objective).
    """

    target: float
    level: float
    value: float
    grid: tuple[float, ...]
    grid_values: tuple[float, ...]
    evaluated: tuple[tuple[float, float], ...]
    capped: bool
    violations: int


def monotone_violations(values: Sequence[float], *, tolerance: float = 1e-3) -> int:
    """Return how many neighbours of ``values`` increase by more than ``tolerance``.

    Args:
        values: Objective values along an ascending scale grid.
        tolerance: Allowed increase between neighbours (sampling noise).

    Returns:
        0 for a sequence that is non-increasing up to ``tolerance``.
    """
    return sum(1 for a, b in itertools.pairwise(values) if b > a + tolerance)


def find_matched_level(objective: Callable[[float], float], target: float, *,
                       grid: Sequence[float] = DEFAULT_SCALE_GRID,
                       refine_steps: int = 6) -> MatchedLevel:
    """Find the strongest scale whose objective meets ``target`` (see the module docstring).

    Args:
        objective: ``objective(scale) -> float``, e.g. mean top-1 retention in [0, 1], ideally
            non-increasing in the scale.
        target: Required objective value, in (0, 1].
        grid: Ascending scales starting at 0.0 (at least two).
        refine_steps: Bisection steps between the grid neighbours (0: grid only).

    Returns:
        The matched level and every evaluation.

    Raises:
        ConfigError: A target outside (0, 1], a grid that is not ascending from 0, a negative
            number of refinement steps, or an objective that returns a non-finite value or does
            not meet the target at scale 0.
    """
    if not (0.0 < target <= 1.0):
        raise ConfigError(f"quality target {target!r} is outside (0, 1]; expected e.g. 0.99 "
                          "for top-1 retention >= 99 %")
    scales = tuple(float(s) for s in grid)
    if (len(scales) < 2 or scales[0] != 0.0
            or any(b <= a for a, b in itertools.pairwise(scales))):
        raise ConfigError(f"scale grid {scales} must be ascending, start at 0.0 and have at "
                          "least two scales; pass e.g. DEFAULT_SCALE_GRID")
    if refine_steps < 0:
        raise ConfigError(f"refine_steps={refine_steps} must be >= 0")
    evaluated: list[tuple[float, float]] = []

    def measure(scale: float) -> float:
        value = float(objective(scale))
        if not math.isfinite(value):
            raise ConfigError(f"the quality objective returned {value} at scale {scale}; "
                              "expected a finite number")
        evaluated.append((scale, value))
        return value

    values = [measure(s) for s in scales]
    # the objective is measured with a little float slack so that 1.0 - 1e-15 meets a 1.0 target
    meets = [v >= target - 1e-12 for v in values]
    if not meets[0]:
        raise ConfigError(f"the quality objective is {values[0]:.6g} at scale 0 (no gating), "
                          f"below the target {target}; the target can never be met")
    best = max(i for i, ok in enumerate(meets) if ok)
    level, value = scales[best], values[best]
    capped = best == len(scales) - 1
    if not capped:
        lo, hi = level, scales[best + 1]
        for _ in range(refine_steps):
            mid = 0.5 * (lo + hi)
            v = measure(mid)
            if v >= target - 1e-12:
                lo, level, value = mid, mid, v
            else:
                hi = mid
    return MatchedLevel(target=float(target), level=level, value=value, grid=scales,
                        grid_values=tuple(values), evaluated=tuple(evaluated), capped=capped,
                        violations=monotone_violations(values))
