"""The knob space of the tuned heuristic: one point and the grid of every knob's values.

The knobs of HDA-MoE's greedy agents that ``agents.tuned.search`` searches:

| knob | values | where it acts |
|---|---|---|
| ``gating_level`` | multiples of the default (r_comp, r_comm) of §11.7, 0 = off | the agent's level (the env offers ``(0, level)``) |
| ``protect_top`` | 0 … k | ``EnvConfig.gating_protect_top`` (never drop a token's m best experts) |
| ``dispatch_rule`` | ``dispatch.DISPATCH_RULES`` | the agent's dispatch rule of broadcast experts |
| ``k_b`` | None (the budget rule of §10.3) or a forced slot count | ``EnvConfig.k_b`` |
| ``min_imbalance`` | None (always gate) or a threshold | the gating agent gates only layers whose predicted max/mean node load exceeds it |
| ``replica_rule`` | None, or ``least_loaded`` / ``nearest`` / ``round_robin`` | ``EnvConfig.replica_rule`` (placements with redundant experts, e.g. ``eplb``) |

:class:`TunedKnobs` is one point; :meth:`TunedKnobs.make_agent` builds its agent on an env built
with :meth:`TunedKnobs.env_kwargs`. :class:`KnobGrid` is the search space;
:meth:`KnobGrid.canonical` maps points that cannot differ in effect onto one representative.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.composite import HDAMoEAgent
from hdamoe_env.config.errors import ConfigError

__all__ = [
    "LP_SHARES",
    "REPLICA_RULES",
    "REPLICA_RULE_ENV_KWARG",
    "KnobGrid",
    "TunedKnobs",
]

#: Replica-dispatch rules of :attr:`TunedKnobs.replica_rule` (``dispatch.REPLICA_RULES``
#: without ``shares``, which needs per-copy fractions: the oracle's :data:`LP_SHARES`).
REPLICA_RULES: tuple[str, ...] = ("least_loaded", "nearest", "round_robin")
#: ``EnvConfig`` field the replica rule is passed as.
REPLICA_RULE_ENV_KWARG = "replica_rule"
#: Oracle-only replica "rule" of ``agents.tuned.oracle.per_layer_oracle``: per layer and step,
#: the per-copy fractions of ``agents.tuned.oracle.balanced_replica_fractions`` on the layer's
#: executed sets (hindsight).
LP_SHARES = "lp_shares"

DEFAULT_DISPATCH_OFFER = ("least_loaded", "first", "home")     # the env's default offer, in order


# ------------------------------------------------------------------------------------ knobs
@dataclass(frozen=True)
class TunedKnobs:
    """One point of the knob space of the greedy agents.

    Attributes:
        gating_level: Multiple of the default gating coefficients (0 = gating off).
        protect_top: Never drop a token's ``protect_top`` best original experts (0 … k).
        dispatch_rule: Dispatch rule of the broadcast experts' tokens.
        k_b: Forced pre-broadcast slots per layer (layer 0 stays 0), or None for the budget rule.
        replica_rule: Replica-dispatch rule of redundant experts (:data:`REPLICA_RULES`), None =
            the env's default; only acts with a placement that has replicas.
        min_imbalance: Gate only layers whose predicted max/mean node load is at least this
            (``agents.gating.HardwareAwareGatingAgent``); None = gate every layer.

    Raises:
        ConfigError: A negative level, protect_top or threshold, an unknown rule, a negative k_b.
    """

    gating_level: float = 1.0
    protect_top: int = 0
    dispatch_rule: str = "least_loaded"
    k_b: int | None = None
    replica_rule: str | None = None
    min_imbalance: float | None = None

    def __post_init__(self) -> None:
        """Validate and normalise the values (floats, ints)."""
        level = float(self.gating_level)
        if not math.isfinite(level) or level < 0:
            raise ConfigError(f"gating_level must be a finite number >= 0, got "
                              f"{self.gating_level!r}; use 0 for gating off")
        object.__setattr__(self, "gating_level", level)
        if int(self.protect_top) < 0:
            raise ConfigError(f"protect_top must be >= 0, got {self.protect_top}")
        object.__setattr__(self, "protect_top", int(self.protect_top))
        if self.dispatch_rule not in DEFAULT_DISPATCH_OFFER:
            raise ConfigError(f"dispatch_rule {self.dispatch_rule!r} is unknown; expected one of "
                              f"{list(DEFAULT_DISPATCH_OFFER)}")
        if self.k_b is not None:
            if int(self.k_b) < 0:
                raise ConfigError(f"k_b must be None (budget rule) or >= 0, got {self.k_b}")
            object.__setattr__(self, "k_b", int(self.k_b))
        if self.min_imbalance is not None:
            imb = float(self.min_imbalance)
            if not math.isfinite(imb) or imb < 0:
                raise ConfigError(f"min_imbalance must be None or a finite number >= 0, got "
                                  f"{self.min_imbalance!r}")
            object.__setattr__(self, "min_imbalance", imb)
        if self.replica_rule is not None and self.replica_rule not in (*REPLICA_RULES,
                                                                       LP_SHARES):
            raise ConfigError(f"replica_rule {self.replica_rule!r} is unknown; expected None or "
                              f"one of {list(REPLICA_RULES)} ({LP_SHARES!r}: the oracle only)")

    def env_kwargs(self) -> dict[str, Any]:
        """Return the ``HdMoeEnv`` keyword arguments of this point.

        The env offers exactly the gating levels ``(0, gating_level)``, so the agent's level is
        applied as is (not rounded to the closest default level).
        """
        kwargs: dict[str, Any] = {
            "gating_protect_top": self.protect_top,
            "gating_levels": (0.0,) if self.gating_level == 0 else (0.0, self.gating_level),
            "dispatch_rules": DEFAULT_DISPATCH_OFFER,
        }
        if self.k_b is not None:
            kwargs["k_b"] = self.k_b
        if self.replica_rule is not None:          # the oracle sets LP shares' fractions itself
            kwargs[REPLICA_RULE_ENV_KWARG] = ("least_loaded" if self.replica_rule == LP_SHARES
                                              else self.replica_rule)
        return kwargs

    def make_agent(self, env: Any) -> HDAMoEAgent:
        """Return the greedy agent of this point for an env built with :meth:`env_kwargs`."""
        return HDAMoEAgent.from_env(getattr(env, "unwrapped", env),
                                    gating_level=self.gating_level,
                                    dispatch_rule=self.dispatch_rule,
                                    min_imbalance=self.min_imbalance)

    def to_dict(self) -> dict[str, Any]:
        """Return the knobs as plain JSON values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TunedKnobs:
        """Build knobs from :meth:`to_dict` output.

        Raises:
            ConfigError: Unknown keys or bad values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown knob(s) {sorted(unknown)}; expected {sorted(names)}")
        return cls(**data)

    def key(self) -> str:
        """Return a canonical text key of the point (journal and cache key)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def label(self) -> str:
        """Return a short human-readable label."""
        kb = "budget" if self.k_b is None else str(self.k_b)
        text = (f"level={self.gating_level:g} protect={self.protect_top} "
                f"rule={self.dispatch_rule} k_b={kb}")
        if self.min_imbalance is not None:
            text += f" min_imbalance={self.min_imbalance:g}"
        return text + (f" replica={self.replica_rule}" if self.replica_rule else "")


@dataclass(frozen=True)
class KnobGrid:
    """The search space: the values of every knob (their product is the grid).

    Attributes:
        gating_levels: Gating levels (0 = off).
        protect_top: protect_top values.
        dispatch_rules: Dispatch rules.
        k_b: Pre-broadcast slot options (None = the budget rule).
        replica_rules: Replica-dispatch rules (None = env default).
        min_imbalance: Gating thresholds (None = gate every layer).

    Raises:
        ConfigError: An empty or repeating knob.
    """

    gating_levels: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
    protect_top: tuple[int, ...] = (0, 1)
    dispatch_rules: tuple[str, ...] = DEFAULT_DISPATCH_OFFER
    k_b: tuple[int | None, ...] = (None,)
    replica_rules: tuple[str | None, ...] = (None,)
    min_imbalance: tuple[float | None, ...] = (None,)

    def __post_init__(self) -> None:
        """Validate the knob values (non-empty, distinct) and store them as tuples."""
        for f in dataclasses.fields(self):
            values = tuple(getattr(self, f.name))
            if not values:
                raise ConfigError(f"KnobGrid.{f.name} is empty; give at least one value")
            if len(set(values)) != len(values):
                raise ConfigError(f"KnobGrid.{f.name} repeats a value: {list(values)}")
            if f.name == "replica_rules" and LP_SHARES in values:
                raise ConfigError(f"KnobGrid.replica_rules: {LP_SHARES!r} is the oracle's "
                                  f"hindsight split, not a rule to tune; expected None or "
                                  f"{list(REPLICA_RULES)} (per_layer_oracle adds it itself)")
            object.__setattr__(self, f.name, values)

    @property
    def dimensions(self) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """(knob name, values) of every knob, in :class:`TunedKnobs` field order."""
        return (("gating_level", self.gating_levels), ("protect_top", self.protect_top),
                ("dispatch_rule", self.dispatch_rules), ("k_b", self.k_b),
                ("replica_rule", self.replica_rules), ("min_imbalance", self.min_imbalance))

    @property
    def size(self) -> int:
        """Number of raw grid points (before canonicalisation)."""
        return int(np.prod([len(v) for _, v in self.dimensions]))

    def point(self, indices: Sequence[int]) -> TunedKnobs:
        """Return the canonical knobs of one grid index vector (see :meth:`canonical`)."""
        values = {name: vals[int(i)] for (name, vals), i in zip(self.dimensions, indices,
                                                                  strict=True)}
        return self.canonical(TunedKnobs(**values))

    def canonical(self, knobs: TunedKnobs) -> TunedKnobs:
        """Map knobs that cannot differ in effect onto one representative.

        With gating off, ``protect_top`` and ``min_imbalance`` have no effect (they become the
        grid's first values);
        with ``k_b = 0`` nothing is broadcast, so the dispatch rule has no effect (it becomes
        the grid's first value; the replica rule still acts on the redundant experts).
        """
        if knobs.gating_level == 0:
            knobs = dataclasses.replace(knobs, protect_top=self.protect_top[0],
                                        min_imbalance=self.min_imbalance[0])
        if knobs.k_b == 0:
            knobs = dataclasses.replace(knobs, dispatch_rule=self.dispatch_rules[0])
        return knobs

    def points(self) -> list[TunedKnobs]:
        """Return the distinct canonical points in grid order (first knob slowest)."""
        seen: dict[str, TunedKnobs] = {}
        for idx in itertools.product(*[range(len(v)) for _, v in self.dimensions]):
            p = self.point(idx)
            seen.setdefault(p.key(), p)
        return list(seen.values())

    def to_dict(self) -> dict[str, Any]:
        """Return the grid as plain JSON values (``min_imbalance`` only when searched, so a
        grid that does not search it has a run key without it)."""
        out = {name: list(values) for name, values in self.dimensions}
        if self.min_imbalance == (None,):
            del out["min_imbalance"]
        return out
