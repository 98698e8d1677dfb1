"""Communication-efficient dispatch (paper-model.md §10.6, paper §V-C3): the dispatch lever only.

After a pre-broadcast every node holds a replica of the broadcast experts; the dispatch rule
decides on which node each (token, broadcast expert) pair is computed. The env implements the
rules (``least_loaded``: among the nodes that already receive the token for its other experts,
the one with the least running load — no extra data moves; ``first``; ``home``); this agent only
chooses the rule. It pre-broadcasts nothing and leaves gating off, so on its own it equals the
static placement — it is a building block of :class:`agents.composite.HDMoEAgent`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from agents.base import (DEFAULT_DISPATCH_RULES, DEFAULT_GATING_LEVELS, BaseAgent,
                         resolve_num_experts)

__all__ = ["LeastLoadedDispatchAgent"]


class LeastLoadedDispatchAgent(BaseAgent):
    """Choose the dispatch rule (default ``least_loaded``, §10.6); nothing else.

    Args:
        num_experts: E (or pass ``model=``).
        model: A ModelSpec or preset id.
        rule: Dispatch rule name, one of the env's ``dispatch_rules``.
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env, in action order.
        gating_levels: Gating levels of the env.

    Raises:
        ConfigError: The env does not offer ``rule``.
    """

    name = "least-loaded-dispatch"
    uses_mask = False

    def __init__(self, num_experts: int | None = None, *, model: Any = None,
                 rule: str = "least_loaded", max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        super().__init__(resolve_num_experts(num_experts, model), max_broadcast=max_broadcast,
                         dispatch_rules=dispatch_rules, gating_levels=gating_levels)
        self.rule = rule
        self.rule_index = self.layout.rule_index(rule)
        self._action = self.layout.encode(dispatch_rule=rule)

    def choose_rule(self, observation: dict[str, Any]) -> int:
        """Return the dispatch-rule index (the observation does not change it)."""
        return self.rule_index

    def act(self, observation: dict[str, Any],
            mask: list[NDArray[np.bool_]] | None = None) -> NDArray[np.int64]:
        """Return no pre-broadcast, the chosen rule, gating off."""
        return self._action.copy()
