"""The action layout of ``HdMoE-v1``: a pure description of the env's ``MultiDiscrete`` action.

Implements the action interface of paper-model.md §10.1 (one decision per MoE layer):
``MultiDiscrete([E + 1] * max_broadcast + [R, G])`` — slot value e < E pre-broadcasts expert e
for the current layer (§10.5), E means "none"; then the index of the dispatch rule in
``dispatch_rules`` (R rules, §10.4) and of the gating level in ``gating_levels`` (G levels,
index 0 = off, §11). :class:`ActionLayout` encodes and decodes such actions and splits the flat
``action_masks()`` vector per dimension.

With a placement that has redundant experts (``Placement.replicas``) the env appends one more
dimension, the index of the replica dispatch rule in ``replica_rules``
(``hdamoe_env.decisions.dispatch.dispatch_replicas``); without replicas ``replica_rules`` is
empty and the layout is exactly the one above. Index helpers: ``rule_slot``, ``level_slot``,
``replica_slot``.

The layout is data about the env, so it lives in the core: the public wrappers
(``hdamoe_env.env.wrappers``) and every agent (``agents.base`` re-exports it) read it. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError, InvalidAction

__all__ = ["DEFAULT_DISPATCH_RULES", "DEFAULT_GATING_LEVELS", "ActionLayout", "discrete_action"]

DEFAULT_DISPATCH_RULES: tuple[str, ...] = ("least_loaded", "first", "home")
DEFAULT_GATING_LEVELS: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)


def _offered_index(what: str, name: str, offered: tuple[str, ...]) -> int:
    """Return the index of ``name`` among the env's ``offered`` choices of kind ``what``."""
    try:
        return offered.index(name)
    except ValueError:
        raise ConfigError(f"{what} {name!r} is not offered by the env; expected one of "
                          f"{list(offered)}") from None


@dataclass(frozen=True)
class ActionLayout:
    """The ``MultiDiscrete`` action of ``HdMoE-v1`` (module docstring).

    Attributes:
        num_experts: E routed experts per layer.
        max_broadcast: Number of pre-broadcast slots.
        dispatch_rules: Names of the dispatch rules, in action order.
        gating_levels: Gating levels (multiples of the default coefficients), index 0 = off.
        replica_rules: Replica dispatch rules of the trailing dimension, in action order (index
            0 = the env's default ``replica_rule``); empty = no such dimension (no replicas).
    """

    num_experts: int
    max_broadcast: int = 8
    dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_RULES
    gating_levels: tuple[float, ...] = DEFAULT_GATING_LEVELS
    replica_rules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatch_rules", tuple(self.dispatch_rules))
        object.__setattr__(self, "replica_rules", tuple(self.replica_rules))
        object.__setattr__(self, "gating_levels", tuple(float(v) for v in self.gating_levels))
        if self.num_experts < 1 or self.max_broadcast < 0:
            raise ConfigError(f"ActionLayout needs num_experts >= 1 and max_broadcast >= 0, got "
                              f"{self.num_experts}, {self.max_broadcast}")
        if not self.dispatch_rules or not self.gating_levels:
            raise ConfigError("ActionLayout needs at least one dispatch rule and one gating level")

    @property
    def none(self) -> int:
        """Slot value meaning "no pre-broadcast" (= E)."""
        return self.num_experts

    @property
    def nvec(self) -> NDArray[np.int64]:
        """int64 [size] sizes of the ``MultiDiscrete`` dimensions."""
        tail = [len(self.replica_rules)] if self.replica_rules else []
        return np.array([self.num_experts + 1] * self.max_broadcast
                        + [len(self.dispatch_rules), len(self.gating_levels)] + tail,
                        dtype=np.int64)

    @property
    def size(self) -> int:
        """Number of action dimensions: max_broadcast + 2 (+ 1 with replica rules)."""
        return self.max_broadcast + 2 + (1 if self.replica_rules else 0)

    @property
    def rule_slot(self) -> int:
        """Index of the dispatch-rule dimension (= max_broadcast)."""
        return self.max_broadcast

    @property
    def level_slot(self) -> int:
        """Index of the gating-level dimension (= max_broadcast + 1)."""
        return self.max_broadcast + 1

    @property
    def replica_slot(self) -> int | None:
        """Index of the replica-rule dimension (max_broadcast + 2), or None without one."""
        return self.max_broadcast + 2 if self.replica_rules else None

    def rule_index(self, rule: str) -> int:
        """Return the action index of dispatch rule ``rule``.

        Raises:
            ConfigError: The env does not offer the rule.
        """
        return _offered_index("dispatch rule", rule, self.dispatch_rules)

    def level_index(self, level: float) -> int:
        """Return the action index of the gating level closest to ``level`` (0.0 = off)."""
        levels = np.asarray(self.gating_levels)
        if level <= 0.0:
            zero = np.flatnonzero(levels <= 0.0)
            if zero.size:
                return int(zero[0])
        return int(np.argmin(np.abs(levels - level)))

    def noop(self) -> NDArray[np.int64]:
        """Return the no-op action: no pre-broadcast, the first dispatch rule, gating off."""
        return self.encode()

    def encode(self, broadcast: Any = (), dispatch_rule: str | None = None,
               gating_level: float = 0.0, replica_rule: str | None = None
               ) -> NDArray[np.int64]:
        """Build an action.

        Args:
            broadcast: Expert ids to pre-broadcast (at most ``max_broadcast``, extra ids are
                dropped); remaining slots are "none".
            dispatch_rule: Rule name (None: the first rule of the layout).
            gating_level: Gating level value (0.0 = off; the closest level is used).
            replica_rule: Replica rule name (None: the first, the env's default); only with
                ``replica_rules``.

        Returns:
            int64 [size].

        Raises:
            ConfigError: A rule the layout does not offer.
        """
        action = np.full(self.size, self.none, dtype=np.int64)
        experts = [int(e) for e in broadcast][: self.max_broadcast]
        action[: len(experts)] = experts
        action[self.rule_slot] = 0 if dispatch_rule is None else self.rule_index(dispatch_rule)
        action[self.level_slot] = self.level_index(gating_level)
        if self.replica_rules:
            action[self.max_broadcast + 2] = (0 if replica_rule is None
                                              else self.replica_rule_index(replica_rule))
        elif replica_rule is not None:
            raise ConfigError(f"replica rule {replica_rule!r} given but the env offers none (its "
                              "placement has no replicas)")
        return action

    def replica_rule_index(self, rule: str) -> int:
        """Return the action index of replica rule ``rule``.

        Raises:
            ConfigError: The env does not offer the rule.
        """
        return _offered_index("replica rule", rule, self.replica_rules)

    def split_mask(self, mask: Any) -> list[NDArray[np.bool_]]:
        """Split a flat ``action_masks()`` vector into one bool array per dimension.

        Raises:
            ConfigError: The mask length is not ``nvec.sum()``.
        """
        flat = np.asarray(mask, dtype=bool).reshape(-1)
        sizes = self.nvec
        if flat.size != int(sizes.sum()):
            raise ConfigError(f"action mask has {flat.size} entries; this layout needs "
                              f"{int(sizes.sum())} (nvec {sizes.tolist()})")
        return np.split(flat, np.cumsum(sizes)[:-1])

    @classmethod
    def from_env(cls, env: Any) -> ActionLayout:
        """Read the layout of an ``HdMoeEnv`` (or a wrapper of one)."""
        base = getattr(env, "unwrapped", env)
        nvec = np.asarray(base.action_space.nvec)
        rules = tuple(getattr(base, "dispatch_rules", DEFAULT_DISPATCH_RULES))
        levels = tuple(getattr(base, "gating_levels", DEFAULT_GATING_LEVELS))
        replica_rules = tuple(getattr(base, "replica_rules", ()))
        layout = cls(int(nvec[0]) - 1, int(nvec.size) - 2 - (1 if replica_rules else 0), rules,
                     levels, replica_rules)
        if not np.array_equal(layout.nvec, nvec):
            raise ConfigError(f"env action space nvec {nvec.tolist()} does not match the layout "
                              f"{layout.nvec.tolist()} built from its attributes")
        return layout


def discrete_action(action: Any, n: int) -> int:
    """Return ``action`` as an index of ``Discrete(n)`` (the single-decision envs' check).

    Accepts a Python or numpy integer, a one-element array, or an integral float.

    Raises:
        InvalidAction: Not one integral value, or outside ``[0, n)`` (the message names it).
    """
    raw = np.asarray(action)
    if raw.size != 1 or raw.dtype.kind not in "iuf" or (
            raw.dtype.kind == "f" and not float(raw.reshape(())).is_integer()):
        raise InvalidAction(f"action must be an integer in [0, {n}), got {action!r}")
    a = int(raw.reshape(()))
    if not 0 <= a < n:
        raise InvalidAction(f"action {a} is outside Discrete({n})")
    return a
