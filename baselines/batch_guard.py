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
  cost, t_comp + t_comm_moe) on :meth:`BatchGuardSpec.steps_for` independent decode steps of
  ``batch`` rows, each formed as the env forms its steps (B request streams at random
  positions, :func:`guard_steps`) from the trace the placement was optimised on, with the
  guard's own seed — never the benchmark's evaluation episodes — and one aggregator stream per
  step shared by every candidate (common random numbers, so differences are paired).
* **Selection, ties and noise** [decision]: every layer starts from one *default*, the
  baseline with the lowest cost summed over all layers (ties: the order of
  :data:`BASELINES`); a layer takes another candidate (another baseline or an optimised layer)
  only when that candidate beats the default's layer by more than *both* ``margin`` (relative,
  of the default's cost) and ``z`` standard errors of the per-step paired differences. Ties
  and gains the scored steps cannot tell from noise therefore keep one whole baseline (which
  the benchmark then measures exactly as that baseline), and a layer-by-layer mix of baselines
  or an optimised layer must earn its place.

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

from baselines.node_balance.local_search import LayerScorer
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.sim.placement import Placement

if TYPE_CHECKING:
    from hdamoe_env.sim.simulator import MoESimulator

__all__ = ["BASELINES", "GUARD_FORMAT", "BatchGuardSpec", "batch_guard", "guard_key",
           "guard_steps", "guard_summary", "guarded_placement"]

log = logging.getLogger(__name__)

#: Bumped when the selection rule or the meaning of the artifact changes (invalidates caches).
GUARD_FORMAT = 2
#: The baselines the optimiser's search space contains, in tie order.
BASELINES = ("tp", "tp-tiled", "ep", "hybrid")
#: Entropy word that separates the guard's streams from the pipeline's ("guard").
GUARD_STREAM = 0x6775617264


@dataclass(frozen=True)
class BatchGuardSpec:
    """The batch guard's budget and selection rule (module docstring).

    Attributes:
        steps: Sampled decode steps every candidate is scored on at B ≥ ``min_tokens`` /
            ``steps`` (≥ 2: the rule needs a standard error); smaller batches get more steps
            (:meth:`steps_for`).
        min_tokens: Tokens the scored steps hold at least, up to ``max_steps`` steps
            [decision, 1024: at B = 16 a tile boundary crossed by one expert's token count
            (9 of 16 tokens on one node doubles its tile-padded compute) happens in a few
            percent of steps; 16 steps missed it in Mixtral layer 3 and picked EP there,
            which then lost 0.1 % of TBT on the benchmark's episodes; 64 steps (1024 tokens)
            keep TP in every layer under two guard seeds].
        max_steps: Upper bound of :meth:`steps_for` (bounds the cost at B = 1 … 8).
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
    min_tokens: int = 1024
    max_steps: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise ConfigError(f"batch guard steps must be an integer >= 2, got {self.steps!r}")
        for name in ("min_tokens", "max_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"batch guard {name} must be an integer >= 0, got {value!r}")
        if self.max_steps < self.steps:
            raise ConfigError(f"batch guard max_steps={self.max_steps} is below steps="
                              f"{self.steps}; raise max_steps or lower steps")
        if not (0.0 <= self.margin < 1.0) or not np.isfinite(self.margin):
            raise ConfigError(f"batch guard margin must be in [0, 1), got {self.margin!r}")
        if not (self.z >= 0.0) or not np.isfinite(self.z):
            raise ConfigError(f"batch guard z must be >= 0, got {self.z!r}")


    def steps_for(self, batch: int) -> int:
        """Scored steps at ``batch``: ``steps``, raised to hold ``min_tokens`` tokens, at most
        ``max_steps`` (64 at B = 16, 32 at B = 32, 16 from B = 64 with the defaults)."""
        need = -(-self.min_tokens // max(int(batch), 1))
        return int(min(self.max_steps, max(self.steps, need)))


def _layer_arrays(pl: Placement, layer: int) -> tuple[NDArray[np.float64], NDArray[np.int64],
                                                       bool]:
    red = bool(pl.allreduce[layer]) if pl.allreduce is not None else False
    return pl.P[layer], pl.pi[layer], red


def guard_steps(trace: Any, batch: int, steps: int, rng: np.random.Generator, *,
                view: str = "content") -> NDArray[np.int64]:
    """Draw ``steps`` independent decode steps of ``batch`` trace rows, as the env forms them.

    Each step is the first step of its own request streams (``traces.batching.streams``: B
    requests from a seeded permutation, each at a uniform position), so a step has the env's
    composition (B distinct requests where the trace has them) and the steps are independent
    (the guard's standard errors assume it).

    Returns:
        int64 [S, B] row indices of ``trace``.
    """
    from traces import batching

    return np.stack([next(iter(batching.streams(trace, batch, rng, n_steps=1, view=view)))
                     for _ in range(steps)]).astype(np.int64)


def batch_guard(sim: MoESimulator, baselines: Mapping[str, Placement],
                optimised: Mapping[str, Placement], trace: Any, batch: int,
                spec: BatchGuardSpec = BatchGuardSpec(), *, view: str = "content") -> Placement:
    """Select, per layer, the best of the baselines and the optimised layers at ``batch``.

    Rule (module docstring): the default of every layer is the baseline with the lowest summed
    cost over all layers (ties: the order of :data:`BASELINES`); a layer takes the fastest
    other candidate instead only when it beats the default's layer by more than
    ``spec.margin`` and ``spec.z`` paired standard errors.

    Args:
        sim: The simulator of the evaluation (model, hardware, topology, profile).
        baselines: Placement per baseline name (keys from :data:`BASELINES`).
        optimised: Optimised placements by method name (e.g. ``node-link@B128``, ``nb-lb``).
        trace: The trace the placements were optimised on (``RoutingTrace``); the guard's
            steps are drawn from it (:func:`guard_steps`).
        batch: Tokens per decode step B of the evaluation.
        spec: Budget and rule.
        view: Row view of the trace.

    Returns:
        The guarded placement (``method="node_link"``); ``meta["batch_guard"]`` holds the rule,
        ``method_costs_us`` per layer and method (``total_us``, ``compute_us``, ``comm_us``,
        ``std_us`` over the steps; ``node-link`` = the chosen layer; ``decision``: the default,
        the best challenger, gain, standard error and margin in µs) and ``winner`` per layer.

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
    streams = np.random.SeedSequence([spec.seed, GUARD_STREAM]).spawn(L + 1)
    n_steps = spec.steps_for(batch)
    rows = guard_steps(trace, batch, n_steps, np.random.default_rng(streams[L]), view=view)
    per_step: list[dict[str, NDArray[np.float64]]] = []
    costs: dict[str, dict[str, Any]] = {}
    for layer in range(L):
        sets = np.asarray(trace.topk_ids[layer][rows], dtype=np.int64)       # [S, B, k]
        scorer = LayerScorer(sim, layer, sets, streams[layer])
        layer_steps: dict[str, NDArray[np.float64]] = {}
        layer_costs: dict[str, Any] = {}
        seen: dict[bytes, str] = {}
        for name, pl in cands.items():
            P_l, pi_l, red_l = _layer_arrays(pl, layer)
            key = P_l.tobytes() + pi_l.tobytes() + bytes([red_l])
            if key in seen:                         # the same layer: the same cost
                layer_steps[name] = layer_steps[seen[key]]
                layer_costs[name] = dict(layer_costs[seen[key]], same_as=seen[key])
                continue
            seen[key] = name
            comp, comm, mode = scorer.step_terms(P_l, pi_l, red_l)
            total = (comp + comm) * 1e6
            layer_steps[name] = total
            layer_costs[name] = {"total_us": float(total.mean()),
                                 "compute_us": float(comp.mean() * 1e6),
                                 "comm_us": float(comm.mean() * 1e6),
                                 "std_us": float(total.std(ddof=1)), "mode": mode}
        per_step.append(layer_steps)
        costs[str(layer)] = layer_costs
    default = min(names_b, key=lambda n: sum(float(st[n].mean()) for st in per_step))
    P = np.empty((L, E, D))
    pi = np.empty((L, D), dtype=np.int64)
    red = np.zeros(L, dtype=bool)
    winners: dict[str, str] = {}
    for layer, layer_steps in enumerate(per_step):
        challenger = min((n for n in cands if n != default),
                         key=lambda n: layer_steps[n].mean(), default=default)
        diff = layer_steps[default] - layer_steps[challenger]
        gain = float(diff.mean())
        se = float(diff.std(ddof=1) / np.sqrt(diff.size))
        base = float(layer_steps[default].mean())
        winner = challenger if (gain > spec.margin * base and gain > spec.z * se) else default
        P[layer], pi[layer], red[layer] = _layer_arrays(cands[winner], layer)
        layer_costs = costs[str(layer)]
        layer_costs["node-link"] = dict(layer_costs[winner], chosen=winner)
        layer_costs["decision"] = {"default": default, "challenger": challenger,
                                   "gain_us": gain, "se_us": se,
                                   "margin_us": spec.margin * base}
        winners[str(layer)] = winner
    meta = {"batch_guard": {
        "format": GUARD_FORMAT, "batch": int(batch), **asdict(spec), "scored_steps": n_steps,
        "default": default,
        "rule": (f"every layer keeps the baseline of {list(names_b)} with the lowest summed "
                 f"cost ({default}) unless another candidate ({list(cands)}) is faster in "
                 f"that layer by more than {spec.margin:.2%} and {spec.z:g} standard errors "
                 f"of the paired per-step differences on {n_steps} sampled steps"),
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
