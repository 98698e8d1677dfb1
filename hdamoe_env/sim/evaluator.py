"""The per-layer evaluator of the simulator: one MoE layer of one decode step, cached constants.

Implements paper-model.md §5.1–5.2 (expert phase t_comp, Eq. 1 with weight streaming), §5.4
(MoE communication by placement type: TP all-reduce, or dispatch/combine on the NoC DES of §6),
§5.5 (the γ-calibrated analytic twin, Eq. 2–3), §5.7 (the sampled evaluator) and §5.8 (the
``LayerResult`` outputs). It is the one implementation behind ``MoESimulator.layer_sampled`` and
``MoESimulator.step`` and the online loop of the env: per-placement constants (holder tables,
holder bitmasks, TP detection, t_nm) and per-batch constants (message sizes, TP all-reduce time)
are computed once; ``evaluate`` does no input validation (the public entry
``MoESimulator.layer_sampled`` validates, then calls the same code).

Redundant experts (``Placement.replicas``): ``evaluate`` runs the replica dispatch of
``dispatch.dispatch_replicas`` on the layer's shares (after any broadcast dispatch the caller
passed in ``P_layer``/``extra_*``) and charges its work, streaming and extra holders like the
broadcast replicas; without replicas nothing changes.

The simulator module imports this one (style.md §2: evaluator sits just below the simulator);
this module reads a simulator only through the ``SimulatorParts`` protocol.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.noc import collectives
from hdamoe_env.noc import linksim
from hdamoe_env.cost import energy
from hdamoe_env.cost import nonmoe
from hdamoe_env.cost import perf
from hdamoe_env.decisions import dispatch
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.sim.placement import Placement
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.noc.topology import Topology

__all__ = [
    "FIDELITIES",
    "LayerEvaluator",
    "LayerResult",
    "SimulatorParts",
    "is_tensor_parallel",
    "partial_shards",
    "simulate_moe_comm",
]

FIDELITIES = ("des", "analytic")


@dataclass(frozen=True)
class LayerResult:
    """Latency of one MoE layer of one decode step (all times in seconds).

    Attributes:
        layer: MoE layer index.
        t_nm_s: Non-MoE part (attention, shared experts), roofline or serial sum per profile.
        t_nm_compute_s: Its compute part (the rest of ``t_nm_s`` is exposed memory time).
        t_comp_s: Expert phase, max over nodes (roofline with weight streaming in ``faithful``).
        t_comp_compute_s: Max over nodes of the expert FLOP time alone.
        t_dispatch_s: Dispatch makespan (0 in ``paper*`` profiles, which double the combine).
        t_combine_s: Combine makespan.
        t_comm_moe_s: MoE communication charged to the layer.
        t_extra_s: Other charged time (e.g. broadcast time exceeding its budget).
        node_compute_s: float64 [D] expert FLOP time per logical cluster.
        node_stream_s: float64 [D] expert weight-streaming time per logical cluster.
        link_busy_s: float64 [num_links] busy time per directed link (all phases), or None.
        mode: ``"tp"``, ``"des"`` or ``"analytic"``.
        tp_algorithm: TP layers: the all-reduce algorithm charged (``collectives.ALGORITHMS``,
            or ``"ring"`` / ``"const"`` closed forms); empty otherwise.
        t_nm_comm_s: The non-MoE all-reduce inside ``t_nm_s`` (``nonmoe_allreduce``).
        node_mac_s: float64 [D] the part of ``node_compute_s`` the MAC array computes (padded
            rows and columns included, the per-GEMM fixed time o excluded; dispatched replica
            work counts whole), or None (energy, docs/PHYSICS.md §18).
        node_weight_bytes: float64 [D] expert weight bytes read from each node's DRAM, or None.
        noc_byte_hops: Σ bytes × links crossed of the layer's MoE communication (dispatch and
            combine, or TP's all-reduce), or None.
    """

    layer: int
    t_nm_s: float
    t_nm_compute_s: float
    t_comp_s: float
    t_comp_compute_s: float
    t_dispatch_s: float
    t_combine_s: float
    t_comm_moe_s: float
    t_extra_s: float
    node_compute_s: NDArray[np.float64]
    node_stream_s: NDArray[np.float64]
    link_busy_s: NDArray[np.float64] | None
    mode: str
    tp_algorithm: str = ""
    t_nm_comm_s: float = 0.0
    node_mac_s: NDArray[np.float64] | None = None
    node_weight_bytes: NDArray[np.float64] | None = None
    noc_byte_hops: float | None = None

    @property
    def total_s(self) -> float:
        """Layer latency t_nm + t_comp + t_comm_moe + extra."""
        return self.t_nm_s + self.t_comp_s + self.t_comm_moe_s + self.t_extra_s

    @property
    def compute_s(self) -> float:
        """Compute share of the breakdown (non-MoE compute + expert FLOP time)."""
        return self.t_nm_compute_s + self.t_comp_compute_s

    @property
    def memory_s(self) -> float:
        """Exposed memory time (the part of the rooflines not hidden behind compute).

        Clamped at 0: a compute-bound layer's difference is a rounding residue (-1e-20 s), not
        time.
        """
        return max(0.0, (self.t_nm_s - self.t_nm_compute_s - self.t_nm_comm_s)
                   + (self.t_comp_s - self.t_comp_compute_s))

    @property
    def balancedness(self) -> float:
        """Mean node expert load ÷ max node expert load (1 = perfectly balanced)."""
        peak = float(self.node_compute_s.max())
        return 1.0 if peak <= 0 else float(self.node_compute_s.mean()) / peak


class SimulatorParts(Protocol):
    """What the evaluator reads of a simulator (``MoESimulator`` satisfies it)."""

    model: ModelSpec
    hw: HardwareSpec
    conv: Conventions
    topology: Topology
    msg_bytes: float

    def nonmoe(self, batch: int, layer: int) -> nonmoe.NonMoeTime:
        """Return the non-MoE term of a layer at a batch size."""
        ...

    def tp_allreduce(self, batch: int) -> collectives.AllReduce:
        """Return TP's all-reduce of one layer at a batch size (time and algorithm, §5.6)."""
        ...


def is_tensor_parallel(P_layer: NDArray[np.float64]) -> bool:
    """Return whether a layer's shares are exactly TP (every P_ic = 1/D)."""
    return bool(np.allclose(P_layer, 1.0 / P_layer.shape[1], rtol=0, atol=1e-12))


def partial_shards(P_layer: NDArray[np.float64], conv: Conventions) -> NDArray[np.bool_] | None:
    """Return the partial-shard holders (0 < P_ic < 1) whose combine messages carry partial sums.

    ``psum_combine`` (``faithful``, docs/PHYSICS.md §2): a cluster holding part of an expert
    sends partial sums of the expert's output, at ``b_psum`` bytes per element like TP's
    all-reduce; a cluster holding whole experts sends finished outputs at ``b_msg``.

    Args:
        P_layer: float [E, D] shares of one layer.
        conv: The conventions.

    Returns:
        bool [E, D], or None when the knob is off or no expert of the layer is split.
    """
    if not conv.psum_combine:
        return None
    partial = (P_layer > 0) & (P_layer < 1.0 - 1e-9)
    return partial if partial.any() else None


def simulate_moe_comm(sim: SimulatorParts, layer: int, token_sets: NDArray[np.int64],
                      msg_bytes: NDArray[np.float64], support: NDArray[np.bool_],
                      holders: linksim.HolderTable | NDArray[np.bool_], pi: NDArray[np.int64],
                      rng: np.random.Generator, agg: NDArray[np.int64] | None,
                      extra_holders: NDArray[np.int64] | None, *,
                      partial: NDArray[np.bool_] | None = None,
                      combine_bytes: NDArray[np.float64] | None = None,
                      ) -> tuple[float, float, float, NDArray[np.float64]]:
    """Simulate the MoE communication of one layer on the DES (§5.4, §6.2–6.3).

    Draws the aggregators (when ``agg`` is None) with ``linksim.choose_aggregators`` and runs
    ``linksim.simulate_layer_comm``. ``paper*`` profiles (``moe_comm="combine"``) simulate the
    combine only and charge it twice.

    Args:
        sim: The simulator (topology, hardware, conventions).
        layer: MoE layer index (enters the flow keys).
        token_sets: int64 [T, k] expert sets per token (or group).
        msg_bytes: float64 [T] message bytes per token (or group).
        support: bool [E, D] holder mask of the layer.
        holders: The holder table of ``support`` (or ``support`` itself, validated).
        pi: int64 [D] endpoint of every cluster.
        rng: Generator of the aggregator draws.
        agg: int64 [T] aggregators, or None to draw them.
        extra_holders: int64 [T, x] further holders per token (−1 = none), or None.
        partial: bool [E, D] partial-shard holders (``partial_shards``), or None.
        combine_bytes: float64 [T] partial-sum combine message bytes (with ``partial``).

    Returns:
        ``(t_dispatch_s, t_combine_s, t_comm_moe_s, link_busy_s [num_links])``.
    """
    conv = sim.conv
    if agg is None:
        agg = linksim.choose_aggregators(token_sets, holders, conv.aggregator, rng, extra_holders)
    both = conv.moe_comm == "dispatch+combine"
    phases = ("dispatch", "combine") if both else ("combine",)
    comm = linksim.simulate_layer_comm(
        sim.topology, token_sets, msg_bytes, support, pi, agg, phases=phases,
        tie_break=conv.tie_break, hop_latency_s=sim.hw.hop_latency_for(conv), layer=layer,
        extra_holders=extra_holders, chunks=conv.chunks, alpha_s=conv.msg_alpha_s,
        partial_mask=partial, combine_bytes=None if partial is None else combine_bytes,
        switching=conv.switching, ni_bw_Bps=conv.ni_bw_for(sim.topology.bw_end_Bps),
        ni_latency_s=conv.ni_latency_for(sim.hw.hop_latency_for(conv)))
    t_combine = comm.combine_s
    if both:
        t_dispatch = comm.dispatch_s
        return t_dispatch, t_combine, t_dispatch + t_combine, comm.link_busy_total_s
    return 0.0, t_combine, 2.0 * t_combine, 2.0 * comm.link_busy_total_s


def _bitmask(support: NDArray[np.bool_]) -> NDArray[np.uint64] | None:
    """Return uint64 [E] holder bitmasks (None for more than 64 clusters)."""
    if support.shape[1] > 64:
        return None
    weights = np.left_shift(np.uint64(1), np.arange(support.shape[1], dtype=np.uint64))
    return (support.astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)


class _LayerConst:
    """Per-layer constants of the evaluator (holder table and bitmask built on first use).

    ``is_tp``: the layer's MoE communication is TP's all-reduce (uniform TP shares, or a layer
    marked ``Placement.allreduce``: tile-aligned TP).
    """

    __slots__ = ("P", "_bitmask", "_holders", "is_tp", "nm_comm", "nm_compute", "nm_total",
                 "partial", "pi", "rep_holders", "rep_tile_work", "replicas", "support",
                 "tile_work")

    def __init__(self, P: NDArray[np.float64], pi: NDArray[np.int64], nm: nonmoe.NonMoeTime,
                 is_tp: bool, replicas: NDArray[np.bool_] | None = None,
                 partial: NDArray[np.bool_] | None = None) -> None:
        self.P = np.ascontiguousarray(P)
        self.support = self.P > 0
        self.partial = partial                            # bool [E, D] or None (psum_combine)
        self.pi = np.ascontiguousarray(pi, dtype=np.int64)
        self.nm_total = float(nm.total_s)
        self.nm_compute = float(nm.compute_s)
        self.nm_comm = float(nm.comm_s)
        self.is_tp = is_tp
        self.tile_work: NDArray[np.float64] | None = None   # [2E, D] tile model (evaluator)
        self._holders: linksim.HolderTable | None = None
        self._bitmask: NDArray[np.uint64] | None | bool = False
        self.replicas = replicas                          # bool [E, D] or None
        # the replica-dispatched shares are the same every step: cache their tile matrix and
        # holder table (keyed by the bytes of the zeroed shares)
        self.rep_tile_work: tuple[bytes, NDArray[np.float64]] | None = None
        self.rep_holders: tuple[bytes, linksim.HolderTable] | None = None

    @property
    def holders(self) -> linksim.HolderTable:
        """The holder table of the layer (aggregator draws, DES fidelity)."""
        if self._holders is None:
            self._holders = linksim.HolderTable.from_shares(self.support)
        return self._holders

    @property
    def bitmask(self) -> NDArray[np.uint64] | None:
        """uint64 [E] holder bitmasks, or None for more than 64 clusters."""
        if self._bitmask is False:
            self._bitmask = _bitmask(self.support)
        return self._bitmask  # type: ignore[return-value]


class LayerEvaluator:
    """Evaluate single MoE layers of one placement at one batch size, with cached constants.

    t_nm from the simulator's cache, expert phase by §5.2 (plus the dispatched replica work and
    streaming), MoE communication by the TP all-reduce, the DES (``simulate_moe_comm``) or the
    γ-calibrated analytic twin (V_c counted with holder bitmasks). ``evaluate`` trusts its
    inputs; ``MoESimulator.layer_sampled`` is the validating public entry to the same code.

    Args:
        sim: The simulator (model, hardware, topology, conventions).
        placement: The placement of all layers.
        batch: Tokens per decode step B.
        layers: Only build the constants of these layers (default: all).
    """

    def __init__(self, sim: SimulatorParts, placement: Placement, batch: int, *,
                 layers: Sequence[int] | None = None) -> None:
        self.sim = sim
        model, hw, conv = sim.model, sim.hw, sim.conv
        self.model, self.hw, self.conv = model, hw, conv
        self.batch = int(batch)
        self.num_experts = model.num_experts
        self.flops_per_s = perf.expert_flops(model, conv) / hw.compute_flops
        self.stream_per_s = perf.expert_bytes(model, conv) / perf.effective_mem_bw(hw, conv)
        self.w_bytes = perf.expert_bytes(model, conv)
        self.eff_mem_bw = perf.effective_mem_bw(hw, conv)
        # tile model (PHYSICS.md): s per padded token of each shard, and per active shard
        self.tiled = conv.tiled
        self.tile_flop_s = conv.expert_matrices * 2.0 * model.hidden_size / hw.compute_flops
        self.gemm_s = conv.expert_matrices * conv.gemm_overhead_s
        tile_t = conv.tile_tokens
        self._rows_table = np.ceil(np.arange(self.batch + 1) / tile_t - 1e-9).clip(0.0) * tile_t
        self._t_tp: collectives.AllReduce | None = None
        self.msg = np.full(self.batch, sim.msg_bytes)
        # partial-sum combine messages (psum_combine, docs/PHYSICS.md §2)
        self.psum_msg = np.full(self.batch, float(model.hidden_size * conv.b_psum))
        tp_share = 1.0 / placement.num_nodes
        wanted = range(placement.num_layers) if layers is None else layers
        self.layers: list[_LayerConst | None] = [None] * placement.num_layers
        reps = placement.replicas
        for layer in wanted:
            self.layers[layer] = _LayerConst(
                placement.P[layer], placement.pi[layer], sim.nonmoe(self.batch, layer),
                bool(np.allclose(placement.P[layer], tp_share, rtol=0, atol=1e-12))
                or placement.is_allreduce(layer),
                None if reps is None or not reps[layer].any() else reps[layer],
                partial_shards(placement.P[layer], conv))
        self.w_flops = perf.expert_flops(model, conv)
        self.stream_s = (perf.expert_bytes(model, conv) / perf.effective_mem_bw(hw, conv)
                         if conv.weight_streaming else 0.0)
        self._hops: NDArray[np.int64] | None = None
        self._mean_hops: float | None = None

    @property
    def tp_allreduce(self) -> collectives.AllReduce:
        """TP all-reduce of one layer at this batch (§5.6): time and algorithm."""
        if self._t_tp is None:
            self._t_tp = self.sim.tp_allreduce(self.batch)
        return self._t_tp

    @property
    def t_tp(self) -> float:
        """TP all-reduce time of one layer at this batch (§5.6), seconds."""
        return self.tp_allreduce.time_s

    def has_replicas(self, layer: int) -> bool:
        """Return whether ``layer`` has redundant expert copies (``Placement.replicas``)."""
        const = self.layers[layer]
        return const is not None and const.replicas is not None

    def _replica_tile_time(self, tokens: NDArray[np.float64], shares: NDArray[np.float64]
                           ) -> NDArray[np.float64]:
        """Tile-model seconds of shards holding ``shares`` of an expert with ``tokens`` each."""
        return np.asarray(perf.gemm_tile_time(tokens, shares * self.model.expert_intermediate,
                                              self.model, self.hw, self.conv), dtype=np.float64)

    def dispatch_replicas(self, layer: int, token_sets: NDArray[np.int64], *,
                          rule: str = "least_loaded", P_layer: NDArray[np.float64] | None = None,
                          extra_compute_s: NDArray[np.float64] | None = None,
                          fractions: NDArray[np.float64] | None = None
                          ) -> dispatch.DispatchResult | None:
        """Run the replica dispatch of one layer (``dispatch.dispatch_replicas``).

        Args:
            layer: MoE layer index.
            token_sets: int64 [B, k] the executed sets.
            rule: One of ``dispatch.REPLICA_RULES``.
            P_layer: The layer's shares after a broadcast dispatch (broadcast rows zeroed;
                those experts are not replica-dispatched), or None for the placement's.
            extra_compute_s: The broadcast dispatch's work per node, seconds; it enters the
                ``least_loaded`` / ``nearest`` loads as ``extra_compute_s · C`` FLOP.
            fractions: float [E, 1 + D] per-copy fractions (``rule="shares"``).

        Returns:
            The dispatch, or None when the layer has no replicas.
        """
        const = self.layers[layer]
        assert const is not None, f"layer {layer} constants were not built"
        if const.replicas is None:
            return None
        if rule == "nearest" and self._hops is None:
            self._hops = self.sim.topology.hop_counts()
        return dispatch.dispatch_replicas(
            token_sets, const.P if P_layer is None else P_layer, const.replicas, self.w_flops,
            rule=rule, fractions=fractions, hops=self._hops, pi=const.pi,
            initial_flops=(None if extra_compute_s is None
                           else extra_compute_s * self.hw.compute_flops),
            compute_flops=self.hw.compute_flops, stream_s=self.stream_s,
            tile_time=self._replica_tile_time if self.tiled else None)

    def evaluate(self, layer: int, token_sets: NDArray[np.int64], *, rng: np.random.Generator,
                 fidelity: str = "des", gamma: float | None = None,
                 P_layer: NDArray[np.float64] | None = None,
                 agg: NDArray[np.int64] | None = None,
                 extra_holders: NDArray[np.int64] | None = None,
                 extra_compute_s: NDArray[np.float64] | None = None,
                 extra_stream_s: NDArray[np.float64] | None = None,
                 extra_s: float = 0.0, replica_rule: str = "least_loaded",
                 replica_fractions: NDArray[np.float64] | None = None,
                 replica_dispatch: dispatch.DispatchResult | None = None) -> LayerResult:
        """Evaluate one layer of one decode step (arguments as ``MoESimulator.layer_sampled``).

        With redundant experts in the layer, the replica dispatch (``dispatch_replicas`` with
        ``replica_rule``, or the given ``replica_dispatch``) runs after the broadcast dispatch
        described by ``P_layer`` / ``extra_*``, and its work, streaming and extra holders are
        added to theirs.

        Args:
            layer: MoE layer index.
            token_sets: int64 [B, k] expert sets (batch order), well-formed.
            rng: Generator for the aggregator draws (DES only).
            fidelity: ``"des"`` or ``"analytic"``.
            gamma: γ of the layer (analytic).
            P_layer: Override of the layer's shares (broadcast rows zeroed).
            agg: Aggregators [B] (drawn with ``rng`` when None).
            extra_holders: int64 [B, x] further holders per token (−1 = none).
            extra_compute_s: float [D] dispatched replica work per cluster, seconds.
            extra_stream_s: float [D] replica weight streaming per cluster, seconds.
            extra_s: Other time charged to the layer (broadcast excess), seconds.
            replica_rule: Replica dispatch rule (``dispatch.REPLICA_RULES``), layers with
                replicas only.
            replica_fractions: float [E, 1 + D] per-copy fractions (``replica_rule="shares"``).
            replica_dispatch: A replica dispatch already computed for these inputs (the
                decision evaluator passes it to evaluate the twin on the same decisions).

        Returns:
            The layer's times.

        Raises:
            ConfigError: Unknown fidelity, or ``"analytic"`` without ``gamma``.
        """
        const = self.layers[layer]
        assert const is not None, f"layer {layer} constants were not built"
        conv = self.conv
        rep_key: bytes | None = None
        if const.replicas is not None:
            rep = replica_dispatch if replica_dispatch is not None else self.dispatch_replicas(
                layer, token_sets, rule=replica_rule, P_layer=P_layer,
                extra_compute_s=extra_compute_s, fractions=replica_fractions)
            assert rep is not None
            P_layer = rep.P_layer
            rep_key = P_layer.tobytes()
            extra_compute_s = rep.extra_compute_s if extra_compute_s is None \
                else extra_compute_s + rep.extra_compute_s
            extra_stream_s = rep.extra_stream_s if extra_stream_s is None \
                else extra_stream_s + rep.extra_stream_s
            if rep.extra_holders is not None:
                extra_holders = rep.extra_holders if extra_holders is None \
                    else np.concatenate([extra_holders, rep.extra_holders], axis=1)
        P = const.P if P_layer is None else P_layer
        counts = np.bincount(token_sets.ravel(), minlength=self.num_experts).astype(np.float64)
        compute, mac, stream, weight_bytes, t_compute, t_comp = self.expert_phase(
            layer, counts, P_layer=P_layer, extra_compute_s=extra_compute_s,
            extra_stream_s=extra_stream_s, rep_key=rep_key)
        if P_layer is None and const.is_tp:
            tp = self.tp_allreduce
            hops = energy.allreduce_byte_hops(self.sim.topology, self.psum_msg[0] * self.batch,
                                              tp.algorithm)
            return LayerResult(layer, const.nm_total, const.nm_compute, t_comp, t_compute, 0.0,
                               0.0, tp.time_s, extra_s, compute, stream, None, "tp",
                               tp.algorithm, const.nm_comm, mac, weight_bytes, hops)
        if fidelity == "des":
            if P_layer is None:
                support, holders = const.support, const.holders
            elif rep_key is not None and const.rep_holders is not None \
                    and const.rep_holders[0] == rep_key:
                holders = const.rep_holders[1]
                support = holders.support
            else:
                support = P > 0
                holders = linksim.HolderTable.from_shares(support)
                if rep_key is not None:
                    const.rep_holders = (rep_key, holders)
            partial = const.partial if P_layer is None else partial_shards(P, conv)
            t_d, t_c, t_moe, busy = simulate_moe_comm(
                self.sim, layer, token_sets, self.msg, support, holders, const.pi, rng, agg,
                extra_holders, partial=partial, combine_bytes=self.psum_msg)
            return LayerResult(layer, const.nm_total, const.nm_compute, t_comp, t_compute, t_d,
                               t_c, t_moe, extra_s, compute, stream, busy, "des", "",
                               const.nm_comm, mac, weight_bytes,
                               energy.link_byte_hops(busy, self.sim.topology.link_bw_Bps))
        if fidelity == "analytic":
            if gamma is None:
                raise ConfigError("fidelity='analytic' needs gamma (fit it with "
                                  "hdamoe_env.sim.calibrate.fit_gamma)")
            # replica copies are holders only through extra_holders: count them (layers with
            # replicas only; the broadcast path keeps the paper's V_c of the zeroed shares)
            peak, touched = self._max_touch(token_sets, const, P_layer,
                                            extra_holders if rep_key is not None else None)
            x = conv.kappa_a * (float(self.model.hidden_size) * peak) \
                / self.sim.topology.bw_end_Bps
            t_moe = gamma * x * (2.0 if conv.gamma_combine_only else 1.0)
            return LayerResult(layer, const.nm_total, const.nm_compute, t_comp, t_compute, 0.0,
                               0.0, t_moe, extra_s, compute, stream, None, "analytic", "",
                               const.nm_comm, mac, weight_bytes,
                               self._analytic_byte_hops(touched, token_sets.shape[0]))
        raise ConfigError(f"unknown fidelity {fidelity!r}; expected one of {list(FIDELITIES)}")

    def expert_phase(self, layer: int, counts: NDArray[np.float64], *,
                     P_layer: NDArray[np.float64] | None = None,
                     extra_compute_s: NDArray[np.float64] | None = None,
                     extra_stream_s: NDArray[np.float64] | None = None,
                     rep_key: bytes | None = None
                     ) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64],
                                NDArray[np.float64], float, float]:
        """Return the expert phase of one layer as ``evaluate`` computes it.

        Args:
            layer: MoE layer index.
            counts: float64 [E] tokens per expert of the executed sets.
            P_layer, extra_compute_s, extra_stream_s: As ``evaluate`` (after the replica
                dispatch).
            rep_key: The bytes of the replica-dispatched ``P_layer`` (its cached tile
                matrix), or None.

        Returns:
            ``(compute [D], mac [D], stream [D], weight_bytes [D], t_compute, t_comp)``:
            seconds per node of compute (with the dispatched work), of padded MACs, of weight
            streaming, the weight bytes read per node, max compute and the expert phase t_comp.
        """
        const = self.layers[layer]
        assert const is not None, f"layer {layer} constants were not built"
        conv = self.conv
        P = const.P if P_layer is None else P_layer
        if self.tiled:
            compute, mac = self._tiled_compute(const, P_layer, counts, rep_key)
        else:
            compute = np.einsum("...ed,...e->...d", P, counts) * self.flops_per_s
            mac = compute
        held = np.einsum("...ed,...e->...d", P, (counts > 0).astype(np.float64))
        weight_bytes = held * self.w_bytes
        if conv.weight_streaming:
            stream = held * self.stream_per_s
        else:
            stream = np.zeros_like(compute)
        if extra_compute_s is not None:
            compute = compute + extra_compute_s
            mac = mac + extra_compute_s
        if extra_stream_s is not None:
            weight_bytes = weight_bytes + extra_stream_s * self.eff_mem_bw
            if conv.weight_streaming:
                stream = stream + extra_stream_s
        t_compute = float(compute.max())
        # max_c max(compute_c, stream_c) == max(max_c compute_c, max_c stream_c), exactly
        t_comp = max(t_compute, float(stream.max())) if conv.weight_streaming else t_compute
        return compute, mac, stream, weight_bytes, t_compute, t_comp

    def tp_totals(self, step_sets: NDArray[np.int64], *,
                  counts: NDArray[np.float64] | None = None) -> NDArray[np.float64]:
        """Return the latency [L] of every layer of one decode step under this TP placement.

        Vectorised over layers (one call per decode step, or per batch of decode steps); the
        same terms as ``evaluate`` in its TP branch (t_nm + expert phase + TP all-reduce), up to
        floating-point summation order. Leading batch dimensions give the same numbers as one
        call per decode step (the batched vector env relies on it).

        Args:
            step_sets: int64 [..., L, B, k] expert sets of the step(s).
            counts: float64 [..., L, E] tokens per expert of ``step_sets`` when already
                counted (the batched vector env counts them once per decode step).

        Returns:
            float64 [..., L].

        Raises:
            ConfigError: The placement is not TP in every layer.
        """
        consts = [c for c in self.layers if c is not None]
        if len(consts) != len(self.layers) or not all(
                c.is_tp and is_tensor_parallel(c.P) for c in consts):
            raise ConfigError("tp_totals needs a TP placement in every layer")
        num_layers = step_sets.shape[-3]
        lead = step_sets.shape[:-3]
        groups = int(np.prod(lead, dtype=np.int64)) * num_layers      # (step, layer) pairs
        E = self.num_experts
        if counts is None:
            flat = (step_sets.reshape(groups, -1) + (np.arange(groups) * E)[:, None]).ravel()
            counts = np.bincount(flat, minlength=groups * E).astype(np.float64).reshape(
                *lead, num_layers, E)
        share = consts[0].P[0, 0]
        if self.tiled:  # every node runs m GEMMs (tokens n_i, I/D columns) per active expert
            tile_t = self.conv.tile_tokens
            rows = np.ceil(np.maximum(counts / tile_t - 1e-9, 0.0)) * tile_t
            cols = float(perf.tile_columns(share, self.model, self.conv))
            t_compute = (rows.sum(axis=-1) * cols * self.tile_flop_s
                         + (counts > 0).sum(axis=-1) * self.gemm_s)
        else:
            t_compute = counts.sum(axis=-1) * share * self.flops_per_s       # equal on all nodes
        if self.conv.weight_streaming:
            stream = (counts > 0).sum(axis=-1) * share * self.stream_per_s
            t_comp = np.maximum(t_compute, stream)
        else:
            t_comp = t_compute
        nm = np.array([c.nm_total for c in consts[:num_layers]])
        return nm + t_comp + self.t_tp

    def _analytic_byte_hops(self, touched: float, tokens: int) -> float:
        """Return the estimated byte-hops of the analytic twin's dispatch and combine.

        The twin draws no aggregators and routes no message. [judgement] Every token sends
        one message to each cluster it touches but one (its aggregator), in both phases, over
        the mean hop count of the topology's distinct endpoint pairs (docs/PHYSICS.md §18).
        """
        if self._mean_hops is None:
            hops = self.sim.topology.hop_counts()
            n = hops.shape[0]
            self._mean_hops = float(hops.sum()) / (n * (n - 1)) if n > 1 else 0.0
        messages = max(0.0, touched - tokens)
        return 2.0 * messages * self.sim.msg_bytes * self._mean_hops

    def _tiled_compute(self, const: _LayerConst, P_layer: NDArray[np.float64] | None,
                       counts: NDArray[np.float64], rep_key: bytes | None = None
                       ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return the per-node expert compute [D] of one step under the tile model (PHYSICS.md).

        The same terms as ``perf.tiled_node_compute``: [padded rows, activity] @ [[padded
        columns · m·2h/C], [holder · m·o]], the stacked [2E, D] matrix cached per layer and the
        padded rows read from a table of 0..B tokens. The second array is the padded-MAC part
        alone (padded rows @ padded columns · m·2h/C, the energy model's MAC time).
        """
        if P_layer is None:
            if const.tile_work is None:
                const.tile_work = self._tile_matrix(const.P)
            mat = const.tile_work
        elif rep_key is not None:
            if const.rep_tile_work is None or const.rep_tile_work[0] != rep_key:
                const.rep_tile_work = (rep_key, self._tile_matrix(P_layer))
            mat = const.rep_tile_work[1]
        else:
            mat = self._tile_matrix(P_layer)
        E = self.num_experts
        x = np.empty(2 * E)
        n = counts.astype(np.intp)
        if n.max(initial=0) < self._rows_table.size:
            x[:E] = self._rows_table[n]
        else:  # not reached by top-k sets of B tokens; kept exact for any counts
            tile_t = self.conv.tile_tokens
            x[:E] = np.ceil(counts / tile_t - 1e-9).clip(0.0) * tile_t
        x[E:] = counts > 0
        out: NDArray[np.float64] = x @ mat
        mac: NDArray[np.float64] = x[:E] @ mat[:E]
        return out, mac

    def _tile_matrix(self, P: NDArray[np.float64]) -> NDArray[np.float64]:
        """Return the stacked [2E, D] tile-model matrix of shares ``P`` (``_tiled_compute``)."""
        work = perf.tile_columns(P, self.model, self.conv) * self.tile_flop_s
        return np.vstack([work, (P > 0) * self.gemm_s])

    @staticmethod
    def _max_touch(token_sets: NDArray[np.int64], const: _LayerConst,
                   P_layer: NDArray[np.float64] | None,
                   extra_holders: NDArray[np.int64] | None = None) -> tuple[float, float]:
        """Return max_c |{t : S_t ∩ holders(c) ≠ ∅}| (the sampled V_c / h of Eq. 2) and Σ_c.

        With ``extra_holders`` [B, x] a token also touches its extra holder clusters.
        """
        support = const.support if P_layer is None else P_layer > 0
        masks = const.bitmask if P_layer is None else _bitmask(support)
        if masks is None or extra_holders is not None:
            touch = support[token_sets].any(axis=1)                          # [B, D]
            if extra_holders is not None:
                r, j = np.nonzero(extra_holders >= 0)
                touch[r, extra_holders[r, j]] = True
            per = touch.sum(axis=0)
            return float(per.max(initial=0)), float(per.sum())
        touched = np.bitwise_or.reduce(masks[token_sets], axis=1)          # [B] uint64
        if sys.byteorder != "little":
            touched = touched.byteswap()
        bits = np.unpackbits(touched.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
        per = bits.sum(axis=0, dtype=np.int64)
        return float(per.max(initial=0)), float(per.sum())
