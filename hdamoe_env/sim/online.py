"""Layers under online decisions: gating, pre-broadcast and dispatch evaluated on the simulator.

Implements the physics behind the env's actions (paper-model.md §10–11) for one placement at one
batch size: hardware-aware gating of the router candidates (``hdamoe_env.decisions.gating``,
§11), dispatch of the (token, broadcast expert) pairs and of the redundant experts' tokens
(``hdamoe_env.decisions.dispatch``, §10.6–10.7), the pre-broadcast traffic on the NoC
(``hdamoe_env.noc.broadcast``, §10.8), the per-layer broadcast plans and slots
(``hdamoe_env.cost.broadcast``, §10.3–10.4) and the charge of a broadcast exceeding its budget;
the layer latency itself comes from the simulator's ``LayerEvaluator``. Built by
``MoESimulator.decision_evaluator``; knows nothing of RL (style.md R1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.cost import broadcast as prebroadcast
from hdamoe_env.cost import perf
from hdamoe_env.decisions import gating as gating_mod
from hdamoe_env.decisions.dispatch import (DispatchResult, dispatch_broadcast,
                                           replica_expected_shares)
from hdamoe_env.noc.broadcast import (BroadcastResult, broadcast_fanout, simulate_broadcast,
                                      simulate_broadcasts)
from hdamoe_env.sim.evaluator import LayerEvaluator, LayerResult, SimulatorParts
from hdamoe_env.sim.placement import Placement

__all__ = ["DecidedLayer", "DecisionEvaluator", "DecisionSimulator", "gating_tile_cost"]


class DecisionSimulator(SimulatorParts, Protocol):
    """What the decision evaluator reads of a simulator (``MoESimulator`` satisfies it)."""

    def evaluator(self, placement: Placement, batch: int) -> LayerEvaluator:
        """Return the cached-constant layer evaluator of a placement at a batch size."""
        ...


@dataclass(frozen=True, eq=False)
class DecidedLayer:
    """One MoE layer evaluated with online decisions (§10–11) and what the decisions did.

    Attributes:
        result: The layer's latency (``t_extra_s`` holds the charged broadcast excess).
        token_sets: int64 [B, k] the sets executed (after gating).
        gating: The gating result, or None without gating.
        dispatch: Where the (token, broadcast expert) pairs ran, or None without broadcast.
        broadcast: The simulated pre-broadcast traffic, or None without broadcast.
        link_busy_s: float64 [num_links] busy time of the MoE messages plus the broadcast
            traffic, or None (TP or analytic layer without broadcast).
        twin: The layer evaluated with the other fidelity (its own random stream), or None.
        replica: Where the tokens of the redundant experts ran (``dispatch_replicas``), or
            None for a layer without replicas.
    """

    result: LayerResult
    token_sets: NDArray[np.int64]
    gating: gating_mod.GatingResult | None
    dispatch: DispatchResult | None
    broadcast: BroadcastResult | None
    link_busy_s: NDArray[np.float64] | None
    twin: LayerResult | None
    replica: DispatchResult | None = None


class DecisionEvaluator:
    """Evaluate MoE layers under online decisions: gating, pre-broadcast and dispatch (§10–11).

    The physics behind the env's actions, for one placement at one batch size: hardware-aware
    gating of the router candidates (§11), dispatch of the (token, broadcast expert) pairs
    (§10.6–10.7), the pre-broadcast traffic on the NoC (§10.8, cached per (layer, experts)), the
    charge of a broadcast exceeding its budget (``bc_charge_excess``), then the layer latency by
    the simulator's ``LayerEvaluator``. The per-layer broadcast plans (budget, k_b, chunk size,
    §10.3–10.4) are computed once, in ``plans``. Random draws: only the aggregator draws of the
    evaluation (``rng``), then those of the twin (``twin_rng``).

    Args:
        sim: The simulator.
        placement: The placement of all layers.
        batch: Tokens per decode step B.
        freqs: float [L, E] long-term activation frequencies f_i (the static expert phase of
            the layer a broadcast hides behind, §10.3).
        max_broadcast: Cap on k_b (the env's slots).
        bc_max_messages: Cap on DES messages of one layer's pre-broadcast.
        gating_coefficients: (r_comp, r_comm) at gating level 1.
        gating_options: Keyword arguments of ``gating.hardware_aware_gating`` (penalties,
            protect_top, candidate_window, include_future, renormalize, diagnostics).
        gating_streaming: Under the tile model, whether the penalties charge weight streaming
            too (``gating_tile_cost(streaming=)``; default False, the env's default).
    """

    def __init__(self, sim: DecisionSimulator, placement: Placement, batch: int, *,
                 freqs: NDArray[np.float64], max_broadcast: int, bc_max_messages: int = 20_000,
                 gating_coefficients: tuple[float, float] = (0.0, 0.0),
                 gating_options: dict[str, Any] | None = None,
                 gating_streaming: bool = False) -> None:
        model, hw, conv = sim.model, sim.hw, sim.conv
        self.sim, self.placement, self.conv = sim, placement, conv
        self.batch = int(batch)
        # [decision] where a policy needs expected shares (the broadcast budget's static expert
        # phase, the gating penalties), redundant experts count as an even split over their
        # copies (``dispatch.replica_expected_shares``); exactly P without replicas
        self.expected_shares = replica_expected_shares(placement.P, placement.replicas)
        self.evaluator = sim.evaluator(placement, batch)
        self.w_flops = perf.expert_flops(model, conv)
        self.compute_flops = hw.compute_flops
        self.stream_s = (perf.expert_bytes(model, conv) / perf.effective_mem_bw(hw, conv)
                         if conv.weight_streaming else 0.0)
        # replicas run whole experts (I columns) under the tile model (docs/PHYSICS.md §4)
        self.replica_time: Callable[[NDArray[np.float64]], NDArray[np.float64]] | None = (
            functools.partial(_replica_time, model=model, hw=hw, conv=conv)
            if conv.tiled else None)
        self.bc_payload = prebroadcast.broadcast_payload(model, conv)
        self.bc_depth = prebroadcast.broadcast_depth(conv, hw.num_nodes, sim.topology.diameter)
        # §10.3: the broadcast for layer l hides behind layer l - 1 (none for layer 0)
        cap = min(int(max_broadcast), model.num_experts)
        self.slot_cap = cap
        self.plans: list[prebroadcast.BroadcastPlan | None] = [None]
        # with network-interface ports a tree node injects every chunk once per child: the
        # budget rule sees the same bottleneck the DES charges (docs/PHYSICS.md §16)
        fanout = broadcast_fanout(sim.topology) if conv.ni_ports else 1
        for layer in range(1, placement.num_layers):
            nm_prev = sim.nonmoe(self.batch, layer - 1)   # its all-reduce uses the links
            t_nm_prev = nm_prev.total_s - nm_prev.comm_s
            t_comp_prev = float(perf.t_comp_static(self.expected_shares[layer - 1],
                                                   freqs[layer - 1],
                                                   self.batch, model, hw, conv))
            self.plans.append(prebroadcast.broadcast_plan(
                model, hw, conv, self.batch, sim.topology.diameter, float(t_nm_prev),
                t_comp_prev, cap, fanout))
        self.budgets_s = [0.0] + [p.budget_s for p in self.plans[1:] if p is not None]
        self.bc_max_messages = int(bc_max_messages)
        self.gating_coefficients = gating_coefficients
        self.gating_options = dict(gating_options or {})
        self.gating_streaming = bool(gating_streaming)
        # the gating penalties charge the evaluator's tile model (None: fluid), per layer, lazily
        self._tile_costs: list[gating_mod.TileCost | None] = [None] * placement.num_layers
        # one entry per (layer, broadcast set) met; the bound keeps a long episode's memory flat
        self._bc_cache: BoundedCache[tuple[int, tuple[int, ...]], BroadcastResult] = \
            BoundedCache(4096)
        self._trees: dict[int, tuple[NDArray[np.int64], NDArray[np.int64]]] = {}

    def broadcast_slots(self, manual: ArrayLike | None = None) -> NDArray[np.int64]:
        """Return k_b of every layer, the number of pre-broadcast slots (§10.3).

        By default the plans' k_b (the budget rule, ``plans``); ``manual`` (an int, or one per
        layer) replaces them, capped at min(``max_broadcast``, E). Layer 0 has no slot: there
        is no layer before it to hide a broadcast behind.

        Args:
            manual: Manual k_b (validated by the caller), or None.

        Returns:
            int64 [L].
        """
        kb = np.array([0] + [p.k_b for p in self.plans[1:] if p is not None], dtype=np.int64)
        if manual is not None:
            L = self.placement.num_layers
            kb = np.minimum(np.broadcast_to(np.asarray(manual, dtype=np.int64), (L,)).copy(),
                            self.slot_cap)
            kb[0] = 0                                        # §10.3: no broadcast at layer 0
        return kb

    def _base_s(self, layer: int, sets: NDArray[np.int64], broadcast: Sequence[int]
                ) -> NDArray[np.float64] | None:
        """Tile-model seconds of the non-broadcast experts per node (tile-aware dispatch)."""
        if self.replica_time is None:
            return None
        sim = self.evaluator.sim
        return _zeroed_tile_compute(self.placement.P[layer], sets, list(broadcast), sim.model,
                                    sim.hw, sim.conv)

    def gate(self, layer: int, candidates: tuple[NDArray[Any], NDArray[Any]],
             level: float) -> gating_mod.GatingResult:
        """Re-rank the router candidates of one layer by hardware-aware gating (§11).

        Args:
            layer: MoE layer index.
            candidates: (ids int [B, k + J], scores float [B, k + J]) router candidates.
            level: Multiplier of ``gating_coefficients``.
        """
        r_comp, r_comm = self.gating_coefficients
        return gating_mod.hardware_aware_gating(
            candidates, self.sim.model.top_k, self.expected_shares[layer], self.w_flops,
            self.compute_flops, level * r_comp, level * r_comm,
            tile_cost=self.gating_tile_cost(layer), **self.gating_options)

    def gating_tile_cost(self, layer: int) -> gating_mod.TileCost | None:
        """Return the tile-model node cost ``gate`` uses for ``layer`` (built once; None for
        the fluid model), ``gating_tile_cost`` of the layer's expected shares."""
        tile_cost = self._tile_costs[layer]
        if tile_cost is None and self.conv.tiled:
            tile_cost = gating_tile_cost(self.expected_shares[layer], self.sim.model,
                                         self.sim.hw, self.conv,
                                         streaming=self.gating_streaming)
            self._tile_costs[layer] = tile_cost
        return tile_cost

    def broadcast_traffic(self, layer: int, broadcast: Sequence[int]
                          ) -> BroadcastResult:
        """Return the simulated pre-broadcast of ``broadcast`` for ``layer`` (§10.8, cached)."""
        key = (layer, tuple(broadcast))
        hit = self._bc_cache.get(key)
        if hit is None:
            hit = simulate_broadcast(self.sim.topology, self.placement.P[layer],
                                     list(broadcast), self.bc_payload,
                                     self._bc_chunk(len(broadcast)),
                                     pi=self.placement.pi[layer], **self._bc_options())
            self._bc_cache.put(key, hit)
        return hit

    def _bc_chunk(self, count: int) -> float:
        """The simulated chunk size of a broadcast of ``count`` experts (c* of §10.4)."""
        conv = self.conv
        chunk = float(prebroadcast.broadcast_chunk(count, self.bc_payload, self.bc_depth,
                                                   conv.broadcast_alpha_s,
                                                   self.sim.hw.link_bw_Bps))
        if chunk <= 0:  # α = 0: c* -> 0; simulate a fine but finite pipeline [decision]
            chunk = self.bc_payload / _ZERO_ALPHA_CHUNKS
        return chunk

    def _bc_options(self) -> dict[str, Any]:
        """The DES options of ``simulate_broadcast`` shared by every layer."""
        conv, hw = self.conv, self.sim.hw
        return dict(alpha_s=conv.broadcast_alpha_s, hop_latency_s=hw.hop_latency_for(conv),
                    tie_break=conv.tie_break, max_messages=self.bc_max_messages,
                    trees=self._trees, switching=conv.switching,
                    ni_bw_Bps=conv.ni_bw_for(self.sim.topology.bw_end_Bps),
                    ni_latency_s=conv.ni_latency_for(hw.hop_latency_for(conv)))

    def broadcast_charges(self, items: Sequence[tuple[int, Sequence[int]]], *,
                          threads: int = 1) -> list[tuple[BroadcastResult, float]]:
        """``broadcast_charge`` of several (layer, broadcast) pairs, the uncached broadcasts
        simulated in one compiled call (``noc.broadcast.simulate_broadcasts``, on ``threads``
        numba threads); results and cache as one ``broadcast_charge`` call per pair.

        Args:
            items: ``(layer, broadcast experts)`` pairs, each broadcast non-empty.
            threads: numba threads of the DES call (``linksim.check_threads``).
        """
        keys = [(int(layer), tuple(int(e) for e in bc)) for layer, bc in items]
        found = {key: self._bc_cache.get(key) for key in dict.fromkeys(keys)}
        missing = [key for key, hit in found.items() if hit is None]
        if missing:
            runs = [(self.placement.P[layer], list(bc), self._bc_chunk(len(bc)),
                     self.placement.pi[layer]) for layer, bc in missing]
            sims = simulate_broadcasts(self.sim.topology, runs, self.bc_payload,
                                       threads=threads, **self._bc_options())
            for key, hit in zip(missing, sims, strict=True):
                self._bc_cache.put(key, hit)
                found[key] = hit
        out = []
        for key in keys:
            bres = found[key]
            assert bres is not None
            out.append((bres, self._excess(key[0], bres)))
        return out

    def dispatch(self, layer: int, token_sets: NDArray[np.int64], broadcast: Sequence[int],
                 rule: str) -> DispatchResult:
        """Dispatch the (token, broadcast expert) pairs of one layer (§10.6–10.7) as
        ``evaluate`` does (tile-aware under the tile model).

        Args:
            layer: MoE layer index.
            token_sets: int64 [B, k] the executed sets (after gating).
            broadcast: Pre-broadcast experts, distinct, non-empty.
            rule: ``dispatch.DISPATCH_RULES`` entry.
        """
        return dispatch_broadcast(
            token_sets, self.placement.P[layer], broadcast, self.w_flops, rule=rule,
            ref_bookkeeping=self.conv.ref_bookkeeping, compute_flops=self.compute_flops,
            stream_s=self.stream_s, tile_time=self.replica_time,
            base_s=self._base_s(layer, token_sets, broadcast))

    def broadcast_charge(self, layer: int, broadcast: Sequence[int]
                         ) -> tuple[BroadcastResult, float]:
        """Return the pre-broadcast traffic of ``broadcast`` for ``layer`` (``broadcast_traffic``)
        and the seconds it charges to the layer (the excess over the budget with
        ``bc_charge_excess``, §10.3; else 0)."""
        bres = self.broadcast_traffic(layer, broadcast)
        return bres, self._excess(layer, bres)

    def _excess(self, layer: int, bres: BroadcastResult) -> float:
        """Seconds a broadcast charges to its layer: the excess over the budget with
        ``bc_charge_excess`` (§10.3: time beyond the budget is exposed), else 0."""
        if self.conv.bc_charge_excess:
            return max(0.0, bres.makespan_s - self.budgets_s[layer])
        return 0.0

    def evaluate(self, layer: int, token_sets: NDArray[np.int64], *,
                 rng: np.random.Generator, broadcast: Sequence[int] = (),
                 dispatch_rule: str = "least_loaded", gating_level: float = 0.0,
                 candidates: tuple[NDArray[Any], NDArray[Any]] | None = None,
                 fidelity: str = "des", gamma: float | None = None,
                 twin_rng: np.random.Generator | None = None,
                 replica_rule: str = "least_loaded",
                 replica_fractions: NDArray[np.float64] | None = None) -> DecidedLayer:
        """Evaluate one layer of one decode step with its online decisions.

        Redundant experts of the placement: the broadcast experts are dispatched first
        (everyone holds them); the tokens of the other replicated experts then go to one copy
        each by ``replica_rule`` (``LayerEvaluator.dispatch_replicas``, loads including the
        broadcast dispatch), and the two dispatches' work, streaming and holders add up.

        Args:
            layer: MoE layer index.
            token_sets: int64 [B, k] the router's sets (batch order), well-formed.
            rng: Generator of the aggregator draws.
            broadcast: Pre-broadcast experts, distinct, in broadcast order.
            dispatch_rule: ``dispatch.DISPATCH_RULES`` entry.
            gating_level: 0 = plain top-k; otherwise gate ``candidates`` at this level.
            candidates: Router candidates of the B rows (needed when ``gating_level > 0``).
            fidelity: ``"des"`` or ``"analytic"``.
            gamma: γ of the layer (analytic fidelity, and the twin).
            twin_rng: When given, also evaluate the other fidelity with this generator.
            replica_rule: ``dispatch.REPLICA_RULES`` entry (layers with replicas).
            replica_fractions: float [E, 1 + D] per-copy fractions (``"shares"``).

        Returns:
            The layer result and the decisions' details.
        """
        sets = token_sets
        gated = None
        if gating_level > 0:
            assert candidates is not None, "gating needs the router candidates"
            gated = self.gate(layer, candidates, gating_level)
            sets = gated.sets
        dispatch = bres = None
        P_layer = extra_holders = extra_compute = extra_stream = None
        extra_s = 0.0
        if broadcast:
            dispatch = self.dispatch(layer, sets, broadcast, dispatch_rule)
            P_layer, extra_holders = dispatch.P_layer, dispatch.extra_holders
            extra_compute, extra_stream = dispatch.extra_compute_s, dispatch.extra_stream_s
            bres, extra_s = self.broadcast_charge(layer, broadcast)
        replica = self.evaluator.dispatch_replicas(
            layer, sets, rule=replica_rule, P_layer=P_layer, extra_compute_s=extra_compute,
            fractions=replica_fractions)
        kwargs: dict[str, Any] = dict(P_layer=P_layer, extra_holders=extra_holders,
                                      extra_compute_s=extra_compute,
                                      extra_stream_s=extra_stream, extra_s=extra_s)
        if replica is not None:
            kwargs["replica_dispatch"] = replica
        res = self.evaluator.evaluate(layer, sets, rng=rng, fidelity=fidelity,
                                      gamma=gamma if fidelity == "analytic" else None, **kwargs)
        busy = res.link_busy_s
        if bres is not None:
            busy = bres.link_busy_s if busy is None else busy + bres.link_busy_s
        twin = None
        if twin_rng is not None:
            other = "analytic" if fidelity == "des" else "des"
            twin = self.evaluator.evaluate(layer, sets, rng=twin_rng, fidelity=other,
                                           gamma=gamma, **kwargs)
        return DecidedLayer(res, sets, gated, dispatch, bres, busy, twin, replica)


def gating_tile_cost(P: ArrayLike, model: ModelSpec, hw: HardwareSpec, conv: Conventions, *,
                     streaming: bool = False) -> gating_mod.TileCost | None:
    """Return the node cost the evaluator charges for shares ``P`` [E, D], for the gating (§11.3).

    Under the tile model (``conv.tiled``, docs/PHYSICS.md §4) the terms of the evaluator's
    expert phase: seconds per padded token row of every shard (``perf.tile_columns`` ·
    m·2h/C), m·o per active shard, and the shard's weight streaming P_ic·W_e/(BW_mem·η) when the
    profile charges it (``conv.weight_streaming``) and ``streaming`` is True; None for the fluid
    model (``paper*``), whose penalties stay in FLOP (Eq. 1).

    [decision] ``streaming`` is False by default: the greedy's marginal cost of the running
    counts is myopic, and a streaming floor under every node hides the compute a token adds
    until the node's compute passes it, too late to balance (DeepSeek-V2-Lite 10/25: mean
    expert phase 81.4 µs with streaming vs 78.9 µs without, fluid 78.0; docs/PHYSICS.md §4.1a).

    Args:
        P: Placement shares of one layer, float [E, D] (replicas as expected shares).
        model: The model.
        hw: The hardware.
        conv: The conventions.
        streaming: Include the weight streaming (the evaluator's whole charge) or not (the
            tile-model compute alone, the env's default ``gating_streaming=False``).

    Returns:
        The tables of ``gating.TileCost``, or None without tiles.
    """
    if not conv.tiled:
        return None
    shares = np.asarray(P, dtype=np.float64)
    tile_flop_s = conv.expert_matrices * 2.0 * model.hidden_size / hw.compute_flops
    row_s = perf.tile_columns(shares, model, conv) * tile_flop_s
    stream = (shares * (perf.expert_bytes(model, conv) / perf.effective_mem_bw(hw, conv))
              if conv.weight_streaming and streaming else np.zeros_like(shares))
    return gating_mod.TileCost(np.ascontiguousarray(row_s), conv.expert_matrices
                               * conv.gemm_overhead_s, np.ascontiguousarray(stream),
                               int(conv.tile_tokens))


def _zeroed_tile_compute(P: NDArray[np.float64], sets: NDArray[np.int64], broadcast: list[int],
                         model: ModelSpec, hw: HardwareSpec, conv: Conventions
                         ) -> NDArray[np.float64]:
    """Return the tile-model seconds [D] of the non-broadcast experts of one step."""
    P0 = np.array(P, dtype=np.float64)
    P0[list(broadcast)] = 0.0
    counts = np.bincount(np.asarray(sets).ravel(), minlength=P0.shape[0]).astype(np.float64)
    return np.asarray(perf.tiled_node_compute(P0, counts, counts > 0, model, hw, conv),
                      dtype=np.float64)


#: Chunks per broadcast expert when the broadcast start-up α is 0 (c* of §10.4 would be 0).
_ZERO_ALPHA_CHUNKS = 256


def _replica_time(tokens: NDArray[np.float64], *, model: ModelSpec, hw: HardwareSpec,
                  conv: Conventions) -> NDArray[np.float64]:
    """Return the tile-model seconds of whole-expert replicas with ``tokens`` tokens each."""
    return np.asarray(perf.gemm_tile_time(tokens, model.expert_intermediate, model, hw, conv),
                      dtype=np.float64)
