"""Greedy pre-broadcast agent (paper-model.md §10.3–10.5 and §10.9, paper §V-C1/V-C2).

For the current MoE layer the env reports the number of experts that fit into the runtime budget
of the previous layer, k_b = max{m : T_bc*(m) < t_budget} with the optimal chunk size
c*(m) = sqrt(α·S/(β·m·H)) of the pipelined α–β broadcast (§10.3–10.4), as
``obs["budget"] = k_b / max_broadcast``. The agent then repeats the priority selection of §10.5
k_b times on the placement of the layer (``obs["replicas"]`` = P [E, D]) and the predicted counts
n̂_i (``obs["pred_load"]`` · B):

    L̂_c = Σ_i P_ic·n̂_i·w,  c* = argmax_c L̂_c,  prio_i = P_{i,c*}·n̂_i·w / C,  e* = argmax prio,

zeroing P_{e*,:} after each pick so that the next round may find another congested node. The
selection is ``hdamoe_env.decisions.broadcast.priority_broadcast`` (not re-implemented here), with
``ref_bookkeeping`` (§10.9) and ``skip_zero_priority`` defaulting to the conventions' knobs. The
broadcast experts' tokens are dispatched with the ``least_loaded`` rule (§10.6); gating is off.
Under the tile model (``conv.tiled``, ``faithful``) loads and priorities are the tile-model
seconds of every shard at the predicted counts (``priority_broadcast(shard_time=)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from agents.base import DEFAULT_DISPATCH_RULES, DEFAULT_GATING_LEVELS, BaseAgent
from hdamoe_env.cost import perf
from hdamoe_env.config.profiles import Conventions, get_profile
from hdamoe_env.decisions.broadcast import priority_broadcast
from hdamoe_env.config.specs import HardwareSpec, ModelSpec, get_model
from hdamoe_env.config.run import RUN_DEFAULTS

__all__ = ["GreedyPreBroadcastAgent", "PriorityPreBroadcastAgent"]


class GreedyPreBroadcastAgent(BaseAgent):
    """Pre-broadcast the highest-priority experts of the most congested node (§10.5).

    Args:
        model: ModelSpec or preset id (E and the work per token w = F_e).
        hw: Hardware (node throughput C); default ``HardwareSpec()``.
        conventions: Profile name or ``Conventions`` (F_e, default bookkeeping knobs).
        batch: Tokens per decode step B (``pred_load`` is counts ÷ B).
        ref_bookkeeping: §10.9 reference bookkeeping (None: the profile's knob).
        skip_zero_priority: Stop at zero priority (None: the profile's knob).
        dispatch_rule: Dispatch rule of the action (``least_loaded``, §10.6).
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env.
        gating_levels: Gating levels of the env (the agent sends index 0 = off).
    """

    name = "greedy-prebroadcast"

    def __init__(self, model: str | ModelSpec, hw: HardwareSpec | None = None,
                 conventions: str | Conventions = "faithful", *, batch: int = RUN_DEFAULTS.batch,
                 ref_bookkeeping: bool | None = None, skip_zero_priority: bool | None = None,
                 dispatch_rule: str = "least_loaded", max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        self.model = get_model(model)
        super().__init__(self.model.num_experts, max_broadcast=max_broadcast,
                         dispatch_rules=dispatch_rules, gating_levels=gating_levels)
        self.hw = hw if hw is not None else HardwareSpec()
        self.conv = get_profile(conventions)
        self.batch = int(batch)
        self.ref_bookkeeping = (self.conv.ref_bookkeeping if ref_bookkeeping is None
                                else bool(ref_bookkeeping))
        self.skip_zero_priority = (self.conv.skip_zero_priority if skip_zero_priority is None
                                   else bool(skip_zero_priority))
        self.w = perf.expert_flops(self.model, self.conv)
        self.C = self.hw.compute_flops
        self.dispatch_rule = dispatch_rule
        self._template = self.layout.encode(dispatch_rule=dispatch_rule, gating_level=0.0)

    def budget(self, observation: dict[str, Any]) -> int:
        """Return k_b decoded from ``obs["budget"]`` (= k_b / max_broadcast)."""
        frac = float(np.asarray(observation["budget"]).reshape(-1)[0])
        return max(0, min(self.layout.max_broadcast, int(round(frac * self.layout.max_broadcast))))

    def choose_broadcast(self, observation: dict[str, Any],
                         mask: list[NDArray[np.bool_]] | None = None) -> list[int]:
        """Return the experts to pre-broadcast, in pick order (at most k_b).

        With a mask, k_b is also capped by the number of slots that admit an expert, and picks
        the mask forbids are dropped.
        """
        k_b = self.budget(observation)
        if mask is not None:
            open_slots = sum(1 for m in mask[: self.layout.max_broadcast]
                             if m[: self.layout.num_experts].any())
            k_b = min(k_b, open_slots)
        if k_b <= 0:
            return []
        P = np.asarray(observation["replicas"], dtype=np.float64)
        counts = np.asarray(observation["pred_load"], dtype=np.float64) * self.batch
        # An expert already held by every node gains nothing from a replica (the env masks it).
        # Ask for extra rounds and drop such picks: with the corrected bookkeeping a picked
        # expert's predicted work is spread evenly over the D nodes, which for an expert split
        # over all D nodes is exactly its current load, so the remaining picks are unchanged.
        everywhere = (P > 0).all(axis=1)
        rounds = min(P.shape[0], k_b + int(everywhere.sum()))
        # tile model (faithful): priorities and loads in the seconds the evaluator charges
        shard_time = (perf.gemm_tile_time(counts[:, None], P * self.model.expert_intermediate,
                                          self.model, self.hw, self.conv)
                      if self.conv.tiled else None)
        picks = priority_broadcast(P, counts, self.w, self.C, rounds,
                                   ref_bookkeeping=self.ref_bookkeeping,
                                   skip_zero_priority=self.skip_zero_priority,
                                   shard_time=shard_time)
        chosen = [int(e) for e in picks if not everywhere[e]][:k_b]
        if mask is not None:
            chosen = [e for slot, e in enumerate(chosen) if mask[slot][e]]
        return chosen

    def act(self, observation: dict[str, Any],
            mask: list[NDArray[np.bool_]] | None = None) -> NDArray[np.int64]:
        """Return the pre-broadcast slots, ``least_loaded`` dispatch and gating off."""
        action = self._template.copy()
        chosen = self.choose_broadcast(observation, mask)
        action[: len(chosen)] = chosen
        return action


#: The name used in style.md's module map.
PriorityPreBroadcastAgent = GreedyPreBroadcastAgent
