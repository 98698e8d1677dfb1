"""Search of the tuned heuristic: the knob grid under a model-quality constraint, and its files.

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
* :func:`write_tuned` / :func:`load_tuned` write and read ``tuned.json`` (the best knobs, the
  training and held-out measurements, every point); :func:`run_key_of` is the journal's run key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agents.tuned.knobs import DEFAULT_DISPATCH_OFFER, KnobGrid, TunedKnobs
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, OutputPathError
from hdamoe_env.config.fileio import atomic_write, json_default, write_json

__all__ = [
    "DEFAULT_PENALTY",
    "DEFAULT_QUALITY_TARGET",
    "SEARCH_METHODS",
    "TUNED_FORMAT",
    "EpisodeEvaluator",
    "Measurement",
    "PointRecord",
    "TuneResult",
    "load_tuned",
    "penalised_objective",
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
#: ``tuned.json`` format tag.
TUNED_FORMAT = "hdamoe-tuned/1"

OPT_INSTALL_HINT = 'pip install -c constraints.txt "hdamoe-env[opt]"'


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
            knobs = dataclasses.replace(knobs, dispatch_rule=DEFAULT_DISPATCH_OFFER[0])
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
                                     f"scikit-optimize; run `{OPT_INSTALL_HINT}` or use method='grid'"
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



def run_key_of(payload: dict[str, Any]) -> str:
    """Return a short stable hash of a configuration payload (the journal's run key)."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
