"""Tests of hdamoe_env.noc.collectives: TP all-reduce algorithms on the DES (paper-model.md §5.6),
and the ring all-reduce on the default one-hop ring.

Hand-worked values (docs/PHYSICS.md α–β model), 4×8 mesh, 50 GB/s per directed link, B = 128,
hop latency 2 ns. The all-reduced size is S = B·h·b_psum: DeepSeek-V2-Lite (h = 2048)
0.5 MiB at b_psum = 2 and 1 MiB at 4; Mixtral (h = 4096) 1 MiB at 2 and 2 MiB at 4.
With D = 32, one-hop ring neighbours and a step term β_k = S/(k·BW):

* ring   = 62 · (α + 2 ns + S/(32·BW));
* biring = 62 · (α + 2 ns + S/(64·BW))  (the two directions use different directed links);
* ring2d = 14 · (α + 2·(S/(8·BW) + 2 ns)) + 6 · (α + 2·(S/(32·BW) + 2 ns))
  (rows of 8 then columns of 4; mesh lines use the folded ring, two hops per message, store and
  forward).

S/(32·BW) = 327.68 / 655.36 / 1310.72 ns, S/(64·BW) = 163.84 / 327.68 / 655.36 ns and
S/(8·BW) = 1310.72 / 2621.44 / 5242.88 ns for 0.5 / 1 / 2 MiB, so (µs, α = 0 → α = 100 ns):

| S | ring | biring | ring2d |
|---|---|---|---|
| 0.5 MiB | 20.44016 → 26.64016 | 10.28208 → 16.48208 | 40.71232 → 42.71232 |
| 1 MiB   | 40.75632 → 46.95632 | 20.44016 → 26.64016 | 81.34464 → 83.34464 |
| 2 MiB   | 81.38864 → 87.58864 | 40.75632 → 46.95632 | 162.60928 → 164.60928 |

The bidirectional ring is the fastest in every cell on the mesh.
"""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import PROFILES
from hdamoe_env.config.specs import MODEL_PRESETS, HardwareSpec, hardware_from_setting
from hdamoe_env.cost import perf
from hdamoe_env.noc.collectives import (
    ALGORITHMS,
    _folded,
    allreduce_time,
    best_allreduce,
    default_ring,
    ring_allreduce_des,
)
from hdamoe_env.noc.topology import make_topology

HW = hardware_from_setting("5/50", "4x8")
MESH = make_topology("mesh", HW)
MIB = 2**20
HOP = 2e-9
HW48 = HardwareSpec(mesh_shape=(4, 8), link_bw_gbps=50.0)
EXPECTED_US = {  # S -> {algorithm: (α = 0, α = 100 ns)}
    MIB // 2: {"ring": (20.44016, 26.64016), "biring": (10.28208, 16.48208),
               "ring2d": (40.71232, 42.71232)},
    MIB: {"ring": (40.75632, 46.95632), "biring": (20.44016, 26.64016),
          "ring2d": (81.34464, 83.34464)},
    2 * MIB: {"ring": (81.38864, 87.58864), "biring": (40.75632, 46.95632),
              "ring2d": (162.60928, 164.60928)},
}


@pytest.mark.parametrize("model_key,h", [("deepseek-v2-lite", 2048), ("mixtral-8x7b", 4096)])
@pytest.mark.parametrize("b_psum", [2, 4])
@pytest.mark.parametrize("alpha_index,alpha", [(0, 0.0), (1, 100e-9)])
def test_tp_allreduce_algorithms_4x8_mesh(model_key, h, b_psum, alpha_index, alpha):
    """Every algorithm at its hand-worked value; the chosen one is the fastest (biring)."""
    assert MODEL_PRESETS[model_key].hidden_size == h
    size = 128 * h * b_psum
    best = best_allreduce(MESH, size, alpha_s=alpha, hop_latency_s=HOP)
    for name in ALGORITHMS:
        want = EXPECTED_US[size][name][alpha_index] * 1e-6
        assert best.times_s[name] == pytest.approx(want, rel=1e-9), name
    assert best.algorithm == "biring"
    assert best.time_s == min(best.times_s.values())


def test_ring_des_equals_closed_form_with_alpha_and_hop():
    """§5.6: on one-hop ring neighbours the DES is 2(D−1)(α + hop + S/(D·BW)) = perf's form."""
    model = MODEL_PRESETS["deepseek-v2-lite"]
    conv = PROFILES["faithful"]
    size = 128 * model.hidden_size * conv.b_psum
    des = allreduce_time(MESH, size, "ring", alpha_s=conv.msg_alpha_s,
                         hop_latency_s=HW.hop_latency_for(conv))
    closed = perf.tp_allreduce_time(model, HW, conv, 128)
    assert des == pytest.approx(closed, rel=1e-12)
    assert des == pytest.approx(46.95632e-6, rel=1e-12)
    # the step-by-step ring simulation agrees (α = 0: no start-up in ring_allreduce_des)
    assert allreduce_time(MESH, size, "ring", hop_latency_s=HOP) == pytest.approx(
        ring_allreduce_des(MESH, size, hop_latency_s=HOP), rel=1e-12)


def test_torus_and_fattree_schedules():
    """Torus rows/columns are rings: ring2d = 14·(α + hop + S/(8·BW)) + 6·(α + hop + S/(32·BW)).

    1 MiB, α = 100 ns: 14·(102 + 2621.44) + 6·(102 + 655.36) ns = 42.67232 µs < ring 46.95632.
    The fat-tree admits all three (ring2d = pod-local rings, then cross-pod rings).
    """
    torus = make_topology("torus", HW)
    t = best_allreduce(torus, MIB, alpha_s=100e-9, hop_latency_s=HOP)
    assert t.times_s["ring2d"] == pytest.approx(42.67232e-6, rel=1e-9)
    assert t.times_s["ring2d"] < t.times_s["ring"]
    fat = make_topology("fattree", HW)
    f = best_allreduce(fat, MIB, alpha_s=100e-9, hop_latency_s=HOP)
    assert set(f.times_s) == set(ALGORITHMS) and f.time_s == min(f.times_s.values())
    # lower bound: every endpoint sends at least 2(p−1)/p·S through its one link
    assert f.time_s >= 2 * 31 / 32 * MIB / 50e9


def test_folded_ring_and_errors():
    assert _folded(8) == [0, 2, 4, 6, 7, 5, 3, 1] and _folded(5) == [0, 2, 4, 3, 1]
    assert _folded(2) == [0, 1] and _folded(1) == [0]
    assert allreduce_time(MESH, 0.0, "ring2d") == 0.0
    with pytest.raises(ConfigError, match="unknown all-reduce algorithm"):
        allreduce_time(MESH, 1.0, "tree")
    with pytest.raises(ConfigError, match="alpha_s"):
        allreduce_time(MESH, 1.0, "ring", alpha_s=-1.0)
    assert np.isfinite(allreduce_time(MESH, 1.0, "biring"))


# --- ring all-reduce (§5.6) --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mesh", "torus"])
def test_ring_allreduce_closed_form(kind):
    topo = make_topology(kind, HW48)
    ring = default_ring(topo)
    assert sorted(ring.tolist()) == list(range(32))
    nxt = np.roll(ring, -1)
    assert all(len(topo.route(int(a), int(b))) == 1 for a, b in zip(ring, nxt, strict=True))
    size = 128 * 2048 * 2.0
    closed = 2 * 31 / 32 * size / 50e9
    assert ring_allreduce_des(topo, size) == pytest.approx(closed, rel=1e-9)
    lat = ring_allreduce_des(topo, size, hop_latency_s=5e-9, chunks=2)
    assert lat >= closed


@pytest.mark.parametrize("kind,shape", [("mesh", (3, 4)), ("mesh", (2, 5)), ("torus", (3, 5)),
                                        ("torus", (5, 3)), ("torus", (1, 5)), ("mesh", (4, 1))])
def test_default_ring_is_one_hop_cycle(kind, shape):
    topo = make_topology(kind, HardwareSpec(mesh_shape=shape))
    ring = default_ring(topo)
    assert sorted(ring.tolist()) == list(range(topo.num_endpoints))
    nxt = np.roll(ring, -1)
    hops = [len(topo.route(int(a), int(b))) for a, b in zip(ring, nxt, strict=True)]
    if shape == (4, 1):   # a mesh line has no Hamiltonian cycle: only the closing step is long
        assert hops == [1, 1, 1, 3]
    else:
        assert hops == [1] * topo.num_endpoints


def test_ring_fattree():
    fat = make_topology("fattree", HW48)
    assert default_ring(fat).tolist() == list(range(32))
    size = 1e6
    assert ring_allreduce_des(fat, size) >= 2 * 31 / 32 * size / 50e9
    assert ring_allreduce_des(fat, size, ring=[5]) == 0.0
    with pytest.raises(ConfigError):
        ring_allreduce_des(fat, size, ring=[1, 1])


# --- network-interface ports (docs/PHYSICS.md §16) ----------------------------------------


def test_ring_with_ports_hand_worked():
    """1 MiB on the 4×8 mesh, α = 100 ns, hop 2 ns, ports at 50 GB/s, S/(32·BW) = 655.36 ns.

    Every ring step is one one-hop message crossing injection port, link and ejection port:
    cut-through 62·(α + 3·hop + S/(32·BW)) = 62·761.36 ns = 47.20432 µs;
    store-and-forward 62·(α + 3·(hop + S/(32·BW))) = 62·2072.08 ns = 128.46896 µs.
    """
    for switching, want_us in (("cut_through", 47.20432), ("store_and_forward", 128.46896)):
        t = allreduce_time(MESH, MIB, "ring", alpha_s=100e-9, hop_latency_s=HOP,
                           switching=switching, ni_bw_Bps=50e9)
        assert t == pytest.approx(want_us * 1e-6, rel=1e-9), switching
    # without ports the same cut-through ring pays one hop per step: 62·(102 + 655.36) ns
    plain = allreduce_time(MESH, MIB, "ring", alpha_s=100e-9, hop_latency_s=HOP,
                           switching="cut_through")
    assert plain == pytest.approx(46.95632e-6, rel=1e-9)
    # the step-by-step ring DES agrees (α = 0): 62·(6 + 655.36) ns = 41.00432 µs
    step = ring_allreduce_des(MESH, MIB, hop_latency_s=HOP, switching="cut_through",
                              ni_bw_Bps=50e9)
    assert step == pytest.approx(41.00432e-6, rel=1e-9)


def test_ring_with_port_latency_hand_worked():
    """As above with ports of their own latency t_ni = 0.5 ns (hop 2 ns, α = 100 ns).

    Cut-through step α + 2·t_ni + hop + S/(32·BW) = 100 + 1 + 2 + 655.36 = 758.36 ns, 62 steps
    = 47.01832 µs; store-and-forward α + 2·t_ni + hop + 3·655.36 = 2069.08 ns, 62 steps =
    128.28296 µs; the step-by-step ring DES (α = 0) 62·658.36 ns = 40.81832 µs.
    """
    for switching, want_us in (("cut_through", 47.01832), ("store_and_forward", 128.28296)):
        t = allreduce_time(MESH, MIB, "ring", alpha_s=100e-9, hop_latency_s=HOP,
                           switching=switching, ni_bw_Bps=50e9, ni_latency_s=0.5e-9)
        assert t == pytest.approx(want_us * 1e-6, rel=1e-9), switching
    step = ring_allreduce_des(MESH, MIB, hop_latency_s=HOP, switching="cut_through",
                              ni_bw_Bps=50e9, ni_latency_s=0.5e-9)
    assert step == pytest.approx(40.81832e-6, rel=1e-9)
    # None = the hop latency (the test above); the cache tells the two apart
    assert allreduce_time(MESH, MIB, "ring", hop_latency_s=HOP, switching="cut_through",
                          ni_bw_Bps=50e9, ni_latency_s=HOP) == pytest.approx(41.00432e-6,
                                                                           rel=1e-9)
    with pytest.raises(ConfigError, match="ni_latency_s"):
        allreduce_time(MESH, MIB, "ring", ni_bw_Bps=50e9, ni_latency_s=-1e-9)
    with pytest.raises(ConfigError, match="ni_latency_s"):
        ring_allreduce_des(MESH, MIB, ni_bw_Bps=50e9, ni_latency_s=float("nan"))


def test_biring_loses_its_edge_with_ports():
    """biring, 1 MiB, α = 100 ns, cut-through: a node's two messages of S/(64·BW) = 327.68 ns
    share its injection port (and two arrive at its ejection port), so a step costs
    α + 3·hop + 2·327.68 ns = 761.36 ns, exactly the ring's: 62·761.36 ns = 47.20432 µs (without
    ports 62·(102 + 327.68) ns = 26.64016 µs). ring2d (folded 2-hop messages, one per node and
    step) only gains two port hops per step: 42.71232 + 20·4 ns = 42.79232 µs, and becomes the
    fastest.
    """
    with_ports = best_allreduce(MESH, MIB, alpha_s=100e-9, hop_latency_s=HOP,
                                switching="cut_through", ni_bw_Bps=50e9)
    without = best_allreduce(MESH, MIB, alpha_s=100e-9, hop_latency_s=HOP,
                             switching="cut_through")
    assert with_ports.times_s["biring"] == pytest.approx(47.20432e-6, rel=1e-9)
    assert with_ports.times_s["ring"] == pytest.approx(47.20432e-6, rel=1e-9)
    assert without.times_s["biring"] == pytest.approx(26.64016e-6, rel=1e-9)
    assert with_ports.times_s["ring2d"] == pytest.approx(
        without.times_s["ring2d"] + 20 * 2 * HOP, rel=1e-9)
    assert with_ports.algorithm == "ring2d" and without.algorithm == "biring"
    with pytest.raises(ConfigError, match="ni_bw_Bps"):
        allreduce_time(MESH, MIB, "ring", ni_bw_Bps=0.0)


def test_profiles_pass_ports_to_the_tp_allreduce():
    """``faithful`` (cut-through + ports) charges the ports; ``paper`` keeps its closed form."""
    from hdamoe_env.sim.simulator import MoESimulator

    sim = MoESimulator("deepseek-v2-lite", HW, "mesh", "faithful")
    conv = sim.conv
    size = 128 * sim.model.hidden_size * conv.b_psum
    got = sim.tp_allreduce(128)
    hop = HW.hop_latency_for(conv)
    want = best_allreduce(MESH, size, alpha_s=conv.msg_alpha_s, hop_latency_s=hop,
                          switching="cut_through", ni_bw_Bps=sim.topology.bw_end_Bps,
                          ni_latency_s=conv.ni_latency_hops * hop)
    assert got.time_s == want.time_s and got.algorithm == want.algorithm
    # the ports pay 0.75 hop each: a ring step is α + 2·1.5 + 2 + 655.36 ns = 760.36 ns
    assert got.times_s["ring"] == pytest.approx(62 * 760.36e-9, rel=1e-9)
    paper = MoESimulator("deepseek-v2-lite", HW, "mesh", "paper").tp_allreduce(128)
    assert paper.algorithm == "const"
