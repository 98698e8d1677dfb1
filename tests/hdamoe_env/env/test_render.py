"""Tests of hdamoe_env.env.render: the RGB link heat map, the env's ``render_mode="rgb_array"``
and SB3's ``make_vec_env`` with its defaults (which pass ``render_mode="rgb_array"``)."""

from __future__ import annotations

import numpy as np
import pytest

import hdamoe_env  # registers the ids
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.specs import HardwareSpec, ModelSpec, TopologySpec
from hdamoe_env.env import render
from hdamoe_env.env.environment import ENV_ID, HdMoeEnv
from hdamoe_env.noc.topology import make_topology

TINY = ModelSpec(key="tiny3", name="tiny3", num_moe_layers=3, num_experts=4, top_k=2,
                 hidden_size=64, expert_intermediate=128, attn_weight_elements=4 * 64 * 64,
                 kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)
HW = HardwareSpec(mesh_shape=(2, 3), compute_tflops=1.0, link_bw_gbps=1.0)
TINY_KW = dict(model=TINY, hardware=HW, batch=8, steps_per_episode=2, max_broadcast=2,
               k_b=[0, 1, 2], trace_tokens=512, trace_requests=8)


def test_heat_colors_ramp_ends_and_clipping():
    c = render.heat_colors([0.0, 1.0, -3.0, 7.0, np.nan, 0.5])
    assert c.dtype == np.uint8 and c.shape == (6, 3)
    assert tuple(c[0]) == tuple(c[2]) == tuple(c[4])      # below 0 and NaN count as idle
    assert tuple(c[1]) == tuple(c[3])                     # above 1 is saturated
    assert c[1, 0] > c[0, 0] and c[1, 1] > c[0, 1]        # saturated is brighter (yellow)
    assert tuple(c[5]) not in (tuple(c[0]), tuple(c[1]))


def test_mesh_layout_places_each_direction():
    topo = make_topology(TopologySpec("mesh"), HW)
    cell = 4
    util = np.zeros(topo.num_links)
    link = topo.link_id(topo.endpoint_id(0, 0), topo.endpoint_id(0, 1))   # (0,0) -> (0,1)
    util[link] = 1.0
    img = render.link_heatmap_rgb(topo, util, cell_px=cell)
    assert img.shape == (3 * cell, 5 * cell, 3) and img.dtype == np.uint8
    hot, cold = render.heat_colors([1.0])[0], render.heat_colors([0.0])[0]
    gap = img[0:cell, cell:2 * cell]                      # gap cell between (0,0) and (0,1)
    assert (gap[:cell // 2] == hot).all()                 # towards higher column: upper half
    assert (gap[cell // 2:] == cold).all()                # the reverse link is idle
    assert (img[0:cell, 0:cell] == render.NODE_RGB).all()
    assert (img[cell:2 * cell, cell:2 * cell] == render.NO_LINK_RGB).all()   # no diagonal link


def test_matrix_layout_for_torus_and_errors():
    topo = make_topology(TopologySpec("torus"), HardwareSpec(mesh_shape=(3, 3)))
    util = np.linspace(0, 1, topo.num_links)
    img = render.link_heatmap_rgb(topo, util, cell_px=2)
    V = topo.num_vertices
    assert img.shape == (2 * V, 2 * V, 3)
    u, v = int(topo.link_src[-1]), int(topo.link_dst[-1])
    assert tuple(img[2 * u, 2 * v]) == tuple(render.heat_colors([1.0])[0])
    assert (img[0:2, 0:2] == render.NO_LINK_RGB).all()    # no self link
    with pytest.raises(ConfigError, match="one value per link"):
        render.link_heatmap_rgb(topo, util[:-1])
    with pytest.raises(ConfigError, match="cell_px"):
        render.link_heatmap_rgb(topo, util, cell_px=1)


def test_env_rgb_array_follows_the_last_layer():
    env = HdMoeEnv(render_mode="rgb_array", **TINY_KW)
    env.reset(seed=0)
    idle = env.render()
    assert isinstance(idle, np.ndarray) and idle.dtype == np.uint8 and idle.ndim == 3
    assert idle.shape[2] == 3
    noop = np.array([env.num_experts] * env.max_broadcast + [0, 0])
    env.step(noop)
    busy = env.render()
    assert busy.shape == idle.shape
    util = env._last_link_util()
    assert util.max() > 0                                 # DES fidelity: MoE messages on links
    assert not np.array_equal(busy, idle)
    ansi = HdMoeEnv(render_mode="ansi", **TINY_KW)
    ansi.reset(seed=0)
    ansi.step(noop)
    assert isinstance(ansi.render(), str)
    with pytest.raises(ConfigError, match="render mode"):
        HdMoeEnv(render_mode="human", **TINY_KW)


def _check_vec_env(venv, num_experts: int) -> None:
    try:
        obs = venv.reset()
        assert obs["pred_load"].shape == (2, num_experts)
        slots = len(venv.action_space.nvec) - 2          # broadcast slots, then dispatch, gating
        actions = np.array([[num_experts] * slots + [0, 0]] * 2)
        obs, rewards, dones, infos = venv.step(actions)
        assert rewards.shape == (2,) and np.all(rewards < 0)
        frames = venv.get_images()
        assert len(frames) == 2 and all(f.dtype == np.uint8 and f.shape[2] == 3 for f in frames)
    finally:
        venv.close()


@pytest.mark.parametrize("vec", ["dummy", "subproc"])
def test_sb3_make_vec_env_with_defaults(vec):
    """SB3's make_vec_env passes render_mode="rgb_array"; it must work without env_kwargs.

    SubprocVecEnv with "fork" here (the default suite stays fast); SB3's default start method
    (forkserver) in the slow test below.
    """
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    cls = DummyVecEnv if vec == "dummy" else SubprocVecEnv
    kwargs = {} if vec == "dummy" else {"vec_env_kwargs": {"start_method": "fork"}}
    _check_vec_env(make_vec_env(ENV_ID, n_envs=2, seed=0, vec_env_cls=cls,
                                env_kwargs=dict(TINY_KW), **kwargs), TINY.num_experts)


_USER_SCRIPT = """
import sys
import hdamoe_env
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

if __name__ == "__main__":
    for cls in (DummyVecEnv, SubprocVecEnv):
        venv = make_vec_env(sys.argv[1], n_envs=2, vec_env_cls=cls)
        obs = venv.reset()
        frames = venv.get_images()
        venv.close()
        print(cls.__name__, obs["pred_load"].shape[0], frames[0].dtype, frames[0].ndim)
"""


@pytest.mark.slow
def test_sb3_make_vec_env_registered_id_as_is(tmp_path):
    """The issue's command in a user script: make_vec_env(id, n_envs=2) with no kwargs at all,
    DummyVecEnv and SubprocVecEnv with SB3's default start method (forkserver re-imports the
    script, whose ``import hdamoe_env`` registers the ids in the workers)."""
    pytest.importorskip("stable_baselines3")
    import subprocess
    import sys

    analytic = next(i for i, (kw, _) in hdamoe_env.REGISTERED_ENVS.items()
                    if kw.get("fidelity") == "analytic")
    script = tmp_path / "user_script.py"
    script.write_text(_USER_SCRIPT)
    out = subprocess.run([sys.executable, str(script), analytic], capture_output=True,
                         text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["DummyVecEnv 2 uint8 3", "SubprocVecEnv 2 uint8 3"]
