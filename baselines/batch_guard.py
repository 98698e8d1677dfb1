"""The batch guard: each layer of an optimised placement re-checked at the batch it runs at.

The offline pipeline (``baselines.pipeline_layer``, guard ``best``) optimises every layer at one
batch (``place_batch``, 128 by default) and keeps it no slower than any baseline its search
contains *at that batch*. A placement that is best at B = 128 can lose at B = 16 (tile padding,
a different compute/communication mix): the pipeline's guard says nothing there. This module
re-runs the selection, cheaply, at the batch of the evaluation:

* **Candidates** per layer: the baselines the search space contains — TP, tile-aligned TP, EP
  and the compute-balanced hybrid, exactly the placements the benchmark evaluates under those
  names — and the optimised layers: the pipeline's guarded Node+Link layer (optimised at
  ``place_batch``, ``node-link@B<place_batch>``) and the raw Node + Link Balance layer
  (``nb-lb``).
* **Scoring**: :class:`baselines.node_balance.local_search.LayerScorer` (the evaluator's own
  cost, t_comp + t_comm_moe) on :attr:`BatchGuardSpec.steps` decode steps of ``batch`` rows
  drawn from the trace the placement was optimised on, with the guard's own seed — never the
  benchmark's evaluation episodes — and one aggregator stream per step shared by every
  candidate (common random numbers, so differences are paired).
* **Selection, ties and noise** [decision]: the best baseline b* (ties: the order of
  :data:`BASELINES`) is kept unless the best optimised layer o* is faster by more than *both*
  ``margin`` (relative, of b*'s cost) and ``z`` standard errors of the per-step paired
  differences cost(b*) − cost(o*). A baseline therefore wins every tie and every gain that the
  scored steps cannot tell from noise; an optimised layer must earn its place.

The result is a :class:`~hdamoe_env.sim.placement.Placement` (``method`` ``node_link``) whose
``meta["batch_guard"]`` records, per layer, every candidate's cost under its method name
(``method_costs_us``, µs, like the pipeline's) and the winner (``winner``), plus the rule and
its parameters. :func:`guarded_placement` caches it as one ``.npz`` per (placement, batch,
guard) so that the cells of a grid share it.

Determinism: the steps and aggregator streams of layer l come from
``SeedSequence([spec.seed, GUARD_STREAM]).spawn(L)[l]``; the same inputs give the same
placement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from baselines.node_balance.local_search import LayerScorer, sample_steps
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.sim.placement import Placement

if TYPE_CHECKING:
    from hdamoe_env.sim.simulator import MoESimulator

__all__ = ["BASELINES", "GUARD_FORMAT", "BatchGuardSpec", "batch_guard", "guard_summary",
           "guarded_placement"]

log = logging.getLogger(__name__)

#: Bumped when the selection rule or the meaning of the artifact changes (invalidates caches).
GUARD_FORMAT = 1
#: The baselines the optimiser's search space contains, in tie order.
BASELINES = ("tp", "tp-tiled", "ep", "hybrid")
#: Entropy word that separates the guard's streams from the pipeline's ("guard").
GUARD_STREAM = 0x6775617264


@dataclass(frozen=True)
class BatchGuardSpec:
    """The batch guard's budget and selection rule (module docstring).

    Attributes:
        steps: Sampled decode steps every candidate is scored on (≥ 2: the rule needs a
            standard error).
        margin: Relative gain over the best baseline an optimised layer must exceed
            [decision, 0.5 %: the size of the differences between the pipeline's
            candidates that 16 steps resolve (module docstring)].
        z: Standard errors of the paired per-step differences the gain must exceed
            [decision: 2, about a one-sided 97.7 % test under normal noise].
        seed: Seed of the sampled steps and aggregator streams.
    """

    steps: int = 16
    margin: float = 0.005
    z: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise ConfigError(f"batch guard steps must be an integer >= 2, got {self.steps!r}")
        if not (0.0 <= self.margin < 1.0) or not np.isfinite(self.margin):
            raise ConfigError(f"batch guard margin must be in [0, 1), got {self.margin!r}")
        if not (self.z >= 0.0) or not np.isfinite(self.z):
            raise ConfigError(f"batch guard z must be >= 0, got {self.z!r}")


def _layer_arrays(pl: Placement, layer: int) -> tuple[NDArray[np.float64], NDArray[np.int64],
                                                       bool]:
    red = bool(pl.allreduce[layer]) if pl.allreduce is not None else False
    return pl.P[layer], pl.pi[layer], red


def batch_guard(sim: MoESimulator, baselines: Mapping[str, Placement],
                optimised: Mapping[str, Placement],
                layer_rows: Callable[[int], NDArray[np.int64]], batch: int,
                spec: BatchGuardSpec = BatchGuardSpec()) -> Placement:
    """Select, per layer, the best of the baselines and the optimised layers at ``batch``.

    Args:
        sim: The simulator of the evaluation (model, hardware, topology, profile).
        baselines: Placement per baseline name (keys from :data:`BASELINES`, tie order).
        optimised: Optimised placements by method name (e.g. ``node-link@B128``, ``nb-lb``).
        layer_rows: ``layer -> int [N, k]`` the expert sets of the trace the placements were
            optimised on (the rows the guard samples its steps from).
        batch: Tokens per decode step B of the evaluation.
        spec: Budget and rule.

    Returns:
        The guarded placement (``method="node_link"``); ``meta["batch_guard"]`` holds the rule,
        ``method_costs_us`` per layer and method (``total_us``, ``compute_us``, ``comm_us``,
        ``std_us`` over the steps; ``node-link`` = the chosen layer) and ``winner`` per layer.

    Raises:
        ConfigError: No baseline or no optimised placement, unknown baseline names, or
            placements of different shapes.
    """
    if not baselines or not optimised:
        raise ConfigError("the batch guard needs at least one baseline and one optimised "
                          "placement")
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ConfigError(f"batch guard baselines {unknown}; expected names from {BASELINES}")
    names_b = [b for b in BASELINES if b in baselines]
    cands = {**{b: baselines[b] for b in names_b}, **dict(optimised)}
    shapes = {pl.P.shape for pl in cands.values()}
    if len(shapes) != 1:
        raise ConfigError(f"batch guard candidates have different shapes {sorted(shapes)}")
    L, E, D = next(iter(shapes))
    t0 = time.perf_counter()
    P = np.empty((L, E, D))
    pi = np.empty((L, D), dtype=np.int64)
    red = np.zeros(L, dtype=bool)
    costs: dict[str, dict[str, Any]] = {}
    winners: dict[str, str] = {}
    streams = np.random.SeedSequence([spec.seed, GUARD_STREAM]).spawn(L)
    for layer in range(L):
        s_steps, s_agg = streams[layer].spawn(2)
        steps = sample_steps(layer_rows(layer), batch, spec.steps,
                             np.random.default_rng(s_steps))
        scorer = LayerScorer(sim, layer, steps, s_agg)
        per_step: dict[str, NDArray[np.float64]] = {}
        layer_costs: dict[str, Any] = {}
        seen: dict[bytes, str] = {}
        for name, pl in cands.items():
            P_l, pi_l, red_l = _layer_arrays(pl, layer)
            key = P_l.tobytes() + pi_l.tobytes() + bytes([red_l])
            if key in seen:                         # the same layer: the same cost
                per_step[name] = per_step[seen[key]]
                layer_costs[name] = dict(layer_costs[seen[key]], same_as=seen[key])
                continue
            seen[key] = name
            comp, comm, mode = scorer.step_terms(P_l, pi_l, red_l)
            total = (comp + comm) * 1e6
            per_step[name] = total
            layer_costs[name] = {"total_us": float(total.mean()),
                                 "compute_us": float(comp.mean() * 1e6),
                                 "comm_us": float(comm.mean() * 1e6),
                                 "std_us": float(total.std(ddof=1)), "mode": mode}
        best_b = min(names_b, key=lambda n: per_step[n].mean())
        best_o = min(optimised, key=lambda n: per_step[n].mean())
        diff = per_step[best_b] - per_step[best_o]
        gain = float(diff.mean())
        se = float(diff.std(ddof=1) / np.sqrt(diff.size))
        base = float(per_step[best_b].mean())
        take = gain > spec.margin * base and gain > spec.z * se
        winner = best_o if take else best_b
        P[layer], pi[layer], red[layer] = _layer_arrays(cands[winner], layer)
        layer_costs["node-link"] = dict(layer_costs[winner], chosen=winner)
        layer_costs["decision"] = {"best_baseline": best_b, "best_optimised": best_o,
                                   "gain_us": gain, "se_us": se,
                                   "margin_us": spec.margin * base}
        costs[str(layer)] = layer_costs
        winners[str(layer)] = winner
    meta = {"batch_guard": {
        "format": GUARD_FORMAT, "batch": int(batch), **asdict(spec),
        "rule": (f"keep the best of {list(names_b)} unless the best of {list(optimised)} is "
                 f"faster by more than {spec.margin:.2%} and {spec.z:g} standard errors of the "
                 f"paired per-step differences on {spec.steps} sampled steps"),
        "method_costs_us": costs, "winner": winners,
        "winner_counts": guard_summary(winners), "wall_s": time.perf_counter() - t0}}
    return Placement(P=P, pi=pi, method="node_link", meta=meta,
                     allreduce=red if red.any() else None)


def guard_summary(winners: Mapping[str, str]) -> dict[str, int]:
    """Count the layers each method won (most first, then name)."""
    counts: dict[str, int] = {}
    for name in winners.values():
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def guard_key(payload: Mapping[str, Any]) -> str:
    """Return a 16-hex-digit key of everything a guarded placement depends on."""
    blob = json.dumps({"format": GUARD_FORMAT, **payload}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def guarded_placement(path: Path, key: str, build: Callable[[], Placement]) -> Placement:
    """Return the guarded placement cached at ``path`` under ``key``, or build and cache it.

    A file whose recorded key differs (another guard, another placement) is rebuilt; the
    write is atomic, so concurrent builders of the same file leave one complete copy.
    """
    if path.exists():
        try:
            cached = Placement.load(path)
        except ConfigError as exc:
            log.warning("batch guard cache %s is unreadable (%s); rebuilding it", path, exc)
        else:
            if cached.meta.get("batch_guard", {}).get("key") == key:
                return cached
    placement = build()
    placement.meta["batch_guard"]["key"] = key
    path.parent.mkdir(parents=True, exist_ok=True)
    placement.save(path)
    return placement
