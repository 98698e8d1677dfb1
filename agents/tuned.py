"""The tuned heuristic: HDA-MoE's greedy agents with every knob searched (and its hindsight bound).

The paper's online agents (``agents.composite.HDAMoEAgent``: greedy pre-broadcast, a dispatch
rule, hardware-aware gating) have knobs the paper fixes by hand. This module searches them on
the *training* part of a trace and reports the best point under a model-quality constraint, so
that a learned policy can be compared with the strongest heuristic of the same levers rather
than with the defaults:

| knob | values | where it acts |
|---|---|---|
| ``gating_level`` | multiples of the default (r_comp, r_comm) of §11.7, 0 = off | the agent's level (the env offers ``(0, level)``) |
| ``protect_top`` | 0 … k | ``EnvConfig.gating_protect_top`` (never drop a token's m best experts) |
| ``dispatch_rule`` | ``dispatch.DISPATCH_RULES`` | the agent's dispatch rule of broadcast experts |
| ``k_b`` | None (the budget rule of §10.3) or a forced slot count | ``EnvConfig.k_b`` |
| ``min_imbalance`` | None (always gate) or a threshold | the gating agent gates only layers whose predicted max/mean node load exceeds it |
| ``replica_rule`` | None, or ``least_loaded`` / ``nearest`` / ``round_robin`` | ``EnvConfig.replica_rule`` (placements with redundant experts, e.g. ``eplb``) |

* :class:`TunedKnobs` is one point; :meth:`TunedKnobs.make_agent` builds its agent on an env
  built with :meth:`TunedKnobs.env_kwargs`. :class:`KnobGrid` is the search space.
* :func:`tune` searches a grid exhaustively (small grids) or by Bayesian optimisation with
  scikit-optimize's ``gp_minimize`` (larger ones; the ``opt`` extra, imported lazily). The
  objective is the mean TBT subject to mean top-1 retention ≥ ``target`` (default 0.99);
  :func:`penalised_objective` documents the penalty an infeasible point gets (it only steers
  the optimiser: an infeasible point is never selected). Every evaluated point is written to a
  JSON-lines journal (the whole file rewritten atomically after each point); a rerun with
  ``resume=True`` takes the journal's values instead of re-evaluating, and because BO replays
  the same proposals from the same seed, a resumed search equals an uninterrupted one.
* :class:`EpisodeEvaluator` measures a point on the env: mean TBT and mean top-1 retention of
  fixed episodes (the quality term of :func:`tune`).
* :func:`per_layer_oracle` is the per-step hindsight bound over the same grid
  (:class:`OracleResult` documents exactly what it bounds).

Layer: ``agents`` (needs the env and the composite agents; nothing of ``hdamoe_env.app``).
``hdamoe tune`` (``hdamoe_env.app.tune``) is the command; ``hdamoe bench --methods
tuned:PATH/tuned.json`` runs the result as a method.

This module is longer than 700 lines because the knob grid, the search with its journal and
the hindsight oracle share one episode evaluator and are documented together (the table above).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agents.composite import HDAMoEAgent
from agents.gating import HardwareAwareGatingAgent
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, OutputPathError
from hdamoe_env.config.fileio import atomic_write, json_default, write_json

__all__ = [
    "DEFAULT_PENALTY",
    "DEFAULT_QUALITY_TARGET",
    "LP_SHARES",
    "REPLICA_RULES",
    "REPLICA_RULE_ENV_KWARG",
    "SEARCH_METHODS",
    "TUNED_FORMAT",
    "EpisodeEvaluator",
    "KnobGrid",
    "Measurement",
    "OracleResult",
    "PointRecord",
    "TuneResult",
    "TunedKnobs",
    "balanced_replica_fractions",
    "load_tuned",
    "penalised_objective",
    "per_layer_oracle",
    "run_key_of",
    "tune",
    "write_tuned",
]

#: Default model-quality constraint: mean top-1 retention of the gated routing.
DEFAULT_QUALITY_TARGET = 0.99
#: Default penalty factor of :func:`penalised_objective` (per unit of missing retention).
DEFAULT_PENALTY = 100.0
#: Search methods of :func:`tune`.
SEARCH_METHODS: tuple[str, ...] = ("auto", "grid", "bo")
#: Replica-dispatch rules of :attr:`TunedKnobs.replica_rule` (``dispatch.REPLICA_RULES``
#: without ``shares``, which needs per-copy fractions: the oracle's LP shares, below).
REPLICA_RULES: tuple[str, ...] = ("least_loaded", "nearest", "round_robin")
#: ``EnvConfig`` field the replica rule is passed as.
REPLICA_RULE_ENV_KWARG = "replica_rule"
#: Oracle-only replica "rule" of :func:`per_layer_oracle`: per layer and step, the per-copy
#: fractions of :func:`balanced_replica_fractions` on the layer's executed sets (hindsight).
LP_SHARES = "lp_shares"
#: ``tuned.json`` format tag.
TUNED_FORMAT = "hdamoe-tuned/1"

_DISPATCH_RULES = ("least_loaded", "first", "home")     # the env's default offer, in order
_EXTRA = 'pip install -c constraints.txt "hdamoe-env[opt]"'


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
        if self.dispatch_rule not in _DISPATCH_RULES:
            raise ConfigError(f"dispatch_rule {self.dispatch_rule!r} is unknown; expected one of "
                              f"{list(_DISPATCH_RULES)}")
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
            "dispatch_rules": _DISPATCH_RULES,
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
    dispatch_rules: tuple[str, ...] = _DISPATCH_RULES
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
        """Return the grid as plain JSON values (``min_imbalance`` only when searched, so the
        run keys of journals written before it existed are unchanged)."""
        out = {name: list(values) for name, values in self.dimensions}
        if self.min_imbalance == (None,):
            del out["min_imbalance"]
        return out


# ------------------------------------------------------------------------------ measurements
@dataclass(frozen=True)
class Measurement:
    """What a point costs and keeps.

    Attributes:
        tbt_us: Mean time between tokens over the evaluated decode steps (µs).
        top1_retention: Mean over every MoE layer of every decode step of the fraction of
            tokens whose top-1 expert survives gating (1 for an ungated layer).
        decode_steps: Decode steps measured.
        score_mass_kept: Mean over every MoE layer of the router score mass of the original
            top-k the gated sets keep (1 for an ungated layer); reported, not constrained —
            a stricter view of quality than top-1 retention when ``protect_top`` ≥ 1 keeps
            the top-1 choice by construction. NaN when not measured.
    """

    tbt_us: float
    top1_retention: float
    decode_steps: int = 0
    score_mass_kept: float = float("nan")


def penalised_objective(measurement: Measurement, target: float,
                        penalty: float = DEFAULT_PENALTY) -> float:
    """Return the value the search minimises: TBT, inflated when quality misses the target.

    ``f = tbt_us`` if ``top1_retention >= target``, else
    ``f = tbt_us · (1 + penalty · (target − top1_retention))``. With the default penalty 100,
    each percentage point of missing top-1 retention costs +100 % TBT, far above the few-percent
    TBT differences between feasible points, so the optimiser is pushed back into the feasible
    region, while a point just below the target is still ranked by its TBT. The penalty only
    steers the search: :func:`tune` never selects an infeasible point.

    Example: tbt 1000 µs, retention 0.985, target 0.99 → 1000 · (1 + 100 · 0.005) = 1500.
    """
    short = target - measurement.top1_retention
    if short <= 0:
        return float(measurement.tbt_us)
    return float(measurement.tbt_us) * (1.0 + float(penalty) * short)


class EpisodeEvaluator:
    """Measure knob points on fixed episodes of ``HdMoeEnv`` (the search objective).

    Every point runs ``env.reset(seed=s)`` for each seed on its own env built from ``env_kwargs``
    plus the point's :meth:`TunedKnobs.env_kwargs`, so the decode steps are identical across
    points (as in ``hdamoe bench``). Results are cached per effective point: when the budget
    rule gives k_b = 0 in every layer, the dispatch rule cannot matter and is normalised before
    the cache lookup (the replica rule still acts on redundant experts).

    Args:
        env_kwargs: ``HdMoeEnv`` keyword arguments (a loaded ``trace`` and a ``Placement`` avoid
            reloading them per point).
        seeds: Episode seeds.
    """

    def __init__(self, env_kwargs: dict[str, Any], seeds: Sequence[int]) -> None:
        if not seeds:
            raise ConfigError("EpisodeEvaluator needs at least one episode seed")
        self.env_kwargs = dict(env_kwargs)
        self.seeds = tuple(int(s) for s in seeds)
        self._cache: dict[str, Measurement] = {}
        self._kb_zero: dict[tuple[int | None, int], bool] = {}

    def make_env(self, knobs: TunedKnobs) -> Any:
        """Return the env of a point."""
        from hdamoe_env.env.environment import HdMoeEnv

        return HdMoeEnv(**{**self.env_kwargs, **knobs.env_kwargs()})

    def __call__(self, knobs: TunedKnobs) -> Measurement:
        """Return the point's mean TBT and mean top-1 retention over the seeds' episodes."""
        env = self.make_env(knobs)
        if not np.any(env.k_b):
            knobs = dataclasses.replace(knobs, dispatch_rule=_DISPATCH_RULES[0])
        hit = self._cache.get(knobs.key())
        if hit is not None:
            return hit
        agent = knobs.make_agent(env)
        tbts: list[float] = []
        kept: list[float] = []
        mass: list[float] = []
        for seed in self.seeds:
            obs, _ = env.reset(seed=seed)
            done = False
            while not done:
                action, _ = agent.predict(obs, deterministic=True)
                obs, _r, terminated, truncated, info = env.step(action)
                done = bool(terminated or truncated)
                kept.append(float(info.get("top1_retention", 1.0)))
                mass.append(float(info.get("score_mass_kept", 1.0)))
                if "tbt_us" in info:
                    tbts.append(float(info["tbt_us"]))
        result = Measurement(float(np.mean(tbts)), float(np.mean(kept)), len(tbts),
                             float(np.mean(mass)))
        self._cache[knobs.key()] = result
        return result


# ------------------------------------------------------------------------------------ search
@dataclass(frozen=True)
class PointRecord:
    """One evaluated point of a search (one journal line).

    Attributes:
        knobs: The point.
        tbt_us: Its mean TBT on the training episodes.
        top1_retention: Its mean top-1 retention.
        feasible: ``top1_retention >= target``.
        objective: :func:`penalised_objective`.
        order: Evaluation order (0-based).
    """

    knobs: TunedKnobs
    tbt_us: float
    top1_retention: float
    feasible: bool
    objective: float
    order: int

    def to_dict(self, run_key: str = "") -> dict[str, Any]:
        """Return the journal line of the point."""
        return {"run_key": run_key, "knobs": self.knobs.to_dict(), "tbt_us": self.tbt_us,
                "top1_retention": self.top1_retention, "feasible": self.feasible,
                "objective": self.objective, "order": self.order}


@dataclass(frozen=True)
class TuneResult:
    """Result of :func:`tune`.

    Attributes:
        best: The feasible point of least TBT (ties: earliest evaluated), None if none is.
        points: Every evaluated point, in evaluation order.
        method: ``"grid"`` or ``"bo"``.
        resumed: Points taken from the journal instead of evaluated.
        target: The quality target.
    """

    best: PointRecord | None
    points: tuple[PointRecord, ...]
    method: str
    resumed: int
    target: float


def _read_journal(path: Path, run_key: str) -> dict[str, dict[str, Any]]:
    """Return the journal's lines by knob key; refuse a journal of another configuration."""
    out: dict[str, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{str(path)!r} line {n} is not JSON; it is not a tune journal "
                              "(move it away or choose another --out)") from None
        if rec.get("run_key") != run_key:
            raise ConfigError(f"{str(path)!r} holds points of another configuration (run key "
                              f"{rec.get('run_key')!r}, expected {run_key!r}); use a new --out "
                              "or the original arguments")
        out[TunedKnobs.from_dict(rec["knobs"]).key()] = rec
    return out


def tune(evaluate: Callable[[TunedKnobs], Measurement], grid: KnobGrid, *,
         target: float = DEFAULT_QUALITY_TARGET, method: str = "auto", n_calls: int = 40,
         n_initial: int = 10, max_grid: int = 128, seed: int = 0,
         penalty: float = DEFAULT_PENALTY, journal: str | os.PathLike[str] | None = None,
         resume: bool = False, run_key: str = "",
         on_point: Callable[[PointRecord], None] | None = None) -> TuneResult:
    """Search the knob grid for the fastest point meeting the quality target.

    Args:
        evaluate: Measures a point (e.g. an :class:`EpisodeEvaluator` on the training split).
        grid: The search space.
        target: Minimum mean top-1 retention of a feasible point.
        method: ``"grid"`` (every canonical point, grid order), ``"bo"`` (``gp_minimize`` with
            ``n_calls`` proposals, ``n_initial`` of them random, ``random_state=seed``) or
            ``"auto"`` (grid when it has at most ``max_grid`` canonical points, else BO).
        n_calls: BO proposals (repeated proposals are not re-evaluated).
        n_initial: BO random initial points.
        max_grid: Largest grid ``"auto"`` searches exhaustively.
        seed: Seed of BO.
        penalty: Factor of :func:`penalised_objective`.
        journal: JSON-lines file of evaluated points (rewritten atomically after each point).
        resume: Take points already in ``journal`` from it instead of evaluating them.
        run_key: Configuration key written on every line; a resumed journal must match it.
        on_point: Called after every newly evaluated point.

    Returns:
        The best feasible point and every evaluated one.

    Raises:
        ConfigError: Bad method, target or budget; a journal of another configuration.
        OutputPathError: ``journal`` exists, is not empty and ``resume`` is False.
        DependencyNotInstalled: ``method="bo"`` without scikit-optimize.
    """
    if method not in SEARCH_METHODS:
        raise ConfigError(f"search method {method!r} is unknown; expected one of "
                          f"{list(SEARCH_METHODS)}")
    if not 0.0 <= target <= 1.0:
        raise ConfigError(f"quality target must lie in [0, 1], got {target}")
    if n_calls < 1 or n_initial < 1:
        raise ConfigError(f"n_calls and n_initial must be >= 1, got {n_calls}, {n_initial}")
    points = grid.points()
    if method == "auto":
        method = "grid" if len(points) <= max_grid else "bo"
    path = Path(journal) if journal is not None else None
    previous: dict[str, dict[str, Any]] = {}
    if path is not None and path.is_file() and path.stat().st_size:
        if not resume:
            raise OutputPathError(f"journal {str(path)!r} already holds points; pass resume=True "
                                  "(--resume) to reuse them, or choose another path")
        previous = _read_journal(path, run_key)
    records: dict[str, PointRecord] = {}
    resumed = 0

    def measure(knobs: TunedKnobs) -> PointRecord:
        nonlocal resumed
        key = knobs.key()
        hit = records.get(key)
        if hit is not None:
            return hit
        old = previous.get(key)
        if old is not None:
            m = Measurement(float(old["tbt_us"]), float(old["top1_retention"]))
            resumed += 1
        else:
            m = evaluate(knobs)
        rec = PointRecord(knobs, float(m.tbt_us), float(m.top1_retention),
                          bool(m.top1_retention >= target),
                          penalised_objective(m, target, penalty), len(records))
        records[key] = rec
        if path is not None and old is None:
            lines = [r.to_dict(run_key) for r in records.values()]
            # keep journal lines this run has not reached (yet) as well
            lines += [v for k, v in previous.items() if k not in records]
            atomic_write(path, lambda fh: fh.writelines(
                json.dumps(x, sort_keys=True, default=json_default) + "\n" for x in lines))
        if on_point is not None and old is None:
            on_point(rec)
        return rec

    if method == "grid":
        for knobs in points:
            measure(knobs)
    else:
        _bayesian_search(measure, grid, n_calls=n_calls, n_initial=n_initial, seed=seed)
    ordered = tuple(records.values())
    feasible = [r for r in ordered if r.feasible]
    best = min(feasible, key=lambda r: (r.tbt_us, r.order)) if feasible else None
    return TuneResult(best, ordered, method, resumed, float(target))


def _bayesian_search(measure: Callable[[TunedKnobs], PointRecord], grid: KnobGrid, *,
                     n_calls: int, n_initial: int, seed: int) -> None:
    """Run ``skopt.gp_minimize`` over the grid's value indices (categorical dimensions)."""
    try:
        from skopt import gp_minimize
        from skopt.space import Categorical
    except ImportError as exc:
        raise DependencyNotInstalled(f"the Bayesian tuned-heuristic search needs "
                                     f"scikit-optimize; run `{_EXTRA}` or use method='grid'"
                                     ) from exc
    dims = grid.dimensions
    varying = [i for i, (_, vals) in enumerate(dims) if len(vals) > 1]
    if not varying:
        measure(grid.point([0] * len(dims)))
        return
    space = [Categorical(list(range(len(dims[i][1]))), name=dims[i][0]) for i in varying]

    def objective(x: list[Any]) -> float:
        idx = [0] * len(dims)
        for i, v in zip(varying, x, strict=True):
            idx[i] = int(v)
        return measure(grid.point(idx)).objective

    n_initial = min(n_initial, n_calls)
    gp_minimize(objective, space, n_calls=n_calls, n_initial_points=n_initial,
                random_state=int(seed), acq_func="EI")


# --------------------------------------------------------------------------------- tuned.json
def write_tuned(path: str | os.PathLike[str], result: TuneResult, *,
                config: dict[str, Any], grid: KnobGrid,
                held_out: Measurement | None = None, extra: dict[str, Any] | None = None
                ) -> Path:
    """Write ``tuned.json``: the best knobs, training and held-out measurements, all points.

    Raises:
        ConfigError: The search found no feasible point.
    """
    if result.best is None:
        raise ConfigError(f"no grid point meets the quality target {result.target}; add gating "
                          "level 0 to the grid or lower --quality-target")
    best = result.best
    data: dict[str, Any] = {
        "format": TUNED_FORMAT,
        "knobs": best.knobs.to_dict(),
        "label": best.knobs.label(),
        "quality_target": result.target,
        "training": {"tbt_us": best.tbt_us, "top1_retention": best.top1_retention},
        "held_out": None if held_out is None else dataclasses.asdict(held_out),
        "method": result.method,
        "config": config,
        "grid": grid.to_dict(),
        "points": [p.to_dict() for p in result.points],
        **(extra or {}),
    }
    return write_json(path, data)


def load_tuned(path: str | os.PathLike[str]) -> tuple[TunedKnobs, dict[str, Any]]:
    """Read a ``tuned.json`` (or the directory holding one); return its knobs and the document.

    Raises:
        ConfigError: Missing file, not JSON, or not a tuned-heuristic file.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "tuned.json"
    if not p.is_file():
        raise ConfigError(f"tuned-heuristic file {str(p)!r} does not exist; run `hdamoe tune "
                          "--out DIR` first and pass DIR/tuned.json")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{str(p)!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != TUNED_FORMAT:
        raise ConfigError(f"{str(p)!r} is not a tuned-heuristic file (format "
                          f"{data.get('format') if isinstance(data, dict) else None!r}, "
                          f"expected {TUNED_FORMAT!r})")
    return TunedKnobs.from_dict(data["knobs"]), data


# ------------------------------------------------------------------------------------ oracle
@dataclass(frozen=True)
class OracleResult:
    """Per-layer hindsight oracle over a knob grid, on identical draws.

    For every MoE layer of every decode step, every grid point's action (the point's greedy
    agent on the same observation, with the point's k_b budget) is evaluated by the env's layer
    physics (``DecisionEvaluator.evaluate``) on the layer's actual routing, with one generator
    seeded by (episode seed, decode step, layer) shared by all points, so all points see the
    same aggregator draws. Then

    * ``constrained``: per layer the fastest point whose top-1 retention *on that layer* is
      ≥ ``target`` (gating off always qualifies). No per-layer policy that picks one of the grid
      points' actions in each layer and keeps every layer's top-1 retention ≥ target can have a
      lower TBT on these steps: its TBT is a sum of per-layer terms, each ≥ the per-layer
      minimum. It does NOT bound a policy that meets the target only on average over layers,
      nor actions outside the grid (e.g. other broadcast sets).
    * ``unconstrained``: per layer the fastest point, quality ignored: a lower bound for every
      per-layer policy over the grid's actions, whatever its quality.

    TBT of a step = Σ_layers latency + the dense layers' time (as the env's ``tbt_us``).

    Attributes:
        points: The grid points, in order.
        fixed_tbt_us: float [K, S] TBT of each point held fixed, per decode step.
        fixed_top1: float [K] mean per-layer top-1 retention of each fixed point.
        constrained_tbt_us: float [S] the constrained oracle per decode step.
        constrained_top1: Mean top-1 retention of the constrained oracle's choices.
        unconstrained_tbt_us: float [S].
        unconstrained_top1: Mean top-1 retention of the unconstrained oracle's choices.
        target: The per-layer quality target.
        choices: How often each point was the constrained oracle's choice (per point, [K]).
    """

    points: tuple[TunedKnobs, ...]
    fixed_tbt_us: np.ndarray
    fixed_top1: np.ndarray
    constrained_tbt_us: np.ndarray
    constrained_top1: float
    unconstrained_tbt_us: np.ndarray
    unconstrained_top1: float
    target: float
    choices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def best_fixed(self) -> int | None:
        """Index of the fastest fixed point with mean top-1 retention ≥ target (None: none)."""
        ok = np.flatnonzero(self.fixed_top1 >= self.target)
        if ok.size == 0:
            return None
        means = self.fixed_tbt_us.mean(axis=1)
        return int(ok[np.argmin(means[ok])])

    def summary(self) -> dict[str, Any]:
        """Return the headline numbers as plain JSON values."""
        best = self.best_fixed()
        fixed = None if best is None else float(self.fixed_tbt_us[best].mean())
        cons = float(self.constrained_tbt_us.mean())
        return {
            "target": self.target,
            "decode_steps": int(self.constrained_tbt_us.size),
            "constrained_tbt_us": cons, "constrained_top1": self.constrained_top1,
            "unconstrained_tbt_us": float(self.unconstrained_tbt_us.mean()),
            "unconstrained_top1": self.unconstrained_top1,
            "best_fixed": None if best is None else self.points[best].to_dict(),
            "best_fixed_tbt_us": fixed,
            "best_fixed_top1": None if best is None else float(self.fixed_top1[best]),
            "constrained_over_best_fixed": None if fixed is None else cons / fixed,
            "unconstrained_over_best_fixed": (None if fixed is None else
                                              float(self.unconstrained_tbt_us.mean()) / fixed),
            "fixed": [{"knobs": p.to_dict(), "tbt_us": float(self.fixed_tbt_us[i].mean()),
                       "top1_retention": float(self.fixed_top1[i]),
                       "oracle_choices": int(self.choices[i]) if self.choices.size else 0}
                      for i, p in enumerate(self.points)],
        }


def balanced_replica_fractions(token_sets: np.ndarray, P: np.ndarray, replicas: np.ndarray
                               ) -> np.ndarray:
    """Per-copy fractions of the replicated experts that minimise the busiest node's tokens.

    The hindsight split of one layer's redundant experts (the ``shares`` replica rule of
    ``dispatch.dispatch_replicas``), from the layer's executed expert sets: a linear program
    over y_ej ≥ 0, the tokens of replicated expert e sent to copy j (copy 0 the primary group,
    its tokens counted on node c with weight P_ec; copy j ≥ 1 a whole replica node), with
    Σ_j y_ej = n_e, minimising T subject to, on every node c,
    Σ_{e not replicated} P_ec·n_e + Σ_e (y_e0·P_ec + y_e,c) ≤ T. Fluid token counts: the work
    per (token, expert) is the same for every expert of a layer, and the tile model's padding,
    weight streaming and the NoC are not in the objective (the DES measures the result).
    Experts without tokens, without replicas, or with an all-zero row of ``P`` (pre-broadcast)
    keep fraction 1 on the primary.

    Args:
        token_sets: int [B, k] expert sets of the layer.
        P: float [E, D] shares of the layer.
        replicas: bool [E, D] replica mask of the layer.

    Returns:
        float [E, 1 + D]: column 0 the primary's fraction, column 1 + c the replica on node c.

    Raises:
        DependencyNotInstalled: scipy (the ``opt`` extra) is missing.
        ConfigError: Bad shapes.
    """
    from hdamoe_env.decisions.dispatch import replica_inputs

    sets, shares, reps = replica_inputs(token_sets, P, replicas, "balanced_replica_fractions")
    E, D = shares.shape
    counts = np.bincount(sets.ravel(), minlength=E)[:E].astype(np.float64)
    out = np.zeros((E, 1 + D))
    out[:, 0] = 1.0
    movable = [e for e in range(E) if counts[e] > 0 and reps[e].any() and shares[e].sum() > 0]
    if not movable:
        return out
    try:
        from scipy.optimize import linprog
    except ImportError as exc:                                  # pragma: no cover - extra
        raise DependencyNotInstalled(f"the LP replica shares need scipy: {_EXTRA}") from exc
    fixed = np.ones(E, dtype=bool)
    fixed[movable] = False
    base = (shares[fixed] * counts[fixed, None]).sum(axis=0)          # [D]
    columns: list[tuple[int, int]] = []                                # (expert, copy column)
    for e in movable:
        columns.append((e, 0))
        columns.extend((e, 1 + int(c)) for c in np.flatnonzero(reps[e]))
    n_var = len(columns) + 1                                           # + T
    a_ub = np.zeros((D, n_var))
    a_eq = np.zeros((len(movable), n_var))
    row = {e: i for i, e in enumerate(movable)}
    for j, (e, col) in enumerate(columns):
        if col == 0:
            a_ub[:, j] = shares[e]
        else:
            a_ub[col - 1, j] = 1.0
        a_eq[row[e], j] = 1.0
    a_ub[:, -1] = -1.0
    cost = np.zeros(n_var)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=-base, A_eq=a_eq, b_eq=counts[movable],
                  bounds=[(0, None)] * n_var, method="highs")
    if res.status != 0:                                                # pragma: no cover
        raise ConfigError(f"the replica-share LP failed ({res.message}); please report it")
    y = np.maximum(res.x[:-1], 0.0)
    for j, (e, col) in enumerate(columns):
        out[e, col] = y[j] / counts[e]
    return out


class _LayerTap:
    """Stand-in for an env's ``decisions`` that reports every evaluated layer, then delegates."""

    def __init__(self, inner: Any, on_layer: Callable[..., None]) -> None:
        """Wrap ``inner``; ``on_layer(layer, token_sets, kwargs)`` runs before each evaluation."""
        self._inner = inner
        self._on_layer = on_layer

    def evaluate(self, layer: int, token_sets: np.ndarray, **kwargs: Any) -> Any:
        self._on_layer(layer, token_sets, kwargs)
        return self._inner.evaluate(layer, token_sets, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def per_layer_oracle(env_kwargs: dict[str, Any], points: Iterable[TunedKnobs],
                     seeds: Sequence[int], *, target: float = DEFAULT_QUALITY_TARGET,
                     lp_shares: bool = True) -> OracleResult:
    """Compute the per-layer hindsight oracle over ``points`` on the seeds' episodes.

    A driver env (``env_kwargs``, gating at the default level, no broadcast) forms the decode
    steps, the observations and the router candidates; its layer evaluations are tapped, and
    for each one every point's action is evaluated with the point's own env's
    ``DecisionEvaluator`` (its ``protect_top``) and k_b, on one generator per (seed, decode
    step, layer). See :class:`OracleResult` for what the result bounds.

    With a placement that has redundant experts, each point runs its own replica rule, and
    (``lp_shares``) every point also gets an :data:`LP_SHARES` twin: the same action with the
    replicated experts' tokens split per layer by :func:`balanced_replica_fractions` of the
    layer's executed sets, the hindsight optimum of the share action
    (``hdamoe_env.env.wrappers.ReplicaSharesWrapper``) for the busiest node's token count.

    Args:
        env_kwargs: ``HdMoeEnv`` keyword arguments of the cell (loaded trace and placement
            recommended).
        points: Knob points (e.g. ``KnobGrid.points()``).
        seeds: Episode seeds (held-out ones for a held-out bound).
        target: Per-layer top-1 retention target of the constrained oracle.
        lp_shares: Add the :data:`LP_SHARES` twin of every point (placements with replicas).

    Raises:
        ConfigError: No points or no seeds.
    """
    from hdamoe_env.env.environment import HdMoeEnv

    pts = tuple(points)
    if not pts or not seeds:
        raise ConfigError("per_layer_oracle needs at least one point and one seed")
    base = dict(env_kwargs)
    driver = HdMoeEnv(**{**base, "gating_levels": (0.0, 1.0)})
    has_replicas = bool(driver.replica_rules)
    if has_replicas and lp_shares:
        have = {p.key() for p in pts}
        twins: dict[str, TunedKnobs] = {}
        for p in pts:                                  # one twin per point up to its rule
            q = dataclasses.replace(p, replica_rule=LP_SHARES)
            if q.key() not in have:
                twins.setdefault(q.key(), q)
        pts = pts + tuple(twins.values())
    envs: dict[str, Any] = {}
    knob_envs, policies = [], []
    for p in pts:
        kw = p.env_kwargs()
        key = json.dumps({k: kw[k] for k in sorted(kw)}, default=str)
        if key not in envs:
            envs[key] = HdMoeEnv(**{**base, **kw})
        knob_envs.append(envs[key])
        policies.append(p.make_agent(envs[key]))
    dense_s = float(driver.sim.dense_time(driver.batch))
    E, mb = driver.num_experts, driver.max_broadcast
    K = len(pts)
    step_lat: list[np.ndarray] = []     # [K, L] per decode step
    step_top1: list[np.ndarray] = []
    cur_lat = np.zeros((K, driver.num_layers))
    cur_top1 = np.ones((K, driver.num_layers))
    state: dict[str, Any] = {"obs": None, "seed": 0, "step": 0}

    def on_layer(layer: int, token_sets: np.ndarray, kw: dict[str, Any]) -> None:
        obs = state["obs"]
        rng_key = (int(state["seed"]), int(state["step"]), int(layer))
        cache: dict[tuple[Any, ...], tuple[float, float]] = {}
        for i, (env_i, agent) in enumerate(zip(knob_envs, policies, strict=True)):
            replica_rule = pts[i].replica_rule or (env_i.replica_rules[0] if has_replicas
                                                   else "least_loaded")
            kb = int(env_i.k_b[layer])
            frac = min(1.0, kb / env_i.max_broadcast) if env_i.max_broadcast else 0.0
            o = dict(obs, budget=np.array([frac], dtype=np.float32))
            action, _ = agent.predict(o, deterministic=True)
            a = np.asarray(action).tolist()
            bc: list[int] = []
            for v in a[:mb]:
                if v < E and v not in bc:
                    bc.append(int(v))
            lay = agent.layout
            rule = lay.dispatch_rules[a[lay.rule_slot]] if bc else "least_loaded"
            level = float(lay.gating_levels[a[lay.level_slot]])
            ckey = (id(env_i.decisions), tuple(bc), rule, level, replica_rule)
            hit = cache.get(ckey)
            if hit is None:
                candidates = kw.get("candidates") if level > 0 else None
                run_rule, fr = replica_rule, None
                if replica_rule == LP_SHARES:            # the LP on the sets the layer executes
                    executed = (token_sets if candidates is None else
                                env_i.decisions.gate(layer, candidates, level).sets)
                    P_layer = np.array(env_i.placement.P[layer], dtype=np.float64)
                    P_layer[bc] = 0.0                    # broadcast experts: not split by shares
                    fr = balanced_replica_fractions(executed, P_layer,
                                                    env_i.placement.replicas[layer])
                    run_rule = "shares"
                out = env_i.decisions.evaluate(
                    layer, token_sets, rng=np.random.default_rng(rng_key), broadcast=bc,
                    dispatch_rule=rule, gating_level=level, candidates=candidates,
                    fidelity=kw.get("fidelity", "des"), gamma=kw.get("gamma"),
                    replica_rule=run_rule, replica_fractions=fr)
                q = 1.0 if out.gating is None else float(out.gating.top1_retention)
                hit = cache[ckey] = (float(out.result.total_s), q)
            cur_lat[i, layer], cur_top1[i, layer] = hit

    driver.decisions = _LayerTap(driver.decisions, on_layer)
    driver_agent = HardwareAwareGatingAgent.from_env(driver, level=1.0)
    for seed in seeds:
        obs, _ = driver.reset(seed=int(seed))
        state.update(seed=int(seed), step=0)
        done = False
        while not done:
            state["obs"] = obs
            action, _ = driver_agent.predict(obs, deterministic=True)
            obs, _r, terminated, truncated, info = driver.step(action)
            done = bool(terminated or truncated)
            if "tbt_us" in info:
                step_lat.append(cur_lat.copy())
                step_top1.append(cur_top1.copy())
                state["step"] += 1
    lat = np.stack(step_lat)            # [S, K, L]
    top1 = np.stack(step_top1)
    fixed = (lat.sum(axis=2) + dense_s).T * 1e6                    # [K, S]
    ok = top1 >= target
    masked = np.where(ok, lat, np.inf)
    pick = masked.argmin(axis=1)                                    # [S, L]
    if not np.isfinite(np.take_along_axis(masked, pick[:, None, :], axis=1)).all():
        raise ConfigError("some layer has no grid point meeting the quality target; include "
                          "gating level 0 in the grid")
    cons = np.take_along_axis(lat, pick[:, None, :], axis=1)[:, 0, :]
    cons_q = np.take_along_axis(top1, pick[:, None, :], axis=1)[:, 0, :]
    upick = lat.argmin(axis=1)
    uncons = np.take_along_axis(lat, upick[:, None, :], axis=1)[:, 0, :]
    uncons_q = np.take_along_axis(top1, upick[:, None, :], axis=1)[:, 0, :]
    return OracleResult(
        points=pts, fixed_tbt_us=fixed, fixed_top1=top1.mean(axis=(0, 2)),
        constrained_tbt_us=(cons.sum(axis=1) + dense_s) * 1e6,
        constrained_top1=float(cons_q.mean()),
        unconstrained_tbt_us=(uncons.sum(axis=1) + dense_s) * 1e6,
        unconstrained_top1=float(uncons_q.mean()), target=float(target),
        choices=np.bincount(pick.ravel(), minlength=K).astype(np.int64))


def run_key_of(payload: dict[str, Any]) -> str:
    """Return a short stable hash of a configuration payload (the journal's run key)."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
