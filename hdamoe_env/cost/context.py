"""Per-request context lengths of decode steps and the attention/KV cost they set (PHYSICS.md §13).

A decode step of B requests reads, per full-attention layer, the cached K/V of every request's
context: request r with L_r cached tokens costs ``core_flops_per_ctx_token``·L_r FLOPs and
``kv_elements_per_token``·L_r·2 bytes. Every non-MoE formula of :mod:`hdamoe_env.cost.nonmoe`
is affine in the context length with a per-token slope, so the step's cost at per-request
lengths equals the cost at their mean, Σ_r L_r / B (:func:`step_nonmoe_time` charges exactly
that). What matters is therefore where the lengths come from:

* **the trace**, when it records them: a row at 0-based position ``pos`` of its request has
  ``pos + 1`` tokens in context (:func:`trace_context_lengths`); rows of earlier turns of a
  conversation are not counted (the reference traces do not separate prompt from answer);
* otherwise **a sourced distribution** of a real serving workload, sampled with the caller's
  generator (:func:`sample_context_lengths`).

Distributions (:data:`CONTEXT_DISTRIBUTIONS`) are the decode-step context lengths of the Azure
LLM inference trace 2023 (Patel et al., "Splitwise: Efficient generative LLM inference using
phase splitting", ISCA 2024; data https://github.com/Azure/AzurePublicDataset, file
``data/AzureLLMInferenceTrace_{conv,code}.csv``, fields ContextTokens and GeneratedTokens,
CC-BY): every request of c context tokens that generates g tokens contributes g decode steps
with contexts c, c + 1, …, c + g − 1. The quantiles below were computed from the full files
(conversation: 19,366 requests, 4,088,665 decode steps; code: 8,819 requests, 245,896 steps);
the ``faithful`` default ``nonmoe_ctx_len`` = 1226 is the conversation mean. The mean of the
piecewise-linear quantile function (what :func:`sample_context_lengths` draws from) is within
1.1 % of the data's mean (``ContextDistribution.table_mean``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.cost import nonmoe
from hdamoe_env.noc.topology import Topology

__all__ = [
    "CONTEXT_DISTRIBUTIONS",
    "ContextDistribution",
    "get_context_distribution",
    "sample_context_lengths",
    "step_context_lengths",
    "step_nonmoe_time",
    "trace_context_lengths",
]

_PROBS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.40, 0.45, 0.50, 0.55, 0.60, 0.65,
          0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 0.975, 0.99, 0.999, 1.0)


@dataclass(frozen=True, slots=True)
class ContextDistribution:
    """Decode-step context lengths of a serving workload, as a quantile table.

    Attributes:
        name: Registry key.
        source: Where the numbers come from (dataset, file, how they were computed).
        probs: Cumulative probabilities, increasing from 0 to 1.
        tokens: Context length (tokens) at each probability, non-decreasing.
        mean_tokens: The data's mean decode-step context (not the table's).
        steps: Number of decode steps the table was computed from.
    """

    name: str
    source: str
    probs: tuple[float, ...]
    tokens: tuple[int, ...]
    mean_tokens: float
    steps: int

    def __post_init__(self) -> None:
        p = np.asarray(self.probs, dtype=np.float64)
        t = np.asarray(self.tokens, dtype=np.float64)
        if (p.shape != t.shape or p.size < 2 or p[0] != 0.0 or p[-1] != 1.0
                or (np.diff(p) <= 0).any() or (np.diff(t) < 0).any() or t[0] < 0):
            raise ConfigError(f"context distribution {self.name!r}: need probabilities rising "
                              "from 0 to 1 and non-decreasing token counts >= 0 of equal length")

    @property
    def table_mean(self) -> float:
        """Mean of the piecewise-linear quantile function (the sampler's mean), tokens."""
        p = np.asarray(self.probs)
        t = np.asarray(self.tokens, dtype=np.float64)
        return float(((t[1:] + t[:-1]) / 2 * np.diff(p)).sum())


#: Sourced decode-step context distributions (module docstring), by name.
CONTEXT_DISTRIBUTIONS: dict[str, ContextDistribution] = {
    d.name: d for d in (
        ContextDistribution(
            "azure-conv",
            "Azure LLM inference trace 2023, conversation (AzurePublicDataset "
            "data/AzureLLMInferenceTrace_conv.csv; Splitwise, ISCA 2024): decode-step contexts",
            _PROBS,
            (2, 273, 405, 452, 526, 1055, 1109, 1148, 1183, 1216, 1249, 1281, 1312, 1342, 1371,
             1402, 1436, 1478, 1551, 2226, 4089, 4152, 5652, 14088),
            1226.5, 4_088_665),
        ContextDistribution(
            "azure-code",
            "Azure LLM inference trace 2023, code (AzurePublicDataset "
            "data/AzureLLMInferenceTrace_code.csv; Splitwise, ISCA 2024): decode-step contexts",
            _PROBS,
            (3, 110, 215, 335, 490, 642, 832, 993, 1148, 1372, 1586, 1793, 2032, 2271, 2598,
             2928, 3360, 4016, 5029, 7035, 7443, 7475, 7663, 7840),
            2130.4, 245_896),
    )
}


def get_context_distribution(name: str | ContextDistribution) -> ContextDistribution:
    """Return a registered distribution (or the one passed in).

    Raises:
        ConfigError: Unknown name (the message lists the registered ones).
    """
    if isinstance(name, ContextDistribution):
        return name
    if name not in CONTEXT_DISTRIBUTIONS:
        raise unknown_name("context distribution", name, CONTEXT_DISTRIBUTIONS)
    return CONTEXT_DISTRIBUTIONS[name]


def sample_context_lengths(dist: str | ContextDistribution, n: int,
                           rng: np.random.Generator) -> NDArray[np.int64]:
    """Draw ``n`` decode-step context lengths by inverting the quantile table.

    Args:
        dist: Distribution name or object.
        n: Number of requests (>= 0).
        rng: The caller's generator (the only randomness).

    Returns:
        int64 [n] context lengths, each >= 1 token.

    Raises:
        ConfigError: Unknown distribution or a negative ``n``.
    """
    table = get_context_distribution(dist)
    if not (isinstance(n, int | np.integer) and n >= 0):
        raise ConfigError(f"n must be an integer >= 0, got {n!r}")
    u = rng.random(int(n))
    lengths = np.interp(u, table.probs, np.asarray(table.tokens, dtype=np.float64))
    return np.maximum(np.rint(lengths), 1).astype(np.int64)


def trace_context_lengths(pos: ArrayLike) -> NDArray[np.int64]:
    """Return the context length of trace rows from their positions: ``pos + 1`` tokens.

    Args:
        pos: 0-based positions of the rows within their requests (``RoutingTrace.pos``).

    Raises:
        ConfigError: A negative position.
    """
    p = np.asarray(pos, dtype=np.int64)
    if p.size and p.min() < 0:
        raise ConfigError(f"positions must be >= 0, got minimum {int(p.min())}")
    return p + 1


def step_context_lengths(n: int, rng: np.random.Generator,
                         dist: str | ContextDistribution = "azure-conv",
                         pos: ArrayLike | None = None) -> NDArray[np.int64]:
    """Return the context lengths of a decode step of ``n`` requests.

    From the trace positions when given (``pos``, shape [n]), else sampled from ``dist``.

    Raises:
        ConfigError: ``pos`` of the wrong length, an unknown distribution or negative values.
    """
    if pos is not None:
        lengths = trace_context_lengths(pos)
        if lengths.shape != (n,):
            raise ConfigError(f"pos must have shape [n={n}], got {lengths.shape}")
        return lengths
    return sample_context_lengths(dist, n, rng)


def step_nonmoe_time(model: ModelSpec, hw: HardwareSpec, conv: Conventions,
                     ctx_lens: ArrayLike, layer: int = 0, bw_end_Bps: float | None = None,
                     topology: Topology | None = None) -> nonmoe.NonMoeTime:
    """Return t_nm of MoE layer ``layer`` for a decode step with per-request context lengths.

    B = ``len(ctx_lens)``; attention FLOPs and KV bytes are Σ_r (per-token cost)·L_r, which
    ``nonmoe.nonmoe_time`` charges exactly at the mean context Σ_r L_r / B.

    Args:
        model: The model.
        hw: The hardware.
        conv: The conventions (formula, roofline, DRAM efficiency, all-reduce).
        ctx_lens: Context length of every request of the step, shape [B] (B >= 1).
        layer: MoE layer index.
        bw_end_Bps: Endpoint-side bandwidth for the optional all-reduce.
        topology: The NoC for the all-reduce's DES algorithms.

    Raises:
        ConfigError: An empty step, negative lengths or a bad layer.
    """
    lengths = np.asarray(ctx_lens, dtype=np.float64).reshape(-1)
    if lengths.size == 0 or not np.isfinite(lengths).all() or lengths.min() < 0:
        raise ConfigError("ctx_lens must be a non-empty array of finite lengths >= 0")
    return nonmoe.nonmoe_time(model, hw, conv, lengths.size, layer, bw_end_Bps, topology,
                              ctx_len=float(lengths.mean()))
