"""γ calibration of the analytic communication estimator against the DES (paper-model.md §5.5).

For every layer (and every hardware/topology setting) the DES makespan of random batches on the
fitting placement (EP with a random mapping by default) is regressed on the analytic estimate of
Eq. 2 (sampled form). ``paper*``: batch sizes 256, 258, …, 638, y = combine DES only, ordinary
least squares (intercept discarded). ``faithful``: 64 batch sizes evenly spaced in [B/2, 2B],
y = dispatch + combine DES, least squares through the origin. γ must be refitted whenever the
topology, mesh size or bandwidth changes.

``twin_gammas`` is the fit the analytic twin of the env uses: γ per layer on the run's own
placement and trace, fitted once per process and kept in a bounded cache keyed by everything
the fit reads (simulator, placement, trace, view, batch, seed).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.cost import perf
from hdamoe_env.noc import linksim
from hdamoe_env.sim.evaluator import partial_shards
from hdamoe_env.sim.placement import Placement
from traces import RoutingTrace

if TYPE_CHECKING:  # calibrate sits below the simulator (style.md §2); it only reads attributes
    from hdamoe_env.sim.simulator import MoESimulator

__all__ = ["GammaFit", "fit_gamma", "fit_gammas", "gamma_batch_sizes", "twin_gammas"]

logger = logging.getLogger(__name__)

#: γ per layer by the digest of everything ``twin_gammas`` reads. One entry per analytic
#: configuration (placement, trace, batch, seed) of the process: a bench run fits one per
#: method, the whole test suite 11 (measured), so 256 never evicts (a value is L floats).
_GAMMA_CACHE: BoundedCache[str, NDArray[np.float64]] = BoundedCache(
    256, name="hdamoe_env.sim.calibrate.twin_gammas")


@dataclass(frozen=True)
class GammaFit:
    """Result of one layer's γ fit.

    Attributes:
        layer: MoE layer index.
        gamma: Slope γ (seconds of DES per second of analytic estimate).
        intercept_s: OLS intercept (0 for the fit through the origin); discarded by the model.
        correlation: Pearson correlation of x and y.
        x_s: float [n] analytic estimates t_comm (Eq. 2) of the fitting batches.
        y_s: float [n] DES makespans of the same batches.
        method: ``"origin"`` or ``"ols"``.
    """

    layer: int
    gamma: float
    intercept_s: float
    correlation: float
    x_s: NDArray[np.float64]
    y_s: NDArray[np.float64]
    method: str

    def to_dict(self) -> dict[str, float | int | str]:
        """Return the scalar fields as a JSON-serialisable dict."""
        return {"layer": self.layer, "gamma": self.gamma, "intercept_s": self.intercept_s,
                "correlation": self.correlation, "points": int(self.x_s.size),
                "method": self.method}


def gamma_batch_sizes(sim: MoESimulator, batch: int) -> NDArray[np.int64]:
    """Return the batch sizes of the γ fit for the simulator's profile (§5.5)."""
    conv = sim.conv
    if conv.gamma_fit == "ols":
        start, stop, step = conv.gamma_paper_batches
        return np.arange(start, stop, step, dtype=np.int64)
    lo, hi = conv.gamma_batch_lo * batch, conv.gamma_batch_hi * batch
    return np.maximum(1, np.rint(np.linspace(lo, hi, conv.gamma_points))).astype(np.int64)


def fit_gamma(sim: MoESimulator, placement: Placement, layer: int,
              layer_rows: NDArray[np.int64], batch: int, rng: np.random.Generator) -> GammaFit:
    """Fit γ for one layer.

    Args:
        sim: Simulator (model, hardware, topology, profile).
        placement: Fitting placement (EP with a random mapping in the paper's procedure).
        layer: MoE layer index.
        layer_rows: int [T, k] the layer's expert sets (trace rows of the chosen view).
        batch: Operating batch size B (sets the faithful batch-size range).
        rng: Generator for batch draws and aggregators.

    Returns:
        The fit.

    Raises:
        ConfigError: Too few rows to form a batch.
    """
    layer_rows = np.asarray(layer_rows, dtype=np.int64)
    n_rows = layer_rows.shape[0]
    if n_rows < 2:
        raise ConfigError(f"layer {layer}: γ fit needs at least 2 trace rows, got {n_rows}")
    sizes = gamma_batch_sizes(sim, batch)
    support = placement.P[layer] > 0
    pi = placement.pi[layer]
    conv = sim.conv
    phases = ("combine",) if conv.gamma_combine_only else ("dispatch", "combine")
    partial = partial_shards(placement.P[layer], conv)     # psum_combine (PHYSICS.md §2)
    psum = float(sim.model.hidden_size * conv.b_psum)
    xs = np.empty(sizes.size)
    ys = np.empty(sizes.size)
    for j, b in enumerate(sizes):
        rows = rng.choice(n_rows, size=int(b), replace=bool(b > n_rows))
        sets = layer_rows[rows]
        xs[j], _ = perf.analytic_comm_sampled(support, sets, sim.model.hidden_size,
                                              conv.kappa_a, sim.topology.bw_end_Bps)
        agg = linksim.choose_aggregators(sets, support, conv.aggregator, rng)
        comm = linksim.simulate_layer_comm(
            sim.topology, sets, np.full(sets.shape[0], sim.msg_bytes), support, pi, agg,
            phases=phases, tie_break=conv.tie_break, hop_latency_s=sim.hw.hop_latency_for(conv),
            layer=layer, chunks=conv.chunks, alpha_s=conv.msg_alpha_s, partial_mask=partial,
            combine_bytes=None if partial is None else psum, switching=conv.switching,
            ni_bw_Bps=conv.ni_bw_for(sim.topology.bw_end_Bps),
            ni_latency_s=conv.ni_latency_for(sim.hw.hop_latency_for(conv)))
        ys[j] = comm.combine_s + (comm.dispatch_s if "dispatch" in phases else 0.0)
    corr = float(np.corrcoef(xs, ys)[0, 1]) if xs.std() > 0 and ys.std() > 0 else float("nan")
    if conv.gamma_fit == "ols":
        slope, intercept = np.polyfit(xs, ys, 1)
        return GammaFit(layer, float(slope), float(intercept), corr, xs, ys, "ols")
    denom = float(xs @ xs)
    gamma = float(xs @ ys) / denom if denom > 0 else 0.0
    return GammaFit(layer, gamma, 0.0, corr, xs, ys, "origin")


def fit_gammas(sim: MoESimulator, placement: Placement, rows_per_layer: list[NDArray[np.int64]],
               batch: int, seed: int) -> list[GammaFit]:
    """Fit γ for every layer, each with its own spawned random stream.

    Args:
        sim: Simulator.
        placement: Fitting placement.
        rows_per_layer: Per layer the int [T, k] expert sets.
        batch: Operating batch size.
        seed: Run seed; layer l uses ``SeedSequence(seed).spawn(L)[l]``.
    """
    streams = np.random.SeedSequence(seed).spawn(len(rows_per_layer))
    return [fit_gamma(sim, placement, layer, rows, batch, np.random.default_rng(ss))
            for layer, (rows, ss) in enumerate(zip(rows_per_layer, streams, strict=True))]


def twin_gammas(sim: MoESimulator, placement: Placement, trace: RoutingTrace,
                routing: NDArray[np.integer], view: str, batch: int, seed: int
                ) -> NDArray[np.float64]:
    """Return γ per layer of the analytic twin for a run's placement and trace (cached).

    A placement whose every share is 1/D (TP) never uses γ: zeros, without a fit. Otherwise
    ``fit_gammas`` on the placement itself with the rows of ``view``, fitted once per process:
    the result is cached by a digest of the simulator's configuration, the placement's arrays
    (P, pi, replicas), the trace id, the view, the batch size and the seed, and a hit returns
    the very array the fit returned.

    Args:
        sim: Simulator (model, hardware, topology, profile).
        placement: The run's placement.
        trace: The run's trace (its id and view rows).
        routing: int [L, T, k] the expert sets the simulator executes (the trace's original
            top-k where it records one).
        view: Trace view of the fitting rows (``RoutingTrace.view``).
        batch: Operating batch size B.
        seed: Seed of the fit (``fit_gammas``).

    Returns:
        float64 [L] γ per layer. Shared with the cache: read it, never modify it.
    """
    P = placement.P
    L, D = placement.num_layers, placement.num_nodes
    if np.allclose(P, 1.0 / D):
        return np.zeros(L)                     # TP layers never use γ
    digest = hashlib.sha256()
    digest.update(json.dumps(sim.describe(), sort_keys=True).encode())
    digest.update(P.tobytes())
    digest.update(placement.pi.tobytes())
    if placement.replicas is not None:
        digest.update(placement.replicas.tobytes())
    digest.update(f"{trace.trace_id}|{view}|{batch}|{seed}".encode())
    key = digest.hexdigest()
    hit = _GAMMA_CACHE.get(key)
    if hit is None:
        rows = trace.view(view)
        per_layer = [routing[layer, rows].astype(np.int64) for layer in range(L)]
        fits = fit_gammas(sim, placement, per_layer, batch, seed)
        hit = np.array([f.gamma for f in fits])
        logger.info("fitted gamma per layer for the analytic twin: %s", hit.round(3))
        _GAMMA_CACHE.put(key, hit)
    return hit
