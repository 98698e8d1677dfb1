"""Energy of MoE layers and decode steps: the cost model's joules over the simulator's events.

``EnergyAccount`` turns a ``LayerResult`` (the time model's padded MAC time, weight bytes and
MoE byte-hops) plus the layer's non-MoE term (attention and shared-expert MACs, DRAM bytes of
weights and KV cache, the non-MoE all-reduce) into an ``EnergyBreakdown`` with the functions of
:mod:`hdamoe_env.cost.energy` (docs/PHYSICS.md §18). Static energy is charged over the time the
layer (or step) takes, for every node. Nothing here changes a latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.cost import energy, nonmoe, perf
from hdamoe_env.cost.energy import EnergyBreakdown, EnergySpec
from hdamoe_env.noc import collectives
from hdamoe_env.noc.topology import Topology
from hdamoe_env.sim.evaluator import LayerResult

__all__ = ["EnergyAccount"]


class _Parts(Protocol):
    model: ModelSpec
    hw: HardwareSpec
    conv: Conventions
    topology: Topology

    def nonmoe(self, batch: int, layer: int) -> nonmoe.NonMoeTime: ...

    def tp_allreduce(self, batch: int) -> collectives.AllReduce: ...


class EnergyAccount:
    """Energy of the layers and decode steps of one simulator at one batch size.

    Args:
        sim: The simulator (model, hardware, conventions, topology, non-MoE terms).
        batch: Tokens per decode step B.
        spec: The energy spec; default the profile's (``cost.energy.energy_spec_for``).
    """

    def __init__(self, sim: _Parts, batch: int, spec: EnergySpec | None = None) -> None:
        self.sim = sim
        self.batch = int(batch)
        self.spec = spec if spec is not None else energy.energy_spec_for(sim.conv)
        hw, conv = sim.hw, sim.conv
        self.num_nodes = hw.num_nodes
        self.macs_per_s = hw.compute_flops / 2.0           # one MAC = 2 FLOP (§4.0)
        self.eff_mem_bw = perf.effective_mem_bw(hw, conv)
        spec = self.spec
        # J per byte / byte-hop / MAC / second of all nodes: the multipliers of the pure
        # functions of cost.energy, applied to floats on the env's hot path
        self._k_dram = float(energy.dram_energy_j(1.0, spec))
        self._k_noc = float(energy.noc_energy_j(1.0, spec))
        self._k_mac = float(energy.compute_energy_j(1.0, spec))
        self._p_static = float(energy.static_energy_j(1.0, self.num_nodes, spec))
        self._link_bw = sim.topology.link_bw_Bps
        self._nm: dict[int, EnergyBreakdown] = {}
        self._dense: EnergyBreakdown | None = None
        self._ar_hops: float | None = None

    # ------------------------------------------------------------------ constant parts
    def allreduce_byte_hops(self) -> float:
        """Byte-hops of one all-reduce of B·h·b_psum bytes per node (TP's and the non-MoE one)."""
        if self._ar_hops is None:
            sim = self.sim
            size = float(self.batch) * sim.model.hidden_size * sim.conv.b_psum
            self._ar_hops = energy.allreduce_byte_hops(sim.topology, size,
                                                       sim.tp_allreduce(self.batch).algorithm)
        return self._ar_hops

    def _dynamic(self, nm: nonmoe.NonMoeTime) -> EnergyBreakdown:
        """Dynamic energy of a non-MoE term split evenly over the D nodes."""
        D = self.num_nodes
        macs = float(nm.compute_s) * D * self.macs_per_s
        nbytes = float(nm.memory_s) * D * self.eff_mem_bw
        hops = self.allreduce_byte_hops() if float(nm.comm_s) > 0 else 0.0
        return EnergyBreakdown(float(energy.dram_energy_j(nbytes, self.spec)),
                               float(energy.noc_energy_j(hops, self.spec)),
                               float(energy.compute_energy_j(macs, self.spec)), 0.0)

    def nonmoe(self, layer: int) -> EnergyBreakdown:
        """Dynamic energy of the non-MoE part of MoE layer ``layer`` (attention, shared experts,
        KV reads, non-MoE all-reduce), J (cached)."""
        hit = self._nm.get(layer)
        if hit is None:
            hit = self._nm[layer] = self._dynamic(self.sim.nonmoe(self.batch, layer))
        return hit

    def dense(self) -> EnergyBreakdown:
        """Dynamic energy of the dense leading layers of a step (0 unless charged), J."""
        if self._dense is None:
            sim = self.sim
            n = sim.model.num_dense_layers if sim.conv.dense_layers else 0
            if n == 0:
                self._dense = EnergyBreakdown()
            else:
                one = nonmoe.dense_layer_time(sim.model, sim.hw, sim.conv, self.batch,
                                              sim.topology.bw_end_Bps, sim.topology)
                self._dense = self._dynamic(one).scaled(float(n))
        return self._dense

    # ------------------------------------------------------------------ layers and steps
    def expert(self, res: LayerResult) -> EnergyBreakdown:
        """Dynamic energy of a layer's expert phase and MoE communication, J."""
        nbytes, hops, macs = self._expert_counts(res)
        return EnergyBreakdown(nbytes * self._k_dram, hops * self._k_noc, macs * self._k_mac,
                               0.0)

    def _expert_counts(self, res: LayerResult) -> tuple[float, float, float]:
        """(weight bytes, MoE byte-hops, MACs) of a layer's expert phase and communication."""
        mac_s = res.node_mac_s if res.node_mac_s is not None else res.node_compute_s
        if res.node_weight_bytes is not None:
            nbytes = float(res.node_weight_bytes.sum())
        else:
            nbytes = float(res.node_stream_s.sum()) * self.eff_mem_bw
        if res.noc_byte_hops is not None:
            hops = float(res.noc_byte_hops)
        else:
            hops = energy.link_byte_hops(res.link_busy_s, self._link_bw)
        return nbytes, hops, float(mac_s.sum()) * self.macs_per_s

    def layer(self, res: LayerResult, *, extra_link_busy_s: NDArray[np.float64] | None = None,
              extra_s: float = 0.0) -> EnergyBreakdown:
        """Energy of one MoE layer of one decode step, J.

        Args:
            res: The layer's result.
            extra_link_busy_s: float [num_links] further link busy time charged to the layer
                (the pre-broadcast's, EPLB weight moves), or None.
            extra_s: Further time charged to the layer beyond ``res.total_s`` (static energy).
        """
        nm = self.nonmoe(res.layer)
        nbytes, hops, macs = self._expert_counts(res)
        if extra_link_busy_s is not None:
            hops += energy.link_byte_hops(extra_link_busy_s, self._link_bw)
        return EnergyBreakdown(nm.dram_j + nbytes * self._k_dram, nm.noc_j + hops * self._k_noc,
                               nm.compute_j + macs * self._k_mac,
                               (res.total_s + extra_s) * self._p_static)

    def step(self, layers: Sequence[LayerResult], dense_s: float) -> EnergyBreakdown:
        """Energy of one decode step: every MoE layer, the dense layers and their static, J."""
        out = self.dense() + EnergyBreakdown(static_j=float(energy.static_energy_j(
            dense_s, self.num_nodes, self.spec)))
        for res in layers:
            out = out + self.layer(res)
        return out

    def tp_layers(self, counts: NDArray[np.float64], totals_s: NDArray[np.float64]
                  ) -> NDArray[np.float64]:
        """Total energy [..., L] of every layer under TP (the env's reward reference), J.

        The TP branch of ``LayerEvaluator.evaluate`` in closed form: every node holds 1/D of
        every expert, runs m GEMMs of (padded tokens, padded I/D columns) per active expert,
        streams 1/D of every active expert's weights, and the layer ends with one all-reduce.

        Args:
            counts: float64 [..., L, E] tokens per expert.
            totals_s: float64 [..., L] TP's layer latencies (``LayerEvaluator.tp_totals``).
        """
        sim, spec = self.sim, self.spec
        model, conv = sim.model, sim.conv
        D = self.num_nodes
        active = (counts > 0).sum(axis=-1)
        if conv.tiled:
            tile_t = conv.tile_tokens
            rows = np.ceil(np.maximum(counts / tile_t - 1e-9, 0.0)) * tile_t
            cols = float(perf.tile_columns(1.0 / D, model, conv))
            macs = rows.sum(axis=-1) * cols * D * (conv.expert_matrices * model.hidden_size)
        else:
            macs = counts.sum(axis=-1) * (perf.expert_flops(model, conv) / 2.0)
        nbytes = active * perf.expert_bytes(model, conv)
        L = counts.shape[-2]
        nm = np.array([self.nonmoe(layer).total_j for layer in range(L)])
        dyn = (energy.dram_energy_j(nbytes, spec) + energy.compute_energy_j(macs, spec)
               + float(energy.noc_energy_j(self.allreduce_byte_hops(), spec)))
        out: NDArray[np.float64] = nm + dyn + energy.static_energy_j(totals_s, D, spec)
        return out
