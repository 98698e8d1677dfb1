"""Hardware-aware gating agent (paper-model.md §11, paper §V-D): the gating lever.

The env applies the gating algorithm of ``hdamoe_env.decisions.gating`` (the sequential greedy of §11.2 with
the computation and communication penalties of §11.3–11.4) with coefficients
``level × (r_comp, r_comm)``, where (r_comp, r_comm) are the per-model/setting defaults of §11.7
and ``level`` is one of the env's ``gating_levels`` (index 0 = off). This agent chooses the level:
by default always 1.0, i.e. the published coefficients (the paper tunes one pair per model and
compute/bandwidth setting and shares it by all layers, §11.1).

[decision] Optional observation-driven switch: with ``min_imbalance`` set, gating is turned off
for layers whose predicted node loads are already balanced — max_c L̂_c / mean_c L̂_c below the
threshold, with L̂_c = Σ_i P_ic·n̂_i from ``obs["replicas"]`` and ``obs["pred_load"]`` — so that
routing is perturbed only where a compute hotspot is predicted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from agents.base import (DEFAULT_DISPATCH_RULES, DEFAULT_GATING_LEVELS, BaseAgent,
                         resolve_num_experts)
from hdamoe_env.config.errors import ConfigError

__all__ = ["HardwareAwareGatingAgent", "predicted_imbalance"]


def predicted_imbalance(observation: dict[str, Any]) -> float:
    """Return max_c L̂_c / mean_c L̂_c of the predicted node loads (1 = balanced, §10.5).

    Args:
        observation: ``pred_load`` float [E] and ``replicas`` float [E, D].
    """
    pred = np.asarray(observation["pred_load"], dtype=np.float64)
    P = np.asarray(observation["replicas"], dtype=np.float64)
    loads = pred @ P
    mean = float(loads.mean())
    return 1.0 if mean <= 0 else float(loads.max()) / mean


class HardwareAwareGatingAgent(BaseAgent):
    """Choose the gating level; no pre-broadcast; the given dispatch rule.

    Args:
        num_experts: E (or pass ``model=``).
        model: A ModelSpec or preset id.
        level: Multiple of the default coefficients (1.0 = §11.7 defaults; 0.0 = off); the
            env's closest level is used.
        min_imbalance: Turn gating off when the predicted max/mean node load is below this
            (None: always gate). See the module docstring.
        dispatch_rule: Dispatch rule of the action (matters only with pre-broadcasts).
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env.
        gating_levels: Gating levels of the env, index 0 = off.

    Raises:
        ConfigError: A negative level or threshold.
    """

    name = "hardware-aware-gating"
    uses_mask = False

    def __init__(self, num_experts: int | None = None, *, model: Any = None, level: float = 1.0,
                 min_imbalance: float | None = None, dispatch_rule: str = "least_loaded",
                 max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        super().__init__(resolve_num_experts(num_experts, model), max_broadcast=max_broadcast,
                         dispatch_rules=dispatch_rules, gating_levels=gating_levels)
        if level < 0 or (min_imbalance is not None and min_imbalance < 0):
            raise ConfigError(f"gating level and min_imbalance must be >= 0, got {level}, "
                              f"{min_imbalance}")
        self.level = float(level)
        self.level_index = self.layout.level_index(self.level)
        self.off_index = self.layout.level_index(0.0)
        self.min_imbalance = min_imbalance
        self.dispatch_rule = dispatch_rule
        self._action = self.layout.encode(dispatch_rule=dispatch_rule, gating_level=self.level)

    def choose_level(self, observation: dict[str, Any]) -> int:
        """Return the gating-level index for this layer."""
        if self.min_imbalance is not None and predicted_imbalance(observation) < self.min_imbalance:
            return self.off_index
        return self.level_index

    def act(self, observation: dict[str, Any],
            mask: list[NDArray[np.bool_]] | None = None) -> NDArray[np.int64]:
        """Return no pre-broadcast, the dispatch rule and the chosen gating level."""
        action = self._action.copy()
        action[self.layout.level_slot] = self.choose_level(observation)
        return action
