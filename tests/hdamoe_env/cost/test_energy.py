"""Check values of the energy model (docs/PHYSICS.md §18).

One MoE layer of DeepSeek-V2-Lite on the 4×8 mesh at B = 128 (``faithful``), under EP and TP.
Every expected value is written from the formulas of PHYSICS.md §18 and the model's shape, not
from the code under test; only the layer time t_layer (the time model's output) is read back.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.uncertainty import ENERGY_UNCERTAINTIES
from hdamoe_env.cost import energy
from hdamoe_env.cost.energy import EnergyBreakdown, EnergySpec, energy_spec_for
from hdamoe_env.sim.evaluator import LayerEvaluator
from hdamoe_env.sim.placement import Placement, tensor_parallel
from hdamoe_env.sim.simulator import MoESimulator

B = 128
EXPERTS = [0, 2, 4, 6, 8, 10]          # EP: expert e on node e // 2 -> nodes 0..5 of mesh row 0
PJ = 1e-12


@pytest.fixture(scope="module")
def sim() -> MoESimulator:
    return MoESimulator("deepseek-v2-lite", conventions="faithful")


def _sets() -> np.ndarray:
    return np.tile(np.array(EXPERTS, dtype=np.int64), (B, 1))


def _ep(sim: MoESimulator) -> Placement:
    L, E, D = sim.model.num_moe_layers, sim.model.num_experts, sim.hw.num_nodes
    P = np.zeros((L, E, D))
    P[:, np.arange(E), np.arange(E) // 2] = 1.0
    pi = np.tile(np.arange(D), (L, 1))
    return Placement(P=P, pi=pi, method="ep-test")


def _nonmoe(sim: MoESimulator) -> tuple[float, float]:
    """(FLOP_nm, bytes_nm) of a full-attention MoE layer, paper-model.md §5.3.4 / PHYSICS §13."""
    m, conv = sim.model, sim.conv
    h, ctx = float(m.hidden_size), float(conv.nonmoe_ctx_len)
    flops = B * (2 * m.attn_weight_elements + m.core_flops_per_ctx_token * ctx
                 + 6 * h * m.shared_intermediate)
    nbytes = conv.b_w * (m.attn_weight_elements + 3 * h * m.shared_intermediate) \
        + B * ctx * m.kv_elements_per_token * 2
    return flops, nbytes


def _allreduce_hops_4x8(size: float) -> float:
    """Σ n·H of ring2d on the 4×8 mesh (PHYSICS.md §3): folded row rings (8 nodes, 14 hops per
    step, 4 rows, 2·7 steps of S/8) then folded column rings (4 nodes, 6 hops, 8 columns,
    2·3 steps of S/32)."""
    return 14 * (size / 8) * (4 * 14) + 6 * (size / 32) * (8 * 6)


def test_spec_per_profile_and_derive():
    for name in ("faithful", "paper", "paper-hd", "faithful+tile_tokens=1"):
        spec = energy_spec_for(name)
        assert isinstance(spec, EnergySpec)
    d = energy_spec_for("faithful", mac_pj=0.2)
    assert d.mac_pj == 0.2 and d.name == "faithful+mac_pj=0.2"
    with pytest.raises(ConfigError):
        energy_spec_for("faithful", nope=1)
    with pytest.raises(ConfigError):
        EnergySpec(mac_pj=-1.0)
    with pytest.raises(ConfigError):
        energy_spec_for("nonsense")
    import dataclasses

    from hdamoe_env.config.profiles import PROFILES
    own = dataclasses.replace(PROFILES["paper"], name="mine")
    assert energy_spec_for(own).mac_pj == EnergySpec().mac_pj
    for knob, u in ENERGY_UNCERTAINTIES.items():       # every default inside its range
        assert u.low <= getattr(EnergySpec(), knob) <= u.high


def test_pure_functions():
    spec = EnergySpec(dram_pj_per_bit=1.0, noc_pj_per_bit_hop=2.0, mac_pj=3.0,
                      static_w_per_node=4.0)
    assert energy.dram_energy_j(1e6, spec) == pytest.approx(8e6 * 1.0 * PJ)
    assert energy.noc_energy_j(1e6, spec) == pytest.approx(8e6 * 2.0 * PJ)
    assert energy.compute_energy_j(1e6, spec) == pytest.approx(1e6 * 3.0 * PJ)
    assert energy.static_energy_j(1e-3, 32, spec) == pytest.approx(1e-3 * 32 * 4.0)
    e = EnergyBreakdown(1.0, 2.0, 3.0, 4.0)
    assert e.total_j == 10.0 and (e + e).to_dict()["total"] == 20.0
    assert e.scaled(0.5).noc_j == 1.0


def test_allreduce_byte_hops_ring2d(sim):
    size = B * 2048 * 4.0
    got = energy.allreduce_byte_hops(sim.topology, size, "ring2d")
    assert got == pytest.approx(_allreduce_hops_4x8(size), rel=1e-12)
    # a ring over a Hamiltonian cycle: every message one hop, 2(p-1) steps of S/p from p nodes
    assert energy.allreduce_byte_hops(sim.topology, size, "ring") == pytest.approx(
        2 * 31 * size, rel=1e-12)
    assert energy.allreduce_byte_hops(sim.topology, size, "const") == pytest.approx(
        2 * 31 * size, rel=1e-12)
    with pytest.raises(ConfigError):
        energy.allreduce_byte_hops(sim.topology, size, "tree")


def _check(sim, res, *, macs_expert, bytes_expert, hops_moe):
    spec = energy_spec_for("faithful")
    acct = sim.energy_account(B)
    got = acct.layer(res)
    m, D = sim.model, sim.hw.num_nodes
    flops_nm, bytes_nm = _nonmoe(sim)
    size = B * m.hidden_size * sim.conv.b_psum
    assert sim.tp_allreduce(B).algorithm == "ring2d"       # PHYSICS.md §3, with ports
    hops_nm = _allreduce_hops_4x8(size)                    # the non-MoE all-reduce
    assert got.dram_j == pytest.approx(8 * spec.dram_pj_per_bit * PJ
                                       * (bytes_expert + bytes_nm), rel=1e-9)
    assert got.noc_j == pytest.approx(8 * spec.noc_pj_per_bit_hop * PJ * (hops_moe + hops_nm),
                                      rel=1e-9)
    assert got.compute_j == pytest.approx(spec.mac_pj * PJ * (macs_expert + flops_nm / 2),
                                          rel=1e-9)
    assert got.static_j == pytest.approx(spec.static_w_per_node * D * res.total_s, rel=1e-12)
    return got


def test_one_layer_ep(sim):
    ev = LayerEvaluator(sim, _ep(sim), B, layers=[0])
    res = ev.evaluate(0, _sets(), rng=np.random.default_rng(0),
                      agg=np.zeros(B, dtype=np.int64))
    m, conv = sim.model, sim.conv
    W_e = conv.expert_matrices * m.hidden_size * m.expert_intermediate * conv.b_w
    # 6 whole experts, 128 tokens each: rows 128 (multiple of 8), columns 1408 (multiple of 8)
    macs = 6 * 128 * 1408 * conv.expert_matrices * m.hidden_size
    # aggregator node 0 -> holders 1..5 of mesh row 0 (1+2+3+4+5 = 15 hops), dispatch + combine,
    # h·b_msg bytes per token and message (whole experts: no partial sums)
    hops = B * 2 * 15 * m.hidden_size * conv.b_msg
    got = _check(sim, res, macs_expert=macs, bytes_expert=6 * W_e, hops_moe=hops)
    assert got.total_j > 0


def test_one_layer_tp(sim):
    L, E, D = sim.model.num_moe_layers, sim.model.num_experts, sim.hw.num_nodes
    ev = LayerEvaluator(sim, tensor_parallel(L, E, D), B, layers=[0])
    res = ev.evaluate(0, _sets(), rng=np.random.default_rng(0))
    m, conv = sim.model, sim.conv
    W_e = conv.expert_matrices * m.hidden_size * m.expert_intermediate * conv.b_w
    # every node: I/D = 44 columns padded to 48 (T_c = 8), 128 rows, per active expert
    cols = math.ceil(m.expert_intermediate / D / 8) * 8
    assert cols == 48
    macs = 6 * 128 * cols * D * conv.expert_matrices * m.hidden_size
    size = B * m.hidden_size * conv.b_psum
    got = _check(sim, res, macs_expert=macs, bytes_expert=6 * W_e,
                 hops_moe=_allreduce_hops_4x8(size))
    # padding: TP's MACs exceed EP's by 48/44 on the expert phase
    assert macs / (6 * 128 * 1408 * conv.expert_matrices * m.hidden_size) == pytest.approx(
        48 / 44)
    # the closed form of the env's reward reference equals the evaluator's account
    counts = np.bincount(_sets().ravel(), minlength=E).astype(np.float64)
    ref = sim.energy_account(B).tp_layers(counts[None, :], np.array([res.total_s]))
    assert ref[0] == pytest.approx(got.total_j, rel=1e-9)


def test_step_energy_sums_layers_and_dense(sim):
    L, E, D = sim.model.num_moe_layers, sim.model.num_experts, sim.hw.num_nodes
    sets = np.tile(_sets()[None], (L, 1, 1))
    step = sim.step(tensor_parallel(L, E, D), sets, rng=np.random.default_rng(0))
    assert step.energy is not None
    acct = sim.energy_account(B)
    layers = sum((acct.layer(r) for r in step.layers), EnergyBreakdown())
    expect = layers + acct.dense() + EnergyBreakdown(
        static_j=acct.spec.static_w_per_node * D * step.dense_s)
    assert step.energy.total_j == pytest.approx(expect.total_j, rel=1e-12)
    # static energy covers the whole step
    assert step.energy.static_j == pytest.approx(acct.spec.static_w_per_node * D * step.tbt_s,
                                                 rel=1e-12)
