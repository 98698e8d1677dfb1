"""The paper's online methods as composite agents (paper-model.md §9.4, §10.1).

* :class:`HDMoEAgent` (conference, HD-MoE): the greedy pre-broadcast of §10.3–10.5 plus the
  communication-efficient ``least_loaded`` dispatch of §10.6, no gating. Combined with the
  Node + Link Balance placement in ``hdamoe bench`` it is the method ``hd-moe``.
* :class:`HDAMoEAgent` (journal, HDA-MoE): the same plus hardware-aware gating at the default
  coefficients of the model and setting (§11.7; gating level 1.0), the method ``hda-moe``.

Gating fixes the routing S_t of the layer, then the broadcast and the dispatch execute it
(§10.1); the env applies the three levers of one action in that order. :class:`CompositeAgent`
takes the broadcast slots, the dispatch rule and the gating level from three sub-agents.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from agents.base import DEFAULT_DISPATCH_RULES, DEFAULT_GATING_LEVELS, BaseAgent
from agents.dispatch import LeastLoadedDispatchAgent
from agents.gating import HardwareAwareGatingAgent
from agents.prebroadcast import GreedyPreBroadcastAgent
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.config.run import RUN_DEFAULTS

__all__ = ["CompositeAgent", "HDAMoEAgent", "HDMoEAgent"]


class CompositeAgent(BaseAgent):
    """Combine the levers of three agents into one action.

    Args:
        broadcast: Agent with ``choose_broadcast(obs, mask) -> list[int]``, or None (none).
        dispatch: Agent with ``choose_rule(obs) -> int``, or None (rule index 0).
        gating: Agent with ``choose_level(obs) -> int``, or None (off).

    Raises:
        ConfigError: The sub-agents disagree on the action layout.
    """

    name = "composite"

    def __init__(self, broadcast: GreedyPreBroadcastAgent | None = None,
                 dispatch: LeastLoadedDispatchAgent | None = None,
                 gating: HardwareAwareGatingAgent | None = None) -> None:
        parts = [a for a in (broadcast, dispatch, gating) if a is not None]
        if not parts:
            raise ConfigError("CompositeAgent needs at least one sub-agent")
        layout = parts[0].layout
        if any(a.layout != layout for a in parts):
            raise ConfigError("the sub-agents of a CompositeAgent were built for different "
                              "action layouts (E, max_broadcast, dispatch rules, gating levels)")
        self.layout = layout
        self.broadcast, self.dispatch, self.gating = broadcast, dispatch, gating
        self._off = layout.level_index(0.0)

    def act(self, observation: dict[str, Any],
            mask: list[NDArray[np.bool_]] | None = None) -> NDArray[np.int64]:
        """Return the combined action."""
        lay = self.layout
        action = lay.noop()                # replica rule (with replicas): the env's default
        if self.broadcast is not None:
            chosen = self.broadcast.choose_broadcast(observation, mask)
            action[: len(chosen)] = chosen
        action[lay.rule_slot] = 0 if self.dispatch is None \
            else self.dispatch.choose_rule(observation)
        action[lay.level_slot] = self._off if self.gating is None \
            else self.gating.choose_level(observation)
        return action


class HDMoEAgent(CompositeAgent):
    """HD-MoE's online part: greedy pre-broadcast + ``least_loaded`` dispatch, no gating.

    Args:
        model: ModelSpec or preset id.
        hw: Hardware spec.
        conventions: Convention profile.
        batch: Tokens per decode step B.
        ref_bookkeeping: §10.9 bookkeeping (None: the profile's knob).
        skip_zero_priority: Stop at zero priority (None: the profile's knob).
        dispatch_rule: Dispatch rule (``least_loaded``, §10.6).
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env.
        gating_levels: Gating levels of the env.
    """

    name = "hd-moe"

    def __init__(self, model: str | ModelSpec, hw: HardwareSpec | None = None,
                 conventions: str | Conventions = "faithful", *, batch: int = RUN_DEFAULTS.batch,
                 ref_bookkeeping: bool | None = None, skip_zero_priority: bool | None = None,
                 dispatch_rule: str = "least_loaded", max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        layout = {"max_broadcast": max_broadcast, "dispatch_rules": dispatch_rules,
                  "gating_levels": gating_levels}
        pre = GreedyPreBroadcastAgent(model, hw, conventions, batch=batch,
                                      ref_bookkeeping=ref_bookkeeping,
                                      skip_zero_priority=skip_zero_priority,
                                      dispatch_rule=dispatch_rule, **layout)
        disp = LeastLoadedDispatchAgent(model=pre.model, rule=dispatch_rule, **layout)
        super().__init__(pre, disp, None)


class HDAMoEAgent(CompositeAgent):
    """HDA-MoE's online part: HD-MoE plus hardware-aware gating (default level 1.0).

    Args:
        model: ModelSpec or preset id.
        hw: Hardware spec.
        conventions: Convention profile.
        batch: Tokens per decode step B.
        gating_level: Multiple of the default coefficients (§11.7).
        min_imbalance: Gate only layers with predicted max/mean node load above this (None:
            always; see ``agents.gating``).
        ref_bookkeeping: §10.9 bookkeeping (None: the profile's knob).
        skip_zero_priority: Stop at zero priority (None: the profile's knob).
        dispatch_rule: Dispatch rule (``least_loaded``, §10.6).
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env.
        gating_levels: Gating levels of the env.
    """

    name = "hda-moe"

    def __init__(self, model: str | ModelSpec, hw: HardwareSpec | None = None,
                 conventions: str | Conventions = "faithful", *, batch: int = RUN_DEFAULTS.batch,
                 gating_level: float = 1.0, min_imbalance: float | None = None,
                 ref_bookkeeping: bool | None = None, skip_zero_priority: bool | None = None,
                 dispatch_rule: str = "least_loaded", max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        layout = {"max_broadcast": max_broadcast, "dispatch_rules": dispatch_rules,
                  "gating_levels": gating_levels}
        pre = GreedyPreBroadcastAgent(model, hw, conventions, batch=batch,
                                      ref_bookkeeping=ref_bookkeeping,
                                      skip_zero_priority=skip_zero_priority,
                                      dispatch_rule=dispatch_rule, **layout)
        disp = LeastLoadedDispatchAgent(model=pre.model, rule=dispatch_rule, **layout)
        gate = HardwareAwareGatingAgent(model=pre.model, level=gating_level,
                                        min_imbalance=min_imbalance, dispatch_rule=dispatch_rule,
                                        **layout)
        super().__init__(pre, disp, gate)
