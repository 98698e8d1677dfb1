"""Unit and shape conventions shared by the closed forms of the cost model.

Every closed form of :mod:`hdamoe_env.cost` (``perf``, ``nonmoe``, ``broadcast``) takes SI
quantities — seconds, bytes, FLOP, B/s, FLOP/s — and accepts a scalar or an array for the
batch size B (or the broadcast count m); it returns a Python float for a scalar argument and an
array of the argument's shape otherwise. The helpers here check those inputs once, with the
typed ``ConfigError`` of the package (style.md R8), and shape the outputs, so that every module
applies the same rule. Pure functions, numpy only.
"""

from __future__ import annotations

import math
from typing import TypeAlias

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError

__all__ = ["FloatArray", "FloatOrArray", "as_output", "check_tokens", "check_positive"]

#: A float64 array of any shape.
FloatArray: TypeAlias = NDArray[np.float64]
#: A Python float (scalar arguments) or a float64 array (array arguments).
FloatOrArray: TypeAlias = float | NDArray[np.float64]


def as_output(x: FloatArray | np.floating | float) -> FloatOrArray:
    """Return a Python float for a 0-d result, else the float64 array itself.

    Args:
        x: A result computed from scalar or array arguments.

    Returns:
        ``float(x)`` when ``x`` has no dimension, else ``x`` as a float64 array (no copy when
        it already is one).
    """
    arr = np.asarray(x, dtype=np.float64)
    return float(arr) if arr.ndim == 0 else arr


def check_tokens(B: ArrayLike) -> FloatArray:
    """Convert a token count B of a closed form (scalar or array) to float64; finite, >= 0.

    The closed forms evaluate expected loads and sweep B as arrays, so 0 and fractions are
    valid here; a run's batch size is checked by ``traces.batching.check_batch`` instead.

    Args:
        B: Tokens per decode step, scalar or array.

    Returns:
        float64 array of the shape of ``B`` (0-d for a scalar).

    Raises:
        ConfigError: A value that is not finite or is negative.
    """
    b = np.asarray(B, dtype=np.float64)
    if not np.all(np.isfinite(b)) or np.any(b < 0):
        raise ConfigError(f"batch size B must be finite and >= 0, got {B!r}")
    return b


def check_positive(name: str, value: float) -> float:
    """Check that a rate or size is a finite positive number and return it as a float.

    Args:
        name: The argument's name, for the message.
        value: The value (e.g. a bandwidth in B/s).

    Raises:
        ConfigError: ``value`` is not finite or not > 0.
    """
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)
