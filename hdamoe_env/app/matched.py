"""Matched-quality gating: the strongest HDA-MoE gating scale that keeps a routing-quality target.

Application layer: composes the env (its router candidates and its gating decision,
``env.decisions.gate``) with the pure search of :mod:`hdamoe_env.decisions.quality`.

Quality is measured as in the env's ``info`` (paper-model.md §12, ``hdamoe_env.decisions.gating``):
top-1 retention (share of (token, layer) pairs whose original highest-scored expert is still
selected), score mass kept and changed fraction, each a mean over every decode step and every MoE
layer. Measuring a scale needs no latency simulation — gating depends only on the router
candidates, the layer's placement and the coefficients — so a search of ~20 scales costs
milliseconds per decode step.

**Training and held-out steps.** The search runs on the decode steps that ``env.reset`` forms
with the *training seeds* (:data:`TRAIN_SEEDS`, disjoint from the bench's episode seeds); the
found scale is then evaluated by the bench on its own episodes (held-out decode steps of the same
trace; rows are drawn independently, so a row can occur in both).

**Where model quality comes from.** Top-1 retention, score mass and changed fraction are routing
statistics, measurable on every trace that has router scores (synthesised scores for traces
without them: ``score_kind`` in the record says which). End-to-end model quality — KL divergence
and perplexity ratio of gated vs ungated routing (paper-model.md §12) — needs the real model and
exists only for the recorded tiny-model traces (``hdamoe traces fidelity``,
``docs/results/fidelity.md``); it is not estimated here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.decisions.quality import DEFAULT_SCALE_GRID, MatchedLevel, find_matched_level

__all__ = ["QUALITY_KEYS", "TRAIN_SEEDS", "GatingQualityProbe", "search_matched_levels"]

#: Episode seeds of the training decode steps (the bench's seeds are small integers).
TRAIN_SEEDS: tuple[int, ...] = (10_000, 10_001)

#: The routing-quality statistics of a record's ``gating`` dict.
QUALITY_KEYS: tuple[str, ...] = ("top1_retention", "score_mass_kept", "changed_fraction")


class GatingQualityProbe:
    """Routing quality of hardware-aware gating at any scale, on fixed training decode steps.

    Collects the router candidates of the decode steps of ``env.reset(seed=s)`` for every
    training seed once, then gates them at any scale with ``env.decisions.gate`` (results are
    memoised per scale).

    Args:
        env: An ``HdMoeEnv`` (its placement, coefficients and gating options are used). It is
            reset once per training seed; reset it again before using it for an episode.
        seeds: Training episode seeds.

    Raises:
        ConfigError: No seeds.
    """

    def __init__(self, env: Any, seeds: Sequence[int] = TRAIN_SEEDS) -> None:
        """Reset ``env`` once per training seed and keep the candidates of its decode steps."""
        if not seeds:
            raise ConfigError("GatingQualityProbe needs at least one training seed, got none")
        base = getattr(env, "unwrapped", env)
        self.env = base
        self.seeds = tuple(int(s) for s in seeds)
        self._steps: list[tuple[np.ndarray, np.ndarray]] = []
        for seed in self.seeds:
            base.reset(seed=seed)
            self._steps += [base.episode_candidates(t) for t in range(base.episode_steps)]
        self._memo: dict[float, dict[str, float]] = {}

    @property
    def decode_steps(self) -> int:
        """Training decode steps measured per scale."""
        return len(self._steps)

    def measure(self, scale: float) -> dict[str, float]:
        """Return the mean top-1 retention, score mass kept and changed fraction at ``scale``.

        Means run over every training decode step and every MoE layer; scale 0 is plain top-k
        (exactly 1, 1, 0).

        Raises:
            ConfigError: A negative or non-finite scale.
        """
        scale = float(scale)
        if not (np.isfinite(scale) and scale >= 0):
            raise ConfigError(f"gating scale {scale} must be finite and >= 0")
        hit = self._memo.get(scale)
        if hit is not None:
            return hit
        if scale == 0.0:
            out = {"top1_retention": 1.0, "score_mass_kept": 1.0, "changed_fraction": 0.0}
        else:
            sums = np.zeros(3)
            count = 0
            decisions = self.env.decisions
            for ids, scores in self._steps:
                for layer in range(ids.shape[0]):
                    g = decisions.gate(layer, (ids[layer], scores[layer]), scale)
                    sums += (g.top1_retention, g.score_mass_kept, g.changed_fraction)
                    count += 1
            mean = sums / max(count, 1)
            out = dict(zip(QUALITY_KEYS, (float(v) for v in mean), strict=True))
        self._memo[scale] = out
        return out

    def curve(self, scales: Sequence[float]) -> list[dict[str, float]]:
        """Return ``[{"scale": s, **measure(s)}]`` for every scale."""
        return [{"scale": float(s), **self.measure(s)} for s in scales]


def search_matched_levels(probe: GatingQualityProbe, targets: Sequence[float], *,
                          grid: Sequence[float] = DEFAULT_SCALE_GRID,
                          refine_steps: int = 6) -> dict[float, MatchedLevel]:
    """Find, per top-1-retention target, the strongest gating scale that meets it.

    Args:
        probe: Quality of gating on the training decode steps.
        targets: Top-1 retention targets in (0, 1], e.g. (0.99, 0.95).
        grid: Ascending scales from 0 (:data:`hdamoe_env.decisions.quality.DEFAULT_SCALE_GRID`).
        refine_steps: Bisection steps between grid neighbours.

    Returns:
        ``{target: MatchedLevel}``.
    """
    return {float(t): find_matched_level(lambda s: probe.measure(s)["top1_retention"], t,
                                         grid=grid, refine_steps=refine_steps)
            for t in targets}
