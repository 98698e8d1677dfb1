"""The cached layer evaluator (``hdamoe_env.sim.evaluator.LayerEvaluator``) equals the
simulator's one-off ``layer_sampled`` and its TP totals."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.cost import perf
from hdamoe_env.decisions.dispatch import dispatch_broadcast
from hdamoe_env.sim.evaluator import LayerEvaluator
from hdamoe_env.sim.placement import expert_parallel, tensor_parallel
from hdamoe_env.sim.simulator import MoESimulator


# ------------------------------------------------------------------------------ layer evaluator
@pytest.mark.parametrize("profile", ["faithful", "paper"])
def test_evaluator_equals_layer_sampled(profile, tiny_model, tiny_hw, rng):
    sim = MoESimulator(tiny_model, tiny_hw, conventions=profile)
    pl = expert_parallel(tiny_model.num_moe_layers, 4, 4, rng)
    ev = LayerEvaluator(sim, pl, 16)
    sets = np.stack([rng.permutation(4)[:2] for _ in range(16)])
    for fid, gamma in (("des", None), ("analytic", 0.37)):
        a = sim.layer_sampled(pl, 1, sets, rng=np.random.default_rng(3), fidelity=fid,
                              gamma=gamma)
        b = ev.evaluate(1, sets, rng=np.random.default_rng(3), fidelity=fid, gamma=gamma)
        for name in ("t_nm_s", "t_comp_s", "t_dispatch_s", "t_combine_s", "t_comm_moe_s",
                     "total_s", "mode"):
            assert getattr(a, name) == getattr(b, name), name
        if a.link_busy_s is not None:
            np.testing.assert_array_equal(a.link_busy_s, b.link_busy_s)
    d = dispatch_broadcast(sets, pl.P[1], [int(sets[0, 0])], perf.expert_flops(tiny_model,
                           sim.conv), compute_flops=tiny_hw.compute_flops, stream_s=1e-7)
    kw = dict(P_layer=d.P_layer, extra_holders=d.extra_holders, extra_compute_s=d.extra_compute_s,
              extra_stream_s=d.extra_stream_s, extra_s=2e-7)
    a = sim.layer_sampled(pl, 1, sets, rng=np.random.default_rng(3), **kw)
    b = ev.evaluate(1, sets, rng=np.random.default_rng(3), **kw)
    assert a.total_s == b.total_s and a.t_extra_s == b.t_extra_s == 2e-7


def test_evaluator_tp_and_tp_totals(tiny_model, tiny_hw, rng):
    sim = MoESimulator(tiny_model, tiny_hw)
    tp = tensor_parallel(tiny_model.num_moe_layers, 4, 4)
    ev = LayerEvaluator(sim, tp, 16)
    step = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(16)]) for _ in range(2)])
    totals = ev.tp_totals(step)
    for layer in range(2):
        ref = sim.layer_sampled(tp, layer, step[layer], rng=rng)
        assert ref.mode == "tp"
        assert totals[layer] == pytest.approx(ref.total_s, rel=1e-12)
    with pytest.raises(ConfigError, match="TP"):
        LayerEvaluator(sim, expert_parallel(2, 4, 4, rng), 16).tp_totals(step)


# ------------------------------------------------------------------------- partial-sum combine
def test_partial_shard_holders_combine_at_b_psum(tiny_model, tiny_hw, rng):
    """psum_combine (docs/PHYSICS.md §2): a split expert's shard holders send partial sums at
    b_psum = 4 B instead of b_msg = 2 B; whole-expert placements are unaffected."""
    from hdamoe_env.sim.evaluator import partial_shards
    from hdamoe_env.sim.placement import Placement

    P1 = np.eye(4)
    P1[0] = [0.5, 0.5, 0.0, 0.0]                   # expert 0 split over clusters 0 and 1
    P = np.broadcast_to(P1, (2, 4, 4)).copy()
    split = Placement(P=P, pi=np.tile(np.arange(4), (2, 1)), method="custom")
    ep = expert_parallel(2, 4, 4, rng)
    sets = np.array([[0, 2]] * 8 + [[0, 3]] * 8)
    on, off = "faithful", "faithful+psum_combine=False"
    assert partial_shards(P1, MoESimulator(tiny_model, tiny_hw, conventions=on).conv)[0, :2].all()
    assert partial_shards(P1, MoESimulator(tiny_model, tiny_hw, conventions=off).conv) is None
    assert partial_shards(ep.P[0], MoESimulator(tiny_model, tiny_hw, conventions=on).conv) is None
    res = {}
    for name in (on, off):
        sim = MoESimulator(tiny_model, tiny_hw, conventions=name)
        res[name] = [LayerEvaluator(sim, pl, 16).evaluate(0, sets, rng=np.random.default_rng(5))
                     for pl in (split, ep)]
    # split placement: dispatch unchanged, combine slower; EP: identical
    assert res[on][0].t_dispatch_s == res[off][0].t_dispatch_s
    assert res[on][0].t_combine_s > res[off][0].t_combine_s
    assert res[on][0].link_busy_s.sum() > res[off][0].link_busy_s.sum()
    assert res[on][1].t_comm_moe_s == res[off][1].t_comm_moe_s


# ------------------------------------------------------------------------------ tile-aligned TP
def test_tp_tiled_layers_pay_tp_all_reduce_and_less_padding():
    """DeepSeek on 4x8: 22 whole tiles per expert instead of 32 padded 44-column shards."""
    from hdamoe_env.config.specs import HardwareSpec
    from hdamoe_env.sim.placement import share_unit, tensor_parallel_tiled

    sim = MoESimulator("deepseek-v2-lite", HardwareSpec(mesh_shape=(4, 8)))
    model = sim.model
    L = model.num_moe_layers
    tiled = tensor_parallel_tiled(L, 64, 32, share_unit(model, sim.conv))
    tp = tensor_parallel(L, 64, 32)
    rng = np.random.default_rng(0)
    sets = np.stack([rng.permutation(64)[:model.top_k] for _ in range(128)])
    a = sim.layer_sampled(tiled, 2, sets, rng=np.random.default_rng(1))
    b = sim.layer_sampled(tp, 2, sets, rng=np.random.default_rng(1))
    assert a.mode == b.mode == "tp" and a.t_comm_moe_s == b.t_comm_moe_s
    assert a.tp_algorithm == b.tp_algorithm
    # whole 64-column tiles vs 44-column shards padded to the 8-column MAC granularity (48)
    assert a.t_comp_s < 0.95 * b.t_comp_s
    ev = LayerEvaluator(sim, tiled, 128)
    assert ev.evaluate(2, sets, rng=np.random.default_rng(1)).total_s == a.total_s
    with pytest.raises(ConfigError, match="tp_totals"):
        ev.tp_totals(np.stack([sets] * L))
    f = np.bincount(sets.ravel(), minlength=64) / 128
    s = sim.layer_static(tiled, 2, f, sets[:4], np.full(4, 0.25), 128,
                         rng=np.random.default_rng(1))
    assert s.mode == "tp"
    # the unmarked same shares are a sharded placement: dispatch/combine on the NoC
    plain = tiled.with_layers(allreduce=None)
    assert sim.layer_sampled(plain, 2, sets, rng=np.random.default_rng(1)).mode == "des"
