"""The residual action over HDA-MoE: a Gymnasium wrapper and the mapping it applies.

Implements a learning-friendly encoding of the per-layer decisions of paper-model.md §10–11:
the policy acts as a *deviation* from the greedy HDA-MoE agent's action for the layer (§10.5
pre-broadcast, §10.4 dispatch, §11 hardware-aware gating). Value 0 of every dimension is "keep
the greedy's choice", so an untrained policy whose "keep" logits are biased
(:data:`RESIDUAL_KEEP_LOGIT`) starts at HDA-MoE's performance and explores from there.

* :class:`ResidualHDA` — the mapping itself (reference decision, residual mask, residual →
  env action); a trained agent applies it at inference on an unwrapped env.
* :class:`ResidualHDAWrapper` — the importable ``gymnasium.Wrapper`` used in training (and
  nameable by RL Zoo's ``env_wrapper``).

It needs an agent (``agents.composite.HDAMoEAgent``), so it lives in ``agents``; the wrappers
that need only the env are in ``hdamoe_env.env.wrappers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

from agents.composite import HDAMoEAgent
from hdamoe_env.env.actions import ActionLayout
from hdamoe_env.config.errors import ConfigError

__all__ = [
    "RESIDUAL_KEEP_LOGIT",
    "RESIDUAL_OPS",
    "ResidualChoice",
    "ResidualHDA",
    "ResidualHDAWrapper",
]

#: Broadcast operations of the residual action (dimension 0), applied to the greedy's set.
RESIDUAL_OPS: tuple[str, ...] = ("keep", "drop_last", "drop_all", "swap_last")
#: Logit added to the "keep the greedy's choice" value of every residual dimension at
#: initialisation, so that an untrained policy acts like HDA-MoE (p(keep) ≈ 0.7–0.9).
RESIDUAL_KEEP_LOGIT = 2.0


@dataclass(frozen=True)
class ResidualChoice:
    """The greedy reference's decision for one layer and the deviations it admits.

    Attributes:
        base: int64 [max_broadcast + 2] the reference agent's (HDA-MoE's) action.
        slots: Per broadcast op of :data:`RESIDUAL_OPS`, the expert list it yields, or None when
            the op is unavailable (nothing to drop or swap) or equal to an earlier op.
        mask: bool [4 + R + G] mask of the residual action (model space).
    """

    base: NDArray[np.int64]
    slots: tuple[tuple[int, ...] | None, ...]
    mask: NDArray[np.bool_]


class ResidualHDA:
    """Residual action design: HDA-MoE's greedy decision plus a learned deviation.

    The policy acts in ``MultiDiscrete([4, R, G])`` (R dispatch rules, G gating levels):

    * dimension 0, the broadcast op on the greedy pre-broadcast set of the layer (§10.5):
      ``keep`` it, ``drop_last`` pick, ``drop_all`` (no broadcast), or ``swap_last`` pick for
      the next expert the greedy priority would choose;
    * dimension 1, a dispatch-rule offset: rule (greedy's + v) mod R;
    * dimension 2, a gating-level offset: level index (greedy's + v) mod G.

    Value 0 of every dimension reproduces the reference agent's action exactly, and training
    (``agents.learned.train.train``) biases those logits by :data:`RESIDUAL_KEEP_LOGIT`, so
    learning starts at the greedy agent's performance and explores deviations from it. The env's
    mask is mapped onto the residual space (unavailable or redundant ops masked; "keep" always
    allowed).

    Args:
        reference: The greedy agent (an ``agents.composite.CompositeAgent``, by default
            HDA-MoE built from the env's specs) whose action is the residual's origin.
        num_nodes: D, to reshape a flat ``replicas`` observation to [E, D].
    """

    def __init__(self, reference: Any, num_nodes: int) -> None:
        self.reference = reference
        self.layout: ActionLayout = reference.layout
        self.num_nodes = int(num_nodes)
        lay = self.layout
        self.nvec = np.array([len(RESIDUAL_OPS), len(lay.dispatch_rules),
                              len(lay.gating_levels)], dtype=np.int64)

    @classmethod
    def from_env(cls, env: Any) -> ResidualHDA:
        """Build the residual design with HDA-MoE from an ``HdMoeEnv``'s specs."""
        base = getattr(env, "unwrapped", env)
        return cls(HDAMoEAgent.from_env(base), int(base.num_nodes))

    def _observation(self, observation: dict[str, Any]) -> dict[str, NDArray[Any]]:
        obs = dict(observation)
        obs["replicas"] = np.asarray(observation["replicas"]).reshape(
            self.layout.num_experts, self.num_nodes)
        return obs

    def choose(self, observation: dict[str, Any],
               full_mask: NDArray[np.bool_] | None) -> ResidualChoice:
        """Return the reference decision and the residual options for one raw observation.

        Args:
            observation: One (unbatched, unnormalised) ``HdMoE-v1`` observation.
            full_mask: The env's flat ``action_masks()`` (None: everything allowed).
        """
        lay = self.layout
        obs = self._observation(observation)
        parts = None if full_mask is None else lay.split_mask(full_mask)
        base = np.asarray(self.reference.act(obs, parts), dtype=np.int64)
        keep = tuple(int(e) for e in base[: lay.max_broadcast] if int(e) != lay.none)
        swap: tuple[int, ...] | None = None
        broadcaster = getattr(self.reference, "broadcast", None)
        if keep and broadcaster is not None and len(keep) < lay.num_experts:
            wider = dict(obs, budget=np.array([(len(keep) + 1) / max(1, lay.max_broadcast)],
                                              dtype=np.float32))
            if len(keep) + 1 <= lay.max_broadcast:
                ext = broadcaster.choose_broadcast(wider, None)
            else:
                ext = []
            cand = [e for e in ext if e not in keep]
            if cand and (parts is None or parts[len(keep) - 1][cand[0]]):
                swap = (*keep[:-1], int(cand[0]))
        slots = (keep, keep[:-1] if keep else None, () if len(keep) >= 2 else None, swap)
        mask = np.zeros(int(self.nvec.sum()), dtype=bool)
        mask[: len(RESIDUAL_OPS)] = [s is not None for s in slots]
        r0, g0 = int(base[lay.rule_slot]), int(base[lay.level_slot])
        n_r, n_g = int(self.nvec[1]), int(self.nvec[2])
        rules = np.ones(n_r, dtype=bool) if parts is None else parts[lay.rule_slot]
        levels = np.ones(n_g, dtype=bool) if parts is None else parts[lay.level_slot]
        off = len(RESIDUAL_OPS)
        mask[off: off + n_r] = [bool(rules[(r0 + v) % n_r]) for v in range(n_r)]
        mask[off + n_r:] = [bool(levels[(g0 + v) % n_g]) for v in range(n_g)]
        return ResidualChoice(base, slots, mask)

    def to_full(self, action: NDArray[Any], choice: ResidualChoice) -> NDArray[np.int64]:
        """Translate a residual action into an ``HdMoE-v1`` action (unavailable op → keep)."""
        lay = self.layout
        a = np.asarray(action, dtype=np.int64).reshape(-1)
        chosen = choice.slots[int(a[0])] if 0 <= int(a[0]) < len(choice.slots) else None
        if chosen is None:
            chosen = choice.slots[0]
        full = np.full(lay.size, lay.none, dtype=np.int64)
        full[: len(chosen)] = chosen
        r, g = lay.rule_slot, lay.level_slot
        full[r] = (int(choice.base[r]) + int(a[1])) % int(self.nvec[1])
        full[g] = (int(choice.base[g]) + int(a[2])) % int(self.nvec[2])
        if lay.replica_slot is not None:          # the reference's (the env's default) rule
            full[lay.replica_slot] = int(choice.base[lay.replica_slot])
        return full


class ResidualHDAWrapper(gym.Wrapper[Any, NDArray[np.int64], Any, NDArray[np.int64]]):
    """Act in the residual space of :class:`ResidualHDA` on an ``HdMoE-v1`` env.

    Action space: ``MultiDiscrete([4, R, G])`` (R dispatch rules, G gating levels); the all-zero
    action reproduces HDA-MoE's action of every layer. ``info["residual_deviation"]`` says
    whether the step's action deviated from it. Observations are unchanged (``replicas`` may be
    [E, D] or flat [E·D]).

    Args:
        env: An ``HdMoeEnv`` (or a wrapper of one that keeps its action space).
        residual: The mapping (default: :meth:`ResidualHDA.from_env`, HDA-MoE from the env's
            specs).
    """

    def __init__(self, env: gym.Env[Any, Any], residual: ResidualHDA | None = None) -> None:
        super().__init__(env)
        self.residual = residual if residual is not None else ResidualHDA.from_env(env)
        self.action_space = spaces.MultiDiscrete(self.residual.nvec)
        self._choice: ResidualChoice | None = None

    def _env_masks(self) -> NDArray[np.bool_]:
        return np.asarray(self.env.get_wrapper_attr("action_masks")(), dtype=bool)

    def _update(self, obs: Any) -> None:
        self._choice = self.residual.choose(obs, self._env_masks())

    def sync_observation(self, obs: Any) -> None:
        """Recompute the reference decision for ``obs`` (after the env's state was restored)."""
        self._update(obs)

    def _require_choice(self) -> ResidualChoice:
        if self._choice is None:
            raise ConfigError("ResidualHDAWrapper: call reset() before step() or "
                              "action_masks()")
        return self._choice

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        """Reset the env and compute the reference decision of the first layer."""
        obs, info = self.env.reset(seed=seed, options=options)
        self._update(obs)
        return obs, info

    def action_masks(self) -> NDArray[np.bool_]:
        """Return the residual mask (bool [4 + R + G]; "keep" always allowed)."""
        return self._require_choice().mask.copy()

    def step(self, action: NDArray[np.int64]
             ) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Translate the residual action (:meth:`ResidualHDA.to_full`) and step the env."""
        full = self.residual.to_full(action, self._require_choice())
        obs, reward, terminated, truncated, info = self.env.step(full)
        info["residual_deviation"] = bool(np.any(np.asarray(action) != 0))
        if not (terminated or truncated):
            self._update(obs)
        return obs, reward, terminated, truncated, info
