"""Tile-aware local search of one layer's shares on the evaluator's own cost (issue: fair NB).

Node Balance's MILP and heuristic optimise the fluid compute model of §7 (Eq. 1 with γ·Eq. 2);
the ``faithful`` evaluator charges the tile model of docs/PHYSICS.md instead: every shard runs m
GEMMs of ceil(tokens/T_tok)·T_tok × ceil(columns/T_col)·T_col plus a fixed overhead per GEMM,
the expert phase is the slowest node (with weight streaming), and the layer's communication is
TP's all-reduce (uniform TP and tile-aligned TP, ``Placement.allreduce``) or the dispatch/combine
DES of the layer's support. This module closes that gap in two steps:

1. :class:`LayerScorer` scores candidate placements of one layer with the evaluator itself
   (``LayerEvaluator.evaluate``, the sampled evaluator of §5.7) on a fixed set of sampled decode
   steps, with one aggregator stream per step shared by every candidate (common random
   numbers): cost = mean over the steps of t_comp + t_comm_moe, the MoE latency of the layer.
2. :func:`tile_local_search` moves whole tiles (one share unit u = 1/U) of one expert from one
   node to another while the mean expert phase over the scored steps improves. Its moves never
   change what the communication costs: in an all-reduce layer any node may take a tile (the
   all-reduce does not depend on the shares), in a sharded layer a tile only moves between two
   nodes that both keep a shard of the expert (the DES depends on the support, the mapping and
   the aggregators, not on the shares). The search therefore evaluates the exact change of the
   evaluator's cost from the compute terms alone, quickly.

The pipeline (``baselines.pipeline_layer``) warm-starts the search from the best-scored of
{Node Balance + Link Balance, TP, tile-aligned TP, EP, hybrid}, runs Link Balance on the result
when its mapping was not optimised for its support, and re-scores the end result: the layer is
never slower on the scored steps than any of the candidates (the search only accepts
improvements, and the final re-score keeps the warm start on a tie or float noise).

Determinism: the scored steps and aggregator streams come from the caller's seed; the search is
a deterministic best-improvement descent with a move budget (no wall-clock limit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.cost import perf
from hdamoe_env.sim.evaluator import LayerEvaluator, LayerResult
from hdamoe_env.sim.placement import Placement, identity_mapping, tensor_parallel

if TYPE_CHECKING:
    from hdamoe_env.sim.energy import EnergyAccount
    from hdamoe_env.sim.simulator import MoESimulator

__all__ = ["LayerScorer", "LocalSearchResult", "ScoredMapping", "sample_steps",
           "tile_local_search"]


def sample_steps(rows: NDArray[np.int64], batch: int, steps: int, rng: np.random.Generator
                 ) -> NDArray[np.int64]:
    """Draw ``steps`` decode steps of ``batch`` trace rows each (without replacement per step).

    Args:
        rows: int [N, k] the layer's expert sets of the trace view.
        batch: Tokens per step B.
        steps: Number of steps S.
        rng: The caller's generator.

    Returns:
        int64 [S, B, k].

    Raises:
        ConfigError: No rows, or ``steps`` < 1.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[0] == 0:
        raise ConfigError(f"sample_steps needs trace rows [N, k] with N >= 1, got {rows.shape}")
    if steps < 1:
        raise ConfigError(f"score steps must be >= 1, got {steps}")
    replace = rows.shape[0] < batch
    return np.stack([rows[rng.choice(rows.shape[0], size=batch, replace=replace)]
                     for _ in range(steps)])


class LayerScorer:
    """Score placements of one layer on fixed sampled decode steps with the evaluator (§5.7).

    Args:
        sim: The simulator.
        layer: MoE layer index.
        step_sets: int64 [S, B, k] the scored steps (:func:`sample_steps`).
        seed: Seed of the per-step aggregator streams (one child per step, shared by every
            candidate: common random numbers).
    """

    def __init__(self, sim: MoESimulator, layer: int, step_sets: NDArray[np.int64],
                 seed: int | np.random.SeedSequence) -> None:
        self.sim = sim
        self.layer = int(layer)
        self.step_sets = np.asarray(step_sets, dtype=np.int64)
        ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        self._agg_seeds = ss.spawn(self.step_sets.shape[0])
        self.batch = int(self.step_sets.shape[1])

    def placement(self, P_layer: NDArray[np.float64], pi_layer: NDArray[np.int64],
                  allreduce: bool = False) -> Placement:
        """Wrap one layer's arrays in a placement of ``layer + 1`` layers (the others TP)."""
        E, D = P_layer.shape
        P = np.full((self.layer + 1, E, D), 1.0 / D)
        P[self.layer] = P_layer
        pi = identity_mapping(self.layer + 1, D)
        pi[self.layer] = pi_layer
        red = np.zeros(self.layer + 1, dtype=bool)
        red[self.layer] = allreduce
        return Placement(P=P, pi=pi, method="scored", allreduce=red)

    def score(self, P_layer: NDArray[np.float64], pi_layer: NDArray[np.int64],
              allreduce: bool = False, *, account: EnergyAccount | None = None
              ) -> dict[str, Any]:
        """Return the mean over the scored steps of the layer's terms, in µs.

        Args:
            P_layer: float [E, D] the layer's shares.
            pi_layer: int [D] its mapping.
            allreduce: The layer is a tile-aligned TP (all-reduce) layer.
            account: With an energy account (``MoESimulator.energy_account(B)``), the layer's
                energy too (docs/PHYSICS.md §18), from the same evaluations.

        Returns:
            ``total_us`` (t_comp + t_comm_moe, the MoE latency), ``compute_us`` (t_comp),
            ``comm_us`` (t_comm_moe) and ``mode`` of the first step (``"tp"`` or ``"des"``);
            with ``account`` also ``energy_uj`` (mean energy of the whole layer: expert phase,
            MoE communication, its non-MoE term, static power over the layer's time),
            ``energy_parts_uj`` (DRAM, NoC, compute, static), ``layer_us`` (mean t_layer,
            non-MoE term included) and ``edp_js`` (mean energy × mean t_layer, J·s).
        """
        results = self.step_results(P_layer, pi_layer, allreduce)
        c = float(np.mean([r.t_comp_s for r in results])) * 1e6
        m = float(np.mean([r.t_comm_moe_s for r in results])) * 1e6
        out: dict[str, Any] = {"total_us": c + m, "compute_us": c, "comm_us": m,
                               "mode": results[0].mode}
        if account is not None:
            parts = [account.layer(r).to_dict() for r in results]
            mean = {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}
            layer_s = float(np.mean([r.total_s for r in results]))
            out.update(energy_uj=mean["total"] * 1e6,
                       energy_parts_uj={k: v * 1e6 for k, v in mean.items() if k != "total"},
                       layer_us=layer_s * 1e6, edp_js=mean["total"] * layer_s)
        return out

    def step_results(self, P_layer: NDArray[np.float64], pi_layer: NDArray[np.int64],
                     allreduce: bool = False) -> list[LayerResult]:
        """Return the evaluator's result of every scored step (common random numbers)."""
        ev = LayerEvaluator(self.sim, self.placement(P_layer, pi_layer, allreduce), self.batch,
                            layers=(self.layer,))
        return [ev.evaluate(self.layer, sets, rng=np.random.default_rng(agg_seed))
                for sets, agg_seed in zip(self.step_sets, self._agg_seeds, strict=True)]

    def step_terms(self, P_layer: NDArray[np.float64], pi_layer: NDArray[np.int64],
                   allreduce: bool = False
                   ) -> tuple[NDArray[np.float64], NDArray[np.float64], str]:
        """Return the per-step terms of :meth:`score`: t_comp [S], t_comm_moe [S] (s), mode.

        The per-step values let a caller judge a difference between two placements against
        its noise (paired over the same steps and aggregator streams).
        """
        results = self.step_results(P_layer, pi_layer, allreduce)
        return (np.asarray([r.t_comp_s for r in results], dtype=np.float64),
                np.asarray([r.t_comm_moe_s for r in results], dtype=np.float64),
                results[0].mode)


class ScoredMapping:
    """Link-Balance objective on a scorer's steps: mean MoE communication time of a mapping.

    [decision] The ``best`` guard optimises the mapping of its winner on the same sampled
    decode steps (and aggregator streams) that judge the layer, with the evaluator the bench
    uses, instead of the static group-task-set DES of §8.2: the guard keeps the result only if
    these steps say it is faster, and the group task set of a 256-expert layer is ~20k groups
    (~0.5M messages per evaluation, ~2 s) against 16 × B tokens here (~30 ms). The compute
    term does not depend on the mapping, so the communication time alone is minimised.
    Deterministic (common random numbers); exposes ``last_link_busy`` for Link Balance's
    busiest-link swap proposals.

    Args:
        scorer: The layer's scorer.
        P_layer: float [E, D] the shares (fixed).
        allreduce: Whether the layer is an all-reduce layer.
    """

    deterministic = True

    def __init__(self, scorer: LayerScorer, P_layer: NDArray[np.float64],
                 allreduce: bool = False) -> None:
        self.scorer = scorer
        self.P = np.asarray(P_layer, dtype=np.float64)
        self.allreduce = bool(allreduce)
        self.evaluations = 0
        self.last_link_busy: NDArray[np.float64] | None = None

    def __call__(self, pi: NDArray[np.int64]) -> float:
        """Mean over the scored steps of t_comm_moe (seconds) under mapping ``pi``."""
        self.evaluations += 1
        results = self.scorer.step_results(self.P, np.asarray(pi, dtype=np.int64),
                                           self.allreduce)
        busy = [r.link_busy_s for r in results if r.link_busy_s is not None]
        self.last_link_busy = np.sum(busy, axis=0) if busy else None
        return float(np.mean([r.t_comm_moe_s for r in results]))


@dataclass(frozen=True)
class LocalSearchResult:
    """Result of :func:`tile_local_search`.

    Attributes:
        P_layer: float [E, D] the final shares (on the tile grid).
        phase_us: Mean expert phase over the scored steps before and after, µs.
        moves: Accepted tile moves.
        record: JSON-serialisable record (mode, budget, moves, timings).
    """

    P_layer: NDArray[np.float64]
    phase_us: tuple[float, float]
    moves: int
    record: dict[str, Any] = field(default_factory=dict)


class _TileCost:
    """The evaluator's expert phase of a layer as a function of integer tile counts n [E, D]."""

    def __init__(self, sim: MoESimulator, step_sets: NDArray[np.int64], units: int) -> None:
        model, conv = sim.model, sim.conv
        E = model.num_experts
        # the evaluator's own constants (FLOP time per padded row and column, GEMM overhead,
        # streaming rate), so that this model stays the evaluator's whatever the profile
        ev = LayerEvaluator(sim, tensor_parallel(1, E, sim.hw.num_nodes), 1, layers=(0,))
        counts = np.stack([np.bincount(s.ravel(), minlength=E) for s in step_sets]
                          ).astype(np.float64)                                   # [S, E]
        tile_t = conv.tile_tokens
        self.rows = np.ceil(np.maximum(counts / tile_t - 1e-9, 0.0)) * tile_t     # [S, E]
        self.active = (counts > 0).astype(np.float64)
        shares = np.arange(units + 1) / units
        self.col_s = perf.tile_columns(shares, model, conv) * ev.tile_flop_s      # [U + 1]
        self.gemm_s = ev.gemm_s
        self.streaming = bool(conv.weight_streaming)
        self.unit_stream_s = ev.stream_per_s / units if self.streaming else 0.0
        self.units = units

    def parts(self, n: NDArray[np.int64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return float [S, D] compute and weight-streaming times of every node and step."""
        comp = self.rows @ self.col_s[n] + self.active @ ((n > 0) * self.gemm_s)
        stream = self.active @ (n * self.unit_stream_s) if self.streaming else np.zeros_like(comp)
        return comp, stream

    def node_times(self, n: NDArray[np.int64]) -> NDArray[np.float64]:
        """Return float [S, D]: max(compute, streaming) of every node in every scored step."""
        comp = self.rows @ self.col_s[n] + self.active @ ((n > 0) * self.gemm_s)
        if self.streaming:
            comp = np.maximum(comp, self.active @ (n * self.unit_stream_s))
        out: NDArray[np.float64] = comp
        return out


def tile_local_search(sim: MoESimulator, P_layer: NDArray[np.float64],
                      step_sets: NDArray[np.int64], unit: float, *, allreduce: bool,
                      max_moves: int = 300, sources: int = 2) -> LocalSearchResult:
    """Move whole tiles between nodes while the mean expert phase on the scored steps drops.

    Best-improvement descent: from the ``sources`` nodes that are most often the slowest in a
    scored step, every move of one tile of an expert to another node is priced exactly
    (module docstring: the moves leave the communication cost unchanged) and the best
    improving move is applied. On a plateau of the objective (the mean over steps of the
    slowest node rarely drops with one tile) the move that keeps it and most reduces the
    spread mean_s Σ_c t_c² is taken instead, so the search can walk towards balance; the
    objective itself never rises. The search stops when neither improves or after
    ``max_moves``.

    Args:
        sim: The simulator (model, hardware, conventions: the tile model).
        P_layer: float [E, D] start shares, on the tile grid of ``unit``.
        step_sets: int64 [S, B, k] the scored steps.
        unit: The share unit u = 1/U (``share_unit``).
        allreduce: The layer's communication is TP's all-reduce (any node may take a tile);
            False: a tile only moves between two holders of the expert, and a holder keeps at
            least one tile (the support does not change).
        max_moves: Budget of accepted moves.
        sources: Number of source nodes tried per move.

    Returns:
        The result (the start unchanged when it is off the grid or no move improves).
    """
    t0 = time.perf_counter()
    U = max(1, round(1.0 / unit))
    P = np.asarray(P_layer, dtype=np.float64)
    x = P * U
    n = np.rint(x).astype(np.int64)
    rec: dict[str, Any] = {"mode": "allreduce" if allreduce else "support-preserving",
                           "units": U, "max_moves": int(max_moves)}
    if np.abs(x - n).max(initial=0.0) > 1e-6:
        rec["skipped"] = "start is off the tile grid (uniform TP): kept"
        return LocalSearchResult(P.copy(), (float("nan"),) * 2, 0, rec)  # type: ignore[arg-type]
    cost = _TileCost(sim, step_sets, U)
    D = n.shape[1]
    moves = plateau = 0
    comp, stream = cost.parts(n)
    while True:
        times = np.maximum(comp, stream) if cost.streaming else comp      # [S, D]
        current = float(times.max(axis=1).mean())
        spread = float((times ** 2).sum(axis=1).mean())
        if moves == 0:
            start = current
        if moves >= max_moves:
            break
        order = np.argsort(-times, axis=1, kind="stable")
        top = np.take_along_axis(times, order[:, :3], axis=1)             # [S, 3]
        idx = order[:, :3]
        crit = np.bincount(order[:, 0], minlength=D)
        cands = np.lexsort((-times.sum(axis=0), -crit))[:sources]
        best: tuple[float, float, int, int, int] | None = None
        for a in cands:
            I = np.flatnonzero(n[:, a] >= (1 if allreduce else 2))
            T = np.flatnonzero(np.arange(D) != a)
            if I.size == 0:
                continue
            na = n[I, a]
            rows, act = cost.rows[:, I], cost.active[:, I]                 # [S, I]
            new_a = comp[:, a, None] + rows * (cost.col_s[na - 1] - cost.col_s[na]) \
                - act * cost.gemm_s * (na == 1)
            nb = n[np.ix_(I, T)]                                           # [I, T]
            new_b = comp[:, None, T] + rows[:, :, None] * (cost.col_s[nb + 1]
                                                           - cost.col_s[nb])[None] \
                + act[:, :, None] * cost.gemm_s * (nb == 0)[None]          # [S, I, T]
            if cost.streaming:
                new_a = np.maximum(new_a, stream[:, a, None] - act * cost.unit_stream_s)
                new_b = np.maximum(new_b, stream[:, None, T]
                                   + act[:, :, None] * cost.unit_stream_s)
            ok = (idx[:, :, None] != a) & (idx[:, :, None] != T[None, None, :])
            rest = np.where(ok, top[:, :, None], -np.inf).max(axis=1)      # [S, T]
            obj = np.maximum(np.maximum(rest[:, None, :], new_b),
                             new_a[:, :, None]).mean(axis=0)               # [I, T]
            # tie-break on plateaus of the mean maximum: the spread Σ_c t_c² (balance)
            sec = spread + (new_a ** 2 - times[:, a, None] ** 2).mean(axis=0)[:, None] \
                + (new_b ** 2 - times[:, None, T] ** 2).mean(axis=0)
            allowed = obj <= current
            if not allreduce:
                allowed &= nb >= 1
            if not allowed.any():
                continue
            key = np.where(obj < current * (1 - 1e-12), obj - current, 0.0)
            flat = int(np.lexsort((sec.ravel(), key.ravel(), ~allowed.ravel()))[0])
            r, c = divmod(flat, T.size)
            cand = (float(key[r, c]), float(sec[r, c]), int(I[r]), int(a), int(T[c]))
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None or (best[0] == 0.0 and best[1] >= spread * (1 - 1e-9)):
            break
        _, _, i, a, b = best
        plateau += best[0] == 0.0
        n[i, a] -= 1
        n[i, b] += 1
        comp, stream = cost.parts(n)
        moves += 1
    rec.update(moves=moves, plateau_moves=plateau, phase_start_us=start * 1e6,
               phase_end_us=current * 1e6,
               wall_s=time.perf_counter() - t0)
    out = n / U
    return LocalSearchResult(out, (start * 1e6, current * 1e6), moves, rec)
