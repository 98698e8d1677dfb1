"""Simulator composition (paper-model.md §5.1, §5.4, §5.7) pinned to §14 check values."""

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import HardwareSpec, ModelSpec, hardware_from_setting
from hdamoe_env.sim.placement import Placement, expert_parallel, identity_mapping, tensor_parallel
from hdamoe_env.sim.simulator import MoESimulator, evaluate_sampled, evaluate_static
from traces import synthetic
from tests.hdamoe_env.sim.sample_placements import deepseek_ep_placement

US = 1e6


@pytest.fixture(scope="module")
def ds_trace():
    return synthetic.generate("deepseek-v2-lite", n_requests=12, seed=3)


@pytest.mark.parametrize("setting,tbt", [("2.5/75", 4431.12), ("5/50", 3925.85),
                                         ("10/25", 5490.74)])
def test_paper_tp_tbt_deepseek(ds_trace, setting, tbt):  # §14.4
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting(setting), "mesh", "paper")
    tp = tensor_parallel(26, 64, 32)
    static = evaluate_static(sim, tp, ds_trace, 128)
    sampled = evaluate_sampled(sim, tp, ds_trace, 128, steps=2)
    assert round(static.tbt_s * US, 2) == tbt
    assert abs(sampled.tbt_s * US - tbt) < 0.006  # TP compute is routing-independent


def test_paper_tp_layer_terms(ds_trace):  # §14.1, §14.2, §14.3
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"), "mesh", "paper")
    ev = evaluate_static(sim, tensor_parallel(26, 64, 32), ds_trace, 128)
    assert round(ev.layer_means["t_comp_s"][0] * US, 2) == 27.68
    assert round(ev.layer_means["t_comm_moe_s"][0] * US, 2) == 83.89
    assert round(ev.layer_means["t_nm_s"][0] * US, 2) == 39.43


# faithful with the store-and-forward DES without network-interface ports (before issue #27)
FAITHFUL_SAF = "faithful+ni_ports=False+switching=store_and_forward"
# faithful with the pre-PHYSICS.md cost knobs: the values of paper-model.md §14.5 and §14.8
FAITHFUL_V1 = ("faithful+b_psum=2+dram_efficiency=1.0+gemm_overhead_s=0.0+hop_latency_s=0.0"
               "+msg_alpha_s=0.0+ni_ports=False+nonmoe_allreduce=False+nonmoe_ctx_len=1024"
               "+psum_combine=False+switching=store_and_forward+tile_cols=1+tile_tokens=1"
               "+tp_allreduce=ring")


def test_faithful_tp_values(ds_trace):  # §14.5 and §14.2 ring
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"), "mesh", FAITHFUL_V1)
    ev = evaluate_static(sim, tensor_parallel(26, 64, 32), ds_trace, 128)
    assert round(ev.layer_means["t_nm_s"][0] * US, 2) == 58.09
    assert round(ev.layer_means["t_comm_moe_s"][0] * US, 2) == 20.32
    # TP experts: 83.05 compute vs ≤ 55.36 streaming (expected-active experts ≤ all)
    assert round(ev.layer_means["t_comp_s"][0] * US, 2) == 83.05
    assert ev.breakdown["compute_s"] > ev.breakdown["memory_s"]
    assert sim.dense_time(128) > 0
    assert ev.meta["tp_allreduce"]["algorithm"] == "ring"


def test_faithful_tp_charges_the_best_collective(ds_trace):
    """Default faithful: TP's all-reduce is the fastest DES algorithm, reported per layer.

    DeepSeek 4×8 mesh 5/50, B = 128, b_psum = 4 (1 MiB), α = 100 ns, hop 2 ns, cut-through
    with network-interface ports of 0.75 hop = 1.5 ns each: ring2d, every step a 2-hop message
    (1.5 + 2 + 2 + 1.5 = 7 ns of latency), 14·(100 + 7 + 2621.44) + 6·(100 + 7 + 655.36) ns =
    42.77232 µs (test_collectives.py; without ports the bidirectional ring, 26.64016 µs, but its
    two messages per node share the ports).
    """
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"), "mesh", "faithful")
    tp = tensor_parallel(26, 64, 32)
    ev = evaluate_static(sim, tp, ds_trace, 128)
    assert ev.layer_means["t_comm_moe_s"][0] * US == pytest.approx(42.77232, rel=1e-9)
    assert ev.meta["tp_allreduce"]["algorithm"] == "ring2d"
    assert set(ev.meta["tp_allreduce"]["times_us"]) == {"ring", "biring", "ring2d"}
    res = sim.layer_sampled(tp, 0, np.zeros((128, 6), np.int64) + np.arange(6),
                            rng=np.random.default_rng(0))
    assert res.mode == "tp" and res.tp_algorithm == "ring2d"
    assert res.t_comm_moe_s == pytest.approx(42.77232e-6, rel=1e-9)
    paper = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"), "mesh", "paper")
    assert paper.tp_allreduce(128).algorithm == "const"


def _tiny(conv_name, aggregator="first"):
    model = ModelSpec(key="tiny4", name="tiny4", num_moe_layers=1, num_experts=4, top_k=2,
                      hidden_size=100, expert_intermediate=8, attn_weight_elements=100.0,
                      kv_elements_per_token=2, core_flops_per_ctx_token=1.0)
    hw = hardware_from_setting("1/1", "2x2")
    conv = get_profile(conv_name, aggregator=aggregator)
    return MoESimulator(model, hw, "mesh", conv)


@pytest.mark.parametrize("conv,combine,dispatch,total", [("paper", 0.7, 0.0, 1.4),
                                                          (FAITHFUL_V1, 1.4, 1.0, 2.4),
                                                          (FAITHFUL_SAF, 1.502, 1.102, 2.604),
                                                          ("faithful", 1.505, 1.507, 3.012)])
def test_static_task_set_micro_example(conv, combine, dispatch, total):  # §14.8 item 4
    """§14.8 item 4; faithful adds α = 100 ns per message and 2 ns per hop.

    Store-and-forward without ports (``FAITHFUL_SAF``). Combine: (0,1)→(0,0) 1000 B occupies
    that link 100–1100 ns (arrives 1102); the 400 B message (1,1)→(0,1)→(0,0) crosses its first
    link 100–500, arrives 502, waits for the shared link until 1100, crosses 1100–1500, arrives
    1502 → 1.502 µs. Dispatch (reverse): 600 B (1,0)→(1,1) 100–700; 400 B (0,0)→(1,0)→(1,1)
    100–500, 700–1100, arrives 1102; 1000 B (0,0)→(0,1) arrives 1102 → 1.102 µs.

    Default faithful: cut-through with one injection and one ejection port per node (1 B/ns,
    latency 0.75 hop = 1.5 ns), times after α. Combine: the 1000 B message holds the port of
    (0,1) 0–1000, the link to (0,0) 1.5–1001.5 and the ejection port of (0,0) 3.5–1003.5 (done
    1005); the 400 B message waits for the shared link until 1001.5, takes 1001.5–1401.5 and
    the ejection port 1003.5–1403.5, done 1405 → 1.505 µs. Dispatch: (0,0) injects the 1000 B
    message 0–1000, then the 400 B one 1000–1400; it crosses (0,0)→(1,0) 1001.5–1401.5,
    (1,0)→(1,1) 1003.5–1403.5, ejects 1005.5–1405.5, done 1407 → 1.507 µs (the 600 B
    message is done at 605).
    """
    sim = _tiny(conv)
    P = np.eye(4)[None]
    placement = Placement(P=P, pi=identity_mapping(1, 4), method="one-per-node")
    groups = np.array([[0, 1], [2, 3], [0, 3]])
    fg = np.array([0.5, 0.3, 0.2])
    freqs = np.array([0.7, 0.5, 0.3, 0.5])
    res = sim.layer_static(placement, 0, freqs, groups, fg, 10, rng=np.random.default_rng(0))
    assert res.t_combine_s * US == pytest.approx(combine, abs=1e-9)
    assert res.t_dispatch_s * US == pytest.approx(dispatch, abs=1e-9)
    assert res.t_comm_moe_s * US == pytest.approx(total, abs=1e-9)


def test_sampled_is_deterministic_and_seeded(ds_trace):
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"))
    ep = expert_parallel(26, 64, 32, np.random.default_rng(0))
    a = evaluate_sampled(sim, ep, ds_trace, 32, steps=3, seed=5)
    b = evaluate_sampled(sim, ep, ds_trace, 32, steps=3, seed=5)
    c = evaluate_sampled(sim, ep, ds_trace, 32, steps=3, seed=6)
    assert a.tbt_s == b.tbt_s and np.array_equal(a.link_busy_s, b.link_busy_s)
    assert a.tbt_s != c.tbt_s
    assert a.meta["conventions"]["name"] == "faithful" and a.meta["trace_id"]


def test_ep_breakdown_and_links(ds_trace):
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"))
    ep = expert_parallel(26, 64, 32, np.random.default_rng(0))
    ev = evaluate_sampled(sim, ep, ds_trace, 128, steps=2)
    lm = ev.layer_means
    assert (lm["t_dispatch_s"] > 0).all() and (lm["t_combine_s"] > 0).all()
    assert np.allclose(lm["t_comm_moe_s"], lm["t_dispatch_s"] + lm["t_combine_s"])
    assert ev.link_busy_s.shape == (sim.topology.num_links,) and ev.link_busy_s.max() > 0
    assert np.allclose(lm["total_s"], lm["t_nm_s"] + lm["t_comp_s"] + lm["t_comm_moe_s"])
    # EP balancedness is below TP's perfect balance
    assert lm["balancedness"].mean() < 1.0


def test_trace_model_mismatch_is_clear(ds_trace):
    sim = MoESimulator("mixtral-8x7b", hardware_from_setting("5/50"))
    with pytest.raises(ConfigError, match="model 'mixtral-8x7b' has L=32, E=8, k=2"):
        evaluate_static(sim, tensor_parallel(32, 8, 32), ds_trace, 128)
    sim_ds = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50", "4x4"))
    with pytest.raises(ConfigError, match="hardware has 16 nodes"):
        evaluate_static(sim_ds, tensor_parallel(26, 64, 32), ds_trace, 128)


def test_dram_capacity_is_checked(ds_trace):  # §3 node DRAM capacity, §7.3 (10)
    from hdamoe_env.config.errors import InfeasibleError

    ep = expert_parallel(26, 64, 32, np.random.default_rng(0))
    ok = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50", node_dram_gib=2.0))
    ok.check_placement(ep)
    tight = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50", node_dram_gib=0.8))
    with pytest.raises(InfeasibleError, match=r"GiB on node \d+ but node_dram_gib=0.8"):
        evaluate_static(tight, ep, ds_trace, 128)


def test_decision_evaluator_composes_dispatch_broadcast_and_excess(tiny_model, tiny_hw):
    # §10.3 (excess charge), §10.6 (dispatch), §10.8 (broadcast traffic)
    from hdamoe_env.decisions import dispatch as dispatch_mod

    sim = MoESimulator(tiny_model, tiny_hw, "mesh", get_profile("faithful"))
    ep = expert_parallel(2, 4, 4, np.random.default_rng(0))
    freqs = np.full((2, 4), 0.5)
    dec = sim.decision_evaluator(ep, 8, freqs=freqs, max_broadcast=2)
    sets = np.array([[0, 1], [1, 2], [2, 3], [3, 0]] * 2, dtype=np.int64)
    plain = dec.evaluate(1, sets, rng=np.random.default_rng(4))
    ref = sim.layer_sampled(ep, 1, sets, rng=np.random.default_rng(4))
    assert plain.result.total_s == ref.total_s and plain.broadcast is None
    out = dec.evaluate(1, sets, rng=np.random.default_rng(4), broadcast=[2])
    d = dispatch_mod.dispatch_broadcast(sets, ep.P[1], [2], dec.w_flops,
                                        compute_flops=dec.compute_flops, stream_s=dec.stream_s)
    excess = max(0.0, out.broadcast.makespan_s - dec.budgets_s[1])
    manual = sim.layer_sampled(ep, 1, sets, rng=np.random.default_rng(4), P_layer=d.P_layer,
                               extra_holders=d.extra_holders, extra_compute_s=d.extra_compute_s,
                               extra_stream_s=d.extra_stream_s, extra_s=excess)
    assert out.result.total_s == manual.total_s and out.result.t_extra_s == excess
    np.testing.assert_array_equal(out.link_busy_s,
                                  manual.link_busy_s + out.broadcast.link_busy_s)


# ------------------------------------------------------------------------------ redundant experts
FLUID = "faithful+tile_cols=1+tile_tokens=1+gemm_overhead_s=0.0"


def _hot_case(tiny_model):
    """k = 1, B = 16, EP with expert i on node i (2x2 mesh); expert 0 takes 8 tokens, experts 1
    and 2 take 4 each; the replicated placement adds a whole copy of expert 0 on node 3."""
    import dataclasses

    model = dataclasses.replace(tiny_model, top_k=1)
    P = np.stack([np.eye(4)] * 2)
    pi = np.stack([np.arange(4)] * 2)
    reps = np.zeros((2, 4, 4), dtype=bool)
    reps[:, 0, 3] = True
    sets = np.array([[0]] * 8 + [[1]] * 4 + [[2]] * 4, dtype=np.int64)
    return model, Placement(P, pi, "ep"), Placement(P, pi, "ep+rep", replicas=reps), sets


def test_replica_halves_the_busiest_node_in_the_simulator(tiny_model, tiny_hw):
    """Fluid tiles: node compute = tokens·w/C. EP: [8, 4, 4, 0]·w/C (busiest 8); with the
    replica and least_loaded: [4, 4, 4, 4]·w/C (test_dispatch works the greedy out): 2x."""
    model, ep, rep, sets = _hot_case(tiny_model)
    sim = MoESimulator(model, tiny_hw, "mesh", get_profile(FLUID))
    w_c = 6 * 64 * 128 / tiny_hw.compute_flops                    # m·2·h·I / C, m = 3
    a = sim.layer_sampled(ep, 1, sets, rng=np.random.default_rng(0))
    b = sim.layer_sampled(rep, 1, sets, rng=np.random.default_rng(0))
    np.testing.assert_allclose(a.node_compute_s, np.array([8, 4, 4, 0]) * w_c, rtol=1e-12)
    np.testing.assert_allclose(b.node_compute_s, np.array([4, 4, 4, 4]) * w_c, rtol=1e-12)
    assert a.t_comp_compute_s / b.t_comp_compute_s == pytest.approx(2.0)
    rr = sim.layer_sampled(rep, 1, sets, rng=np.random.default_rng(0), replica_rule="round_robin")
    np.testing.assert_allclose(rr.node_compute_s, np.array([4, 4, 4, 4]) * w_c, rtol=1e-12)


def test_replica_rules_conserve_work_and_step(tiny_model, tiny_hw, rng):
    """Every rule computes every (token, expert) pair exactly once: Σ_c node FLOP time is the
    same as without replicas (fluid); DES and analytic fidelities both run."""
    sim = MoESimulator(tiny_model, tiny_hw, "mesh", get_profile(FLUID))
    ep = expert_parallel(2, 4, 4, np.random.default_rng(0))
    reps = np.zeros((2, 4, 4), dtype=bool)
    for layer in range(2):
        e = 0
        reps[layer, e, int(np.flatnonzero(ep.P[layer, e] == 0)[0])] = True
    rep = Placement(ep.P, ep.pi, "ep+rep", replicas=reps)
    step = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(8)]) for _ in range(2)])
    base = sim.step(ep, step, rng=np.random.default_rng(1))
    for rule in ("least_loaded", "nearest", "round_robin"):
        out = sim.step(rep, step, rng=np.random.default_rng(1), replica_rule=rule)
        assert out.meta["replica_rule"] == rule
        for a, b in zip(base.layers, out.layers, strict=True):
            assert b.node_compute_s.sum() == pytest.approx(a.node_compute_s.sum(), rel=1e-12)
        ana = sim.step(rep, step, rng=np.random.default_rng(1), replica_rule=rule,
                       fidelity="analytic", gammas=[0.5, 0.5])
        assert all(lr.mode == "analytic" and lr.t_comm_moe_s > 0 for lr in ana.layers)
    frac = np.zeros((4, 5))
    frac[:, 0] = 1.0                                          # everything on the primary copy
    prim = sim.layer_sampled(rep, 1, step[1], rng=np.random.default_rng(2),
                             replica_rule="shares", replica_fractions=frac)
    np.testing.assert_allclose(prim.node_compute_s,
                               sim.layer_sampled(ep, 1, step[1], rng=np.random.default_rng(2))
                               .node_compute_s, rtol=1e-12)
    with pytest.raises(ConfigError, match="replica rule"):
        sim.step(rep, step, rng=rng, replica_rule="shares")


def test_layer_without_replicas_is_unchanged(tiny_model, tiny_hw, rng):
    """Replicas in layer 0 only: layer 1 evaluates bit-identically to the plain placement."""
    sim = MoESimulator(tiny_model, tiny_hw, "mesh", get_profile("faithful"))
    ep = expert_parallel(2, 4, 4, np.random.default_rng(0))
    reps = np.zeros((2, 4, 4), dtype=bool)
    reps[0, 0, int(np.flatnonzero(ep.P[0, 0] == 0)[0])] = True
    rep = Placement(ep.P, ep.pi, "ep+rep", replicas=reps)
    sets = np.stack([rng.permutation(4)[:2] for _ in range(8)])
    a = sim.layer_sampled(ep, 1, sets, rng=np.random.default_rng(3))
    b = sim.layer_sampled(rep, 1, sets, rng=np.random.default_rng(3))
    assert a.total_s == b.total_s
    np.testing.assert_array_equal(a.link_busy_s, b.link_busy_s)


def test_static_evaluator_refuses_replicas(tiny_model, tiny_hw):
    from traces import RoutingTrace  # noqa: F401 - the static path needs only statistics

    model, _, rep, _ = _hot_case(tiny_model)
    sim = MoESimulator(model, tiny_hw, "mesh", get_profile(FLUID))
    with pytest.raises(ConfigError, match="sampled evaluator"):
        sim.layer_static(rep, 0, np.full(4, 0.25), np.arange(4)[:, None], np.full(4, 0.25), 8,
                         rng=np.random.default_rng(0))


def test_decision_evaluator_composes_broadcast_and_replicas(tiny_model, tiny_hw):
    """Broadcast expert 2 and replicated experts 0 (node of no share) and 2: expert 2 goes
    through the broadcast dispatch only; the replica dispatch of expert 0 runs on the zeroed
    shares with the broadcast work as initial loads, and the merge equals the evaluation."""
    from hdamoe_env.decisions import dispatch as dispatch_mod

    sim = MoESimulator(tiny_model, tiny_hw, "mesh", get_profile("faithful"))
    ep = expert_parallel(2, 4, 4, np.random.default_rng(0))
    reps = np.zeros((2, 4, 4), dtype=bool)
    for e in (0, 2):
        reps[1, e, int(np.flatnonzero(ep.P[1, e] == 0)[0])] = True
    rep = Placement(ep.P, ep.pi, "ep+rep", replicas=reps)
    dec = sim.decision_evaluator(rep, 8, freqs=np.full((2, 4), 0.5), max_broadcast=2)
    sets = np.array([[0, 1], [1, 2], [2, 3], [3, 0]] * 2, dtype=np.int64)
    out = dec.evaluate(1, sets, rng=np.random.default_rng(4), broadcast=[2],
                       replica_rule="round_robin")
    assert out.replica is not None and out.dispatch is not None
    assert (out.replica.copies[sets == 2] == -1).all()
    assert (out.replica.copies[sets == 0] >= 0).all()
    bc = out.dispatch
    rd = dec.evaluator.dispatch_replicas(1, sets, rule="round_robin", P_layer=bc.P_layer,
                                         extra_compute_s=bc.extra_compute_s)
    m = dispatch_mod.merge_dispatch(bc, rd)
    excess = max(0.0, out.broadcast.makespan_s - dec.budgets_s[1])
    manual = sim.evaluator(ep, 8).evaluate(
        1, sets, rng=np.random.default_rng(4), P_layer=m.P_layer, extra_holders=m.extra_holders,
        extra_compute_s=m.extra_compute_s, extra_stream_s=m.extra_stream_s, extra_s=excess)
    assert out.result.total_s == manual.total_s
    assert out.result.t_comp_s == manual.t_comp_s


def test_simulator_check_placement_enforces_the_grid():
    from hdamoe_env.sim.simulator import MoESimulator

    row = np.zeros(32)
    row[5], row[6] = 53 / 1408, 1355 / 1408
    p = deepseek_ep_placement(row)
    hw = HardwareSpec(mesh_shape=(4, 8))
    with pytest.raises(ConfigError, match="tile unit 1/22"):
        MoESimulator("deepseek", hw, conventions="faithful").check_placement(p)
    MoESimulator("deepseek", hw, conventions="paper").check_placement(p)
