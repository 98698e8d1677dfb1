"""MoE decode-step simulator: composes the closed forms of ``perf`` with the NoC DES of ``linksim``.

The per-layer sampled evaluator (one implementation, cached constants) is
``hdamoe_env.sim.evaluator.LayerEvaluator``; ``MoESimulator.layer_sampled`` is its validating
public entry and ``MoESimulator.step`` runs it over all layers. Layers under online decisions
(gating, pre-broadcast, dispatch) are evaluated by ``hdamoe_env.sim.online.DecisionEvaluator``
(``MoESimulator.decision_evaluator``).

Implements paper-model.md §5.1 (serial composition TBT = Σ_l [t_nm(l) + t_comp(l) +
t_comm_moe(l)]), §5.4 (communication by placement type), §5.7 (static and sampled evaluators) and
§5.8 (outputs). The simulator knows nothing of RL (style.md R1): it takes a placement, routing and
optional per-layer decisions (broadcast experts, dispatch nodes) and returns frozen results.

Fidelity: ``"des"`` (default) simulates the MoE messages on every directed link; ``"analytic"``
uses the γ-calibrated estimator of Eq. 2–3 instead (γ per layer from ``calibrate``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.cost import nonmoe
from hdamoe_env.noc import collectives
from hdamoe_env.cost import perf
from hdamoe_env.decisions.dispatch import REPLICA_RULES
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.sim.evaluator import (
    FIDELITIES,
    LayerEvaluator,
    LayerResult,
    is_tensor_parallel,
    partial_shards,
    simulate_moe_comm,
)
from hdamoe_env.sim.online import DecisionEvaluator
from hdamoe_env.sim.placement import Placement, check_memory
from hdamoe_env.config.profiles import Conventions, get_profile
from hdamoe_env.config.specs import HardwareSpec, ModelSpec, TopologySpec, get_model
from hdamoe_env.noc.topology import Topology, make_topology
from traces import RoutingTrace, batching

__all__ = [
    "FIDELITIES",
    "Evaluation",
    "LayerEvaluator",
    "LayerResult",
    "MoESimulator",
    "StepResult",
    "check_trace",
    "evaluate_sampled",
    "evaluate_static",
    "is_tensor_parallel",
    "make_steps",
]

@dataclass(frozen=True)
class StepResult:
    """One decode step through all MoE layers.

    Attributes:
        layers: One ``LayerResult`` per MoE layer.
        dense_s: Time of dense leading layers (DeepSeek layer 0 in ``faithful``), 0 otherwise.
        meta: Profile, evaluator, placement method and seeds that produced the numbers.
    """

    layers: tuple[LayerResult, ...]
    dense_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tbt_s(self) -> float:
        """Time between tokens: Σ_l layer latency + dense layers."""
        return self.dense_s + sum(r.total_s for r in self.layers)

    def breakdown(self) -> dict[str, float]:
        """Return Σ compute, Σ communication and Σ exposed memory time in seconds."""
        return {
            "compute_s": sum(r.compute_s for r in self.layers) + self.dense_s,
            "communication_s": sum(r.t_comm_moe_s + r.t_nm_comm_s for r in self.layers),
            "memory_s": sum(r.memory_s for r in self.layers),
            "other_s": sum(r.t_extra_s for r in self.layers),
        }


class MoESimulator:
    """Latency model of MoE decode steps on a 3D-NMP chip.

    Args:
        model: Model preset id or spec.
        hw: Hardware spec (mesh shape, compute, link and DRAM bandwidth, hop latency).
        topology: Topology kind or spec (``"mesh"``, ``"torus"``, ``"fattree"``).
        conventions: Profile name or ``Conventions`` (``"faithful"`` default).
    """

    def __init__(self, model: str | ModelSpec, hw: HardwareSpec | None = None,
                 topology: str | TopologySpec = "mesh",
                 conventions: str | Conventions = "faithful") -> None:
        self.model = get_model(model)
        self.hw = hw if hw is not None else HardwareSpec()
        self.topology_spec = topology if isinstance(topology, TopologySpec) else TopologySpec(
            kind=topology)
        self.conv = get_profile(conventions)
        self.topology: Topology = make_topology(self.topology_spec, self.hw)
        self.num_nodes = self.hw.num_nodes
        self.msg_bytes = float(self.model.hidden_size * self.conv.b_msg)
        self._nm_cache: dict[tuple[int, int], nonmoe.NonMoeTime] = {}

    # --------------------------------------------------------------------------- metadata
    def describe(self) -> dict[str, Any]:
        """Return the configuration (model, hardware, topology, conventions) as a dict."""
        return {"model": self.model.key, "hardware": self.hw.to_dict(),
                "topology": self.topology_spec.to_dict(), "conventions": self.conv.to_dict()}

    def check_placement(self, placement: Placement) -> None:
        """Validate a placement against this model and hardware.

        Checks shapes, shares, mappings and the tile grid of the profile (every share a whole
        number of ``tile_cols / I`` units, uniform TP rows exempt: ``check_tile_grid``), and —
        when the hardware sets ``node_dram_gib`` — that every node's expert weights plus its even
        share of the non-expert weights fit.

        Raises:
            ConfigError: Shape or share problems, or a share off the tile grid.
            InfeasibleError: A node's weights exceed its DRAM capacity (message has the numbers).
        """
        placement.validate(self.model, self.hw, self.conv)
        if self.hw.node_dram_bytes is not None:
            check_memory(placement, self.model, self.hw, self.conv,
                         reserved_bytes=self.nonexpert_weight_bytes_per_node())

    def check_replacement(self, new: object) -> Placement:
        """Validate ``new`` as a placement that replaces the current one mid-run (a rebalance).

        Args:
            new: The replacement; it must be a ``Placement`` of this model and mesh.

        Returns:
            ``new``, validated by ``check_placement``.

        Raises:
            ConfigError: Not a ``Placement``, or shape, share or tile-grid problems.
            InfeasibleError: A node's weights exceed its DRAM capacity.
        """
        if not isinstance(new, Placement):
            raise ConfigError(f"replace_placement needs a Placement, got {type(new).__name__}")
        self.check_placement(new)
        return new

    def nonexpert_weight_bytes_per_node(self) -> float:
        """Return attention, shared-expert and dense-layer weight bytes per node (split over D)."""
        m = self.model
        per_layer = m.attn_weight_elements + 3 * m.hidden_size * m.shared_intermediate
        dense = m.num_dense_layers * (m.attn_weight_elements + 3 * m.hidden_size
                                      * m.dense_intermediate)
        return (m.num_moe_layers * per_layer + dense) * self.conv.b_w / self.num_nodes

    # --------------------------------------------------------------------------- pieces
    def nonmoe(self, batch: int, layer: int) -> nonmoe.NonMoeTime:
        """Return the non-MoE term of MoE layer ``layer`` at batch ``batch`` (cached)."""
        key = (batch, layer if self.conv.nonmoe == "arch" else 0)
        hit = self._nm_cache.get(key)
        if hit is None:
            hit = nonmoe.nonmoe_time(self.model, self.hw, self.conv, batch, layer,
                                     self.topology.bw_end_Bps, self.topology)
            self._nm_cache[key] = hit
        return hit

    def tp_allreduce(self, batch: int) -> collectives.AllReduce:
        """Return TP's all-reduce of one MoE layer at batch ``batch`` (§5.6, docs/PHYSICS.md).

        ``tp_allreduce="best"`` (``faithful``): the fastest of ``collectives.ALGORITHMS`` for
        B·h·b_psum bytes, simulated on the DES with α = ``msg_alpha_s`` per step, the hop
        latency and the profile's ``switching``, ``ni_ports`` and ``ni_latency_hops`` (cached
        per size in ``collectives``). ``"ring"`` and ``"const"`` use the closed forms of
        ``perf.tp_allreduce_time`` (``paper*``: ``"const"``).
        """
        conv = self.conv
        if conv.tp_allreduce != "best":
            t = float(perf.tp_allreduce_time(self.model, self.hw, conv, batch,
                                             self.topology.bw_end_Bps))
            return collectives.AllReduce(t, conv.tp_allreduce, {conv.tp_allreduce: t})
        size = float(batch) * self.model.hidden_size * conv.b_psum
        return collectives.best_allreduce(self.topology, size, alpha_s=conv.msg_alpha_s,
                                          hop_latency_s=self.hw.hop_latency_for(conv),
                                          switching=conv.switching,
                                          ni_bw_Bps=conv.ni_bw_for(self.topology.bw_end_Bps),
                                          ni_latency_s=conv.ni_latency_for(
                                              self.hw.hop_latency_for(conv)))

    def dense_time(self, batch: int) -> float:
        """Return the time of the dense leading layers per step (0 unless ``faithful``)."""
        if not self.conv.dense_layers or self.model.num_dense_layers == 0:
            return 0.0
        return self.model.num_dense_layers * nonmoe.dense_layer_time(
            self.model, self.hw, self.conv, batch, self.topology.bw_end_Bps,
            self.topology).total_s

    def _compute(self, P_layer: NDArray[np.float64], tokens: NDArray[np.float64],
                 active: NDArray[np.float64], extra_compute_s: NDArray[np.float64] | None,
                 extra_stream_s: NDArray[np.float64] | None,
                 ) -> tuple[float, float, NDArray[np.float64], NDArray[np.float64]]:
        compute, stream = perf.expert_compute_times(P_layer, tokens, self.model, self.hw,
                                                    self.conv, active)
        if extra_compute_s is not None:
            compute = compute + extra_compute_s
        if extra_stream_s is not None and self.conv.weight_streaming:
            stream = stream + extra_stream_s
        t_compute = float(compute.max())
        t_comp = float(np.maximum(compute, stream).max()) if self.conv.weight_streaming \
            else t_compute
        return t_comp, t_compute, compute, stream

    # --------------------------------------------------------------------------- layers
    def layer_sampled(self, placement: Placement, layer: int, token_sets: NDArray[np.int64], *,
                      rng: np.random.Generator, fidelity: str = "des",
                      gamma: float | None = None, P_layer: NDArray[np.float64] | None = None,
                      agg: NDArray[np.int64] | None = None,
                      extra_holders: NDArray[np.int64] | None = None,
                      extra_compute_s: NDArray[np.float64] | None = None,
                      extra_stream_s: NDArray[np.float64] | None = None,
                      extra_s: float = 0.0, replica_rule: str = "least_loaded",
                      replica_fractions: NDArray[np.float64] | None = None) -> LayerResult:
        """Simulate one MoE layer of one concrete decode step (per-token task set, §5.7).

        A placement with redundant experts (``Placement.replicas``) has the tokens of every
        replicated expert dispatched to one copy each by ``replica_rule``
        (``dispatch.dispatch_replicas``), after any broadcast described by ``P_layer`` and the
        ``extra_*`` arguments.

        Args:
            placement: Placement (``P[layer]`` and ``pi[layer]`` are used).
            layer: MoE layer index.
            token_sets: int [B, k] expert ids of the step's tokens (batch order).
            rng: Generator for aggregator draws.
            fidelity: ``"des"`` or ``"analytic"`` (needs ``gamma``).
            gamma: Calibration slope γ of this layer for the analytic twin.
            P_layer: Override of ``P[layer]`` (e.g. broadcast rows zeroed), float [E, D].
            agg: Aggregator cluster per token, int [B] (drawn with ``rng`` when None).
            extra_holders: int [B, x] further source clusters per token (-1 = none).
            extra_compute_s: float [D] extra expert FLOP time per cluster (dispatch of replicas).
            extra_stream_s: float [D] extra weight-streaming time per cluster.
            extra_s: Other time charged to the layer.
            replica_rule: ``dispatch.REPLICA_RULES`` entry (layers with replicas).
            replica_fractions: float [E, 1 + D] per-copy fractions (``replica_rule="shares"``).

        Returns:
            The layer's latency and per-node / per-link details.

        Raises:
            ConfigError: Bad sets, an unknown replica rule, or zeroed rows without their work.
        """
        token_sets = self._check_sets(token_sets, "token_sets", 2)
        if replica_rule not in REPLICA_RULES:
            raise unknown_name("replica rule", replica_rule, REPLICA_RULES)
        if extra_compute_s is None and P_layer is not None:
            # Rows zeroed by a caller without compensating work would silently drop FLOPs.
            counts = np.bincount(token_sets.ravel(), minlength=self.model.num_experts)
            if counts[np.asarray(P_layer).sum(axis=1) <= 0].sum() > 0:
                raise ConfigError("P_layer has experts without holders that tokens use; pass "
                                  "their work via extra_compute_s")
        evaluator = LayerEvaluator(self, placement, token_sets.shape[0], layers=(layer,))
        return evaluator.evaluate(layer, token_sets, rng=rng, fidelity=fidelity, gamma=gamma,
                                  P_layer=P_layer, agg=agg, extra_holders=extra_holders,
                                  extra_compute_s=extra_compute_s,
                                  extra_stream_s=extra_stream_s, extra_s=extra_s,
                                  replica_rule=replica_rule,
                                  replica_fractions=replica_fractions)

    def decision_evaluator(self, placement: Placement, batch: int, **kwargs: Any
                           ) -> DecisionEvaluator:
        """Return a ``DecisionEvaluator`` (online decisions, §10–11); kwargs as its class."""
        return DecisionEvaluator(self, placement, batch, **kwargs)

    def evaluator(self, placement: Placement, batch: int) -> LayerEvaluator:
        """Return the cached-constant evaluator of ``placement`` at batch ``batch``.

        The fast path for callers that evaluate many layers of one placement (the env, the
        online agents' harnesses): ``LayerEvaluator.evaluate`` does not validate its inputs.
        """
        return LayerEvaluator(self, placement, batch)

    def _check_sets(self, sets: NDArray[np.int64], name: str, ndim: int) -> NDArray[np.int64]:
        """Return ``sets`` as int64 after checking its shape [..., k] and its expert ids."""
        arr = np.asarray(sets, dtype=np.int64)
        if arr.ndim != ndim or arr.shape[-1] != self.model.top_k:
            want = "[B, k" if ndim == 2 else "[L, B, k"
            raise ConfigError(f"{name} must have shape {want}={self.model.top_k}], got "
                              f"{arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.model.num_experts):
            raise ConfigError(f"{name} holds expert ids in [{arr.min()}, {arr.max()}]; expected "
                              f"0 <= id < E = {self.model.num_experts}")
        return arr

    def layer_static(self, placement: Placement, layer: int, freqs: NDArray[np.float64],
                     groups: NDArray[np.int64], group_freqs: NDArray[np.float64], batch: int, *,
                     rng: np.random.Generator, agg: NDArray[np.int64] | None = None,
                     P_layer: NDArray[np.float64] | None = None) -> LayerResult:
        """Evaluate one MoE layer with expected loads (static evaluator, §5.7).

        Args:
            placement: Placement.
            layer: MoE layer index.
            freqs: float [E] activation frequency f_i (Σ = k).
            groups: int [G, k] distinct sorted expert sets of the layer.
            group_freqs: float [G] their frequencies f_g (Σ = 1).
            batch: Batch size B.
            rng: Generator for aggregator draws.
            agg: Aggregator cluster per group (drawn when None).
            P_layer: Override of ``P[layer]``.

        Raises:
            ConfigError: The placement has redundant experts (``Placement.replicas``): the
                static evaluator has no expected-value model of the replica dispatch.
        """
        _refuse_static_replicas(placement)
        P = placement.P[layer] if P_layer is None else P_layer
        freqs = np.asarray(freqs, dtype=np.float64)
        tokens = freqs * batch
        active = perf.expected_active(freqs, batch)
        t_comp, t_compute, compute, stream = self._compute(P, tokens, active, None, None)
        nm = self.nonmoe(batch, layer)
        if is_tensor_parallel(P) or (P_layer is None and placement.is_allreduce(layer)):
            tp = self.tp_allreduce(batch)
            return LayerResult(layer, nm.total_s, nm.compute_s, t_comp, t_compute, 0.0, 0.0,
                               tp.time_s, 0.0, compute, stream, None, "tp", tp.algorithm,
                               float(nm.comm_s))
        groups = np.asarray(groups, dtype=np.int64)
        msg = np.asarray(group_freqs, dtype=np.float64) * batch * self.msg_bytes
        support = P > 0
        psum = msg * (self.conv.b_psum / self.conv.b_msg)   # partial-sum combine (§2)
        t_d, t_c, t_moe, busy = simulate_moe_comm(self, layer, groups, msg, support, support,
                                                  placement.pi[layer], rng, agg, None,
                                                  partial=partial_shards(P, self.conv),
                                                  combine_bytes=psum)
        return LayerResult(layer, nm.total_s, nm.compute_s, t_comp, t_compute, t_d, t_c, t_moe,
                           0.0, compute, stream, busy, "des", "", float(nm.comm_s))

    # --------------------------------------------------------------------------- steps
    def step(self, placement: Placement, step_sets: NDArray[np.int64], *,
             rng: np.random.Generator, fidelity: str = "des",
             gammas: Sequence[float] | None = None,
             replica_rule: str = "least_loaded") -> StepResult:
        """Simulate one decode step through every MoE layer (no online decisions).

        Args:
            placement: Placement of all layers.
            step_sets: int [L, B, k] expert sets of the step's tokens per layer.
            rng: Generator for aggregator draws.
            fidelity: ``"des"`` or ``"analytic"``.
            gammas: γ per layer for the analytic twin.
            replica_rule: Dispatch rule of redundant experts (``dispatch.REPLICA_RULES``
                without ``"shares"``, which needs per-step fractions); placements with
                ``replicas`` only.

        Raises:
            ConfigError: Bad sets or an unknown replica rule.
        """
        if replica_rule not in REPLICA_RULES or replica_rule == "shares":
            raise unknown_name("replica rule of a whole step", replica_rule,
                               [r for r in REPLICA_RULES if r != "shares"])
        step_sets = np.asarray(step_sets)
        if step_sets.shape[0] != self.model.num_moe_layers:
            raise ConfigError(f"step_sets has {step_sets.shape[0]} layers, model "
                              f"{self.model.key!r} has {self.model.num_moe_layers}")
        step_sets = self._check_sets(step_sets, "step_sets", 3)
        evaluator = LayerEvaluator(self, placement, step_sets.shape[1])
        layers = tuple(
            evaluator.evaluate(layer, step_sets[layer], rng=rng, fidelity=fidelity,
                               gamma=None if gammas is None else float(gammas[layer]),
                               replica_rule=replica_rule)
            for layer in range(self.model.num_moe_layers))
        meta: dict[str, Any] = {"evaluator": "sampled", "fidelity": fidelity,
                                "placement": placement.method}
        if placement.has_replicas:
            meta["replica_rule"] = replica_rule
        return StepResult(layers, self.dense_time(step_sets.shape[1]), meta)

    def static(self, placement: Placement, layer_stats: Iterable[tuple[NDArray[np.float64],
               NDArray[np.int64], NDArray[np.float64]]], batch: int, *,
               rng: np.random.Generator) -> StepResult:
        """Evaluate a whole step with the static evaluator.

        Args:
            placement: Placement of all layers.
            layer_stats: Per layer ``(f_i [E], groups [G, k], f_g [G])``.
            batch: Batch size B.
            rng: Generator for aggregator draws.
        """
        layers = tuple(self.layer_static(placement, layer, f, g, fg, batch, rng=rng)
                       for layer, (f, g, fg) in enumerate(layer_stats))
        if len(layers) != self.model.num_moe_layers:
            raise ConfigError(f"layer_stats gives {len(layers)} layers, model has "
                              f"{self.model.num_moe_layers}")
        return StepResult(layers, self.dense_time(batch),
                          {"evaluator": "static", "fidelity": "des",
                           "placement": placement.method})


# ------------------------------------------------------------------------------- trace evaluation
@dataclass(frozen=True)
class Evaluation:
    """Mean latency of a placement over the steps of a trace.

    Attributes:
        method: Placement method name.
        evaluator: ``"static"`` or ``"sampled"``.
        tbt_s: Mean TBT over steps.
        tbt_std_s: Standard deviation of TBT over steps (0 for static).
        layer_means: Per layer the mean of every ``LayerResult`` time field (seconds).
        breakdown: Mean compute / communication / memory / other seconds per step.
        steps: Number of steps evaluated.
        link_busy_s: float [num_links] mean busy time per directed link per step (all layers).
        meta: Seeds, profile, trace id.
    """

    method: str
    evaluator: str
    tbt_s: float
    tbt_std_s: float
    layer_means: dict[str, NDArray[np.float64]]
    breakdown: dict[str, float]
    steps: int
    link_busy_s: NDArray[np.float64]
    meta: dict[str, Any]


_LAYER_FIELDS = ("t_nm_s", "t_comp_s", "t_dispatch_s", "t_combine_s", "t_comm_moe_s",
                 "t_extra_s", "total_s", "compute_s", "memory_s", "balancedness")


def _summarise(method: str, evaluator: str, results: list[StepResult], num_links: int,
               meta: dict[str, Any]) -> Evaluation:
    tbts = np.array([r.tbt_s for r in results])
    layer_means = {name: np.array([[getattr(lr, name) for lr in r.layers] for r in results])
                   .mean(axis=0) for name in _LAYER_FIELDS}
    keys = results[0].breakdown().keys()
    breakdown = {k: float(np.mean([r.breakdown()[k] for r in results])) for k in keys}
    busy = np.zeros(num_links)
    for r in results:
        for lr in r.layers:
            if lr.link_busy_s is not None:
                busy += lr.link_busy_s
    return Evaluation(method, evaluator, float(tbts.mean()), float(tbts.std()), layer_means,
                      breakdown, len(results), busy / len(results), meta)


def _refuse_static_replicas(placement: Placement) -> None:
    """Raise the ConfigError of the static evaluator for placements with redundant experts."""
    if placement.has_replicas:
        raise ConfigError(
            f"placement {placement.method!r} has redundant expert copies (replicas); the "
            "static (expected-value) evaluator does not model the replica dispatch — evaluate "
            "it with the sampled evaluator (evaluate_sampled / MoESimulator.step, CLI "
            "--evaluator sampled), which dispatches every token to one copy")


def _tp_meta(sim: MoESimulator, batch: int) -> dict[str, Any]:
    """Return the TP all-reduce charged per layer at ``batch``: algorithm and times in µs."""
    tp = sim.tp_allreduce(batch)
    return {"algorithm": tp.algorithm, "time_us": tp.time_s * 1e6,
            "times_us": {k: v * 1e6 for k, v in tp.times_s.items()}}


def check_trace(sim: MoESimulator, trace: RoutingTrace) -> None:
    """Check that a trace fits the simulator's model (L, E, k).

    Raises:
        ConfigError: The trace was recorded for another model shape.
    """
    model = sim.model
    L, _, k = trace.topk_ids.shape
    E = trace.num_experts
    if (L, E, k) != (model.num_moe_layers, model.num_experts, model.top_k):
        raise ConfigError(f"trace has L={L}, E={E}, k={k} but model {model.key!r} has "
                          f"L={model.num_moe_layers}, E={model.num_experts}, k={model.top_k}; "
                          "use a trace of this model (or --trace synthetic)")


def evaluate_static(sim: MoESimulator, placement: Placement, trace: RoutingTrace, batch: int,
                    *, seed: int = 0, view: str = "content") -> Evaluation:
    """Evaluate a placement with the static evaluator on a trace's long-term statistics.

    Args:
        sim: Simulator.
        placement: Placement of all layers.
        trace: Routing trace of the simulator's model.
        batch: Batch size B.
        seed: Seed of the aggregator draws.
        view: Trace view (``"content"``, ``"unique"``, ``"raw"``).
    """
    check_trace(sim, trace)
    sim.check_placement(placement)
    _refuse_static_replicas(placement)
    rows = trace.view(view)
    stats = [(trace.layer_frequencies(layer, rows), *trace.groups(layer, rows))
             for layer in range(sim.model.num_moe_layers)]
    result = sim.static(placement, stats, batch, rng=np.random.default_rng(seed))
    meta = {"seed": seed, "view": view, "trace_id": trace.trace_id, "batch": batch,
            **sim.describe(), "tp_allreduce": _tp_meta(sim, batch)}
    return _summarise(placement.method, "static", [result], sim.topology.num_links, meta)


def evaluate_sampled(sim: MoESimulator, placement: Placement, trace: RoutingTrace, batch: int,
                     *, steps: int = 16, seed: int = 0, mode: str = "streams",
                     view: str = "content", fidelity: str = "des",
                     gammas: Sequence[float] | None = None,
                     progress: Any = None, replica_rule: str = "least_loaded") -> Evaluation:
    """Evaluate a placement on concrete decode steps formed from a trace (traces.md §6).

    Args:
        sim: Simulator.
        placement: Placement of all layers.
        trace: Routing trace of the simulator's model.
        batch: Batch size B.
        steps: Number of decode steps.
        seed: Run seed: spawns the batching stream and the aggregator stream.
        mode: Batching mode (``"streams"`` or ``"random_rows"``).
        view: Trace view.
        fidelity: ``"des"`` or ``"analytic"``.
        gammas: γ per layer (analytic fidelity).
        progress: Optional callable wrapping the step iterator (e.g. ``tqdm``).
        replica_rule: Dispatch rule of redundant experts (placements with ``replicas``).
    """
    check_trace(sim, trace)
    sim.check_placement(placement)
    batch_ss, agg_ss = np.random.SeedSequence(seed).spawn(2)
    step_rows = make_steps(trace, batch, steps, np.random.default_rng(batch_ss), mode=mode,
                           view=view)
    agg_rng = np.random.default_rng(agg_ss)
    ids = trace.topk_ids
    iterator = progress(step_rows) if progress is not None else step_rows
    results = [sim.step(placement, ids[:, rows, :], rng=agg_rng, fidelity=fidelity,
                        gammas=gammas, replica_rule=replica_rule) for rows in iterator]
    meta = {"seed": seed, "view": view, "mode": mode, "trace_id": trace.trace_id,
            "batch": batch, "fidelity": fidelity, **sim.describe(),
            "tp_allreduce": _tp_meta(sim, batch)}
    if placement.has_replicas:
        meta["replica_rule"] = replica_rule
    return _summarise(placement.method, "sampled", results, sim.topology.num_links, meta)


def make_steps(trace: RoutingTrace, batch: int, steps: int, rng: np.random.Generator, *,
               mode: str = "streams", view: str = "content") -> NDArray[np.int64]:
    """Return int [steps, B] row indices of decode steps (traces.md §6).

    Raises:
        ConfigError: Unknown batching mode or a trace too small for the request.
    """
    if mode not in batching.BATCH_MODES or mode == "random_rows_per_layer":
        raise ConfigError(f"unknown batching mode {mode!r}; expected one of "
                          f"{sorted(set(batching.BATCH_MODES) - {'random_rows_per_layer'})}")
    try:
        it = batching.make_steps(mode, trace, batch, rng, n_steps=steps, view=view)
        return batching.take(it, steps)
    except ValueError as exc:
        raise ConfigError(f"cannot form {steps} decode steps of B={batch} ({mode}): {exc}"
                          ) from None
