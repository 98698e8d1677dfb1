"""EplbRebalanceWrapper: periodic EPLB rebalancing inside an env episode (eplb-dynamic)."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.eplb import eplb, eplb_placement
from baselines.rebalance import EplbRebalanceWrapper
from hdamoe_env.env.actions import ActionLayout
from hdamoe_env.env.environment import HdMoeEnv
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import HardwareSpec, ModelSpec

TINY = ModelSpec(key="tiny3", name="tiny3", num_moe_layers=3, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)
HW = HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1.0)


def _env(placement, steps: int = 4) -> HdMoeEnv:
    return HdMoeEnv(model=TINY, hardware=HW, batch=8, steps_per_episode=steps,
                    max_broadcast=0, trace_tokens=512, trace_requests=8, placement=placement)


def _skewed_start():
    """EPLB on deliberately wrong loads (expert 3 hot) so the real loads call for moves."""
    return eplb_placement(eplb(np.tile([1.0, 1.0, 1.0, 50.0], (3, 1)), 4, 2))


def _run(env, action, seed=0):
    env.reset(seed=seed)
    infos, done = [], False
    while not done:
        _, _, term, trunc, info = env.step(action)
        infos.append(info)
        done = term or trunc
    return infos


def test_rebalances_every_period_and_charges_the_moves():
    """period = 1 on a 4-step episode: rebalances after steps 1, 2 and 3 (not after the last);
    a rebalance with moves charges its DES makespan to the first layer of the next step."""
    pl = _skewed_start()
    env = EplbRebalanceWrapper(_env(pl), period=1, min_gain=0.0)
    a = ActionLayout.from_env(env.unwrapped).encode()
    infos = _run(env, a)
    assert [h["decode_step"] for h in env.history] == [1, 2, 3]
    first = [i for i in infos if i["layer"] == 0]
    for h, info in zip(env.history, first[1:], strict=True):
        if h["moves"]:
            assert info["rebalance_us"] == pytest.approx(h["makespan_us"]) and h["makespan_us"] > 0
        else:
            assert "rebalance_us" not in info
    assert env.history[0]["moves"] > 0                      # the wrong start is corrected
    assert env.unwrapped.placement.method == "eplb-dynamic"
    env.reset(seed=0)                                        # back to the initial placement
    assert env.unwrapped.placement is pl and env.history == []


@pytest.mark.parametrize("profile", ["faithful", "paper"])
def test_move_charge_uses_the_profile_noc(profile, monkeypatch):
    """The weight moves run on the env profile's DES: faithful cut-through with ports at BW_end,
    paper* store-and-forward without ports (the charge is that DES's makespan)."""
    import baselines.rebalance as rebalance_mod

    seen = []
    real = rebalance_mod.simulate_moves

    def spy(*args, **kwargs):
        seen.append((kwargs["switching"], kwargs["ni_bw_Bps"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(rebalance_mod, "simulate_moves", spy)
    env = HdMoeEnv(model=TINY, hardware=HW, batch=8, steps_per_episode=2, max_broadcast=0,
                   trace_tokens=512, trace_requests=8, placement=_skewed_start(),
                   conventions=profile)
    wrapped = EplbRebalanceWrapper(env, period=1, min_gain=0.0)
    _run(wrapped, ActionLayout.from_env(env).encode())
    assert wrapped.history and wrapped.history[0]["moves"] > 0
    want = ("cut_through", 1e9) if profile == "faithful" else ("store_and_forward", None)
    assert seen and all(s == want for s in seen)


def test_deterministic_and_static_when_the_period_exceeds_the_episode():
    pl = _skewed_start()
    a = ActionLayout.from_env(_env(pl)).encode()
    runs = [[i["total_us"] for i in _run(EplbRebalanceWrapper(_env(pl), period=1), a, 5)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    static = [i["total_us"] for i in _run(_env(pl), a, 5)]
    never = [i["total_us"] for i in _run(EplbRebalanceWrapper(_env(pl), period=10), a, 5)]
    assert never == static


def test_refuses_sharded_placements_and_bad_options():
    with pytest.raises(ConfigError, match="whole copies"):
        EplbRebalanceWrapper(_env("tp"))
    with pytest.raises(ConfigError, match="period"):
        EplbRebalanceWrapper(_env(_skewed_start()), period=0)
    with pytest.raises(ConfigError, match="rebalance mode"):
        EplbRebalanceWrapper(_env(_skewed_start()), mode="sticky")
