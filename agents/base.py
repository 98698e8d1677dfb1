"""The agent protocol, the action layout of ``HdMoE-v1`` and the trivial agents.

Implements the interface of paper-model.md §10.1: one decision per MoE layer, made from the
observation alone. Every agent — heuristic or learned — implements Stable-Baselines3's
``predict(observation, state=None, episode_start=None, deterministic=True) -> (action, state)``
(style.md R11), so one evaluation harness runs them all; like sb3-contrib's ``MaskablePPO``,
``predict`` also accepts ``action_masks=`` (the env's flat ``action_masks()``).

Action layout (``HdMoeEnv``): ``MultiDiscrete([E + 1] * max_broadcast + [R, G])`` — slot value
e < E pre-broadcasts expert e for the current layer, E means "none"; then the index of the
dispatch rule in ``dispatch_rules`` (R rules) and of the gating level in ``gating_levels`` (G
levels, index 0 = off). :class:`ActionLayout` encodes and decodes it and splits a flat mask;
it describes the env, so it lives in the core (``hdamoe_env.env.actions``) and is re-exported here.

Heuristics take specs in ``__init__`` and read only the observation; ``from_env`` is a
convenience that reads those specs from an env instance (it does not keep the env).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.env.actions import DEFAULT_DISPATCH_RULES, DEFAULT_GATING_LEVELS, ActionLayout
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.run import RUN_DEFAULTS

__all__ = [
    "DEFAULT_DISPATCH_RULES",
    "DEFAULT_GATING_LEVELS",
    "ActionLayout",
    "Agent",
    "BaseAgent",
    "NoOpAgent",
    "RandomAgent",
    "env_specs",
]

Observation = dict[str, NDArray[Any]]


@runtime_checkable
class Agent(Protocol):
    """Anything with SB3's ``predict`` signature (style.md R11)."""

    def predict(self, observation: Any, state: Any = None, episode_start: Any = None,
                deterministic: bool = True) -> tuple[NDArray[np.int64], Any]:
        """Return the action for ``observation`` and the (unused) recurrent state."""
        ...


def env_specs(env: Any) -> dict[str, Any]:
    """Return the specs a heuristic agent takes, read from an ``HdMoeEnv``.

    Returns:
        ``model`` (ModelSpec), ``hw`` (HardwareSpec), ``conventions`` (Conventions),
        ``batch`` (B) and the layout fields ``max_broadcast``, ``dispatch_rules``,
        ``gating_levels``.
    """
    base = getattr(env, "unwrapped", env)
    layout = ActionLayout.from_env(base)
    sim = getattr(base, "sim", None) or getattr(base, "simulator", None)
    model = getattr(base, "model", None) or getattr(sim, "model", None)
    hw = getattr(base, "hw", None) or getattr(sim, "hw", None)
    conv = getattr(base, "conv", None) or getattr(sim, "conv", None)
    if model is None or hw is None:
        raise ConfigError("cannot read the model and hardware specs from this env; construct "
                          "the agent with model=..., hw=... instead of from_env")
    return {"model": model, "hw": hw, "conventions": conv if conv is not None else "faithful",
            "batch": int(getattr(base, "batch", RUN_DEFAULTS.batch)),
            "max_broadcast": layout.max_broadcast, "dispatch_rules": layout.dispatch_rules,
            "gating_levels": layout.gating_levels}


def _is_batched(observation: Observation) -> bool:
    layer = np.asarray(observation["layer"])
    return layer.ndim > 1


class BaseAgent:
    """Common machinery: the action layout and SB3-style batched ``predict``.

    Subclasses implement :meth:`act` for one (unbatched) observation.

    Args:
        num_experts: E.
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env, in action order.
        gating_levels: Gating levels of the env, index 0 = off.
    """

    name = "base"
    #: Whether :meth:`act` reads the mask (agents that ignore it skip splitting it).
    uses_mask = True

    def __init__(self, num_experts: int, *, max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        self.layout = ActionLayout(int(num_experts), int(max_broadcast), tuple(dispatch_rules),
                                   tuple(gating_levels))

    @classmethod
    def from_env(cls, env: Any, **kwargs: Any) -> BaseAgent:
        """Build the agent with the specs of ``env`` (``kwargs`` override them)."""
        specs = env_specs(env)
        agent = cls(**_accepted(cls, {**specs, **kwargs}))
        rules = ActionLayout.from_env(getattr(env, "unwrapped", env)).replica_rules
        if rules:
            agent.adopt_replica_rules(rules)
        return agent

    def adopt_replica_rules(self, rules: tuple[str, ...]) -> None:
        """Extend the layout by the env's replica-rule dimension (placements with replicas).

        The agent then always answers index 0, the env's default ``replica_rule``; cached
        action templates of subclasses get that trailing 0.
        """
        old = self.layout.size
        self.layout = dataclasses.replace(self.layout, replica_rules=tuple(rules))
        for name in ("_action", "_template"):
            cached = getattr(self, name, None)
            if isinstance(cached, np.ndarray) and cached.shape == (old,):
                setattr(self, name, np.append(cached, np.int64(0)))

    def act(self, observation: Observation,
            mask: list[NDArray[np.bool_]] | None = None) -> NDArray[np.int64]:
        """Return the action for one observation (``mask`` split per dimension, or None)."""
        raise NotImplementedError

    def predict(self, observation: Any, state: Any = None, episode_start: Any = None,
                deterministic: bool = True, action_masks: Any = None
                ) -> tuple[NDArray[np.int64], Any]:
        """Return ``(action, state)`` as SB3's ``predict`` (batched observations supported).

        Args:
            observation: The env's Dict observation (or a batch of them, as from a VecEnv).
            state: Recurrent state (unused, returned unchanged).
            episode_start: Episode-start flags (unused).
            deterministic: Unused by deterministic heuristics.
            action_masks: Optional flat bool mask (``env.action_masks()``), or one per row.

        Returns:
            int64 [max_broadcast + 2] (or [n, max_broadcast + 2] for a batch) and ``state``.
        """
        if not self.uses_mask:
            action_masks = None
        if _is_batched(observation):
            n = np.asarray(observation["layer"]).shape[0]
            masks = None if action_masks is None else np.asarray(action_masks, dtype=bool)
            rows = []
            for i in range(n):
                obs_i = {key: np.asarray(value)[i] for key, value in observation.items()}
                m = None if masks is None else self.layout.split_mask(masks[i])
                rows.append(self.act(obs_i, m))
            return np.stack(rows), state
        mask = None if action_masks is None else self.layout.split_mask(action_masks)
        return self.act(observation, mask), state


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keep the keyword arguments ``cls.__init__`` accepts (``from_env`` passes every spec)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class NoOpAgent(BaseAgent):
    """The static placement: no pre-broadcast, the first dispatch rule, gating off.

    Args:
        num_experts: E (or pass ``model=``).
        model: A ModelSpec (its ``num_experts`` is used when ``num_experts`` is None).
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env.
        gating_levels: Gating levels of the env.
    """

    name = "noop"
    uses_mask = False

    def __init__(self, num_experts: int | None = None, *, model: Any = None,
                 max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        super().__init__(resolve_num_experts(num_experts, model), max_broadcast=max_broadcast,
                         dispatch_rules=dispatch_rules, gating_levels=gating_levels)
        self._action = self.layout.noop()

    def act(self, observation: Observation,
            mask: list[NDArray[np.bool_]] | None = None) -> NDArray[np.int64]:
        """Return the no-op action."""
        return self._action.copy()


class RandomAgent(BaseAgent):
    """Uniformly random actions over the masked action space, from its own seeded generator.

    Slots are drawn one after another among the values the mask allows, without repeating an
    expert already drawn for an earlier slot (falling back to "none"); without a mask, the slots
    beyond the budget k_b = round(budget · max_broadcast) of the observation are "none" and no
    broadcast is drawn for layer 0.

    Args:
        num_experts: E (or pass ``model=``).
        model: A ModelSpec.
        seed: Seed of the agent's ``np.random.Generator`` (style.md R7).
        max_broadcast: Pre-broadcast slots of the env.
        dispatch_rules: Dispatch rule names of the env.
        gating_levels: Gating levels of the env.
    """

    name = "random"

    def __init__(self, num_experts: int | None = None, *, model: Any = None,
                 seed: int | None = 0, max_broadcast: int = 8,
                 dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES,
                 gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS) -> None:
        super().__init__(resolve_num_experts(num_experts, model), max_broadcast=max_broadcast,
                         dispatch_rules=dispatch_rules, gating_levels=gating_levels)
        self.rng = np.random.default_rng(seed)

    def _default_mask(self, observation: Observation) -> list[NDArray[np.bool_]]:
        lay = self.layout
        budget = float(np.asarray(observation.get("budget", [1.0])).reshape(-1)[0])
        k_b = int(round(budget * lay.max_broadcast))
        if "layer" in observation and float(np.asarray(observation["layer"]).reshape(-1)[0]) <= 0:
            k_b = 0
        masks = []
        for slot in range(lay.max_broadcast):
            m = np.zeros(lay.num_experts + 1, dtype=bool)
            m[lay.none] = True
            if slot < k_b:
                m[:] = True
            masks.append(m)
        masks.append(np.ones(len(lay.dispatch_rules), dtype=bool))
        masks.append(np.ones(len(lay.gating_levels), dtype=bool))
        if lay.replica_rules:
            masks.append(np.ones(len(lay.replica_rules), dtype=bool))
        return masks

    def act(self, observation: Observation,
            mask: list[NDArray[np.bool_]] | None = None) -> NDArray[np.int64]:
        """Draw a random valid action."""
        lay = self.layout
        masks = self._default_mask(observation) if mask is None else mask
        action = np.empty(lay.size, dtype=np.int64)
        used: set[int] = set()
        for slot in range(lay.max_broadcast):
            allowed = np.flatnonzero(masks[slot])
            fresh = [int(v) for v in allowed if v == lay.none or int(v) not in used]
            if not fresh:
                fresh = [int(v) for v in allowed] or [lay.none]
            value = int(self.rng.choice(fresh))
            action[slot] = value
            if value != lay.none:
                used.add(value)
        for dim in range(lay.max_broadcast, lay.size):
            allowed = np.flatnonzero(masks[dim])
            action[dim] = int(self.rng.choice(allowed)) if allowed.size else 0
        return action


def resolve_num_experts(num_experts: int | None, model: Any) -> int:
    """Return E: ``num_experts`` if given, else the expert count of ``model`` (spec or preset id).

    Raises:
        ConfigError: Neither is given.
    """
    if num_experts is not None:
        return int(num_experts)
    if model is None:
        raise ConfigError("pass num_experts=E or model=<ModelSpec or preset id>")
    from hdamoe_env.config.specs import get_model

    return get_model(model).num_experts
