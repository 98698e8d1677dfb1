"""Tests of hdamoe_env.app.plots: the bench figures (one PNG per figure, the link heatmap per
topology) and the learning curves of several training seeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hdamoe_env.app import plots, tb
from hdamoe_env.config.specs import HardwareSpec, TopologySpec
from hdamoe_env.noc.topology import make_topology


def _plot_records(num_links):
    rng = np.random.default_rng(0)
    out = []
    for method, tbt in (("tp", 10.0), ("ep", 8.0), ("hd-moe", 6.0)):
        for seed in (0, 1):
            out.append({"method": method, "seed": seed, "tbt_us": tbt + seed,
                        "breakdown_us": {"compute_us": 3.0, "communication_us": tbt - 4,
                                         "memory_us": 0.5, "extra_us": 0.5},
                        "link_busy_us": None if method == "tp" else
                        rng.random(num_links).tolist(),
                        "model": "tiny", "mesh": "2x3", "setting": "1/1", "batch": 8})
    return out


def _png(path):
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind", ["mesh", "torus", "fattree"])
def test_write_plots(tmp_path, kind):
    pytest.importorskip("matplotlib")
    if kind == "fattree":
        spec = TopologySpec(kind=kind, pods=2, leaves_per_pod=2, endpoints_per_leaf=2,
                            aggs_per_pod=1, core_switches=1)
        hw = HardwareSpec(mesh_shape=(2, 4))
    else:
        spec, hw = TopologySpec(kind=kind), HardwareSpec(mesh_shape=(2, 3))
    topo = make_topology(spec, hw)
    paths = plots.write_plots(_plot_records(topo.num_links), tmp_path, topology=topo,
                              heatmap_method="hd-moe")
    assert [p.name for p in paths] == ["normalised_tbt.png", "breakdown.png",
                                       "link_heatmap_hd-moe.png"]
    for p in paths:
        _png(p)


def test_heatmap_checks_the_link_count(tmp_path):
    pytest.importorskip("matplotlib")
    topo = make_topology(TopologySpec(kind="mesh"), HardwareSpec(mesh_shape=(2, 2)))
    with pytest.raises(ValueError, match="one value per directed link"):
        plots.plot_link_heatmap(topo, np.zeros(3), tmp_path / "x.png")


def test_seed_curves_plot_every_seed(tmp_path, monkeypatch):
    """One PNG with a curve per seed; None (no file) when no seed logged scalars."""
    pytest.importorskip("matplotlib")
    logged = {"seed0": {"latency/tbt_us": [(0, 10.0), (64, 9.0)]},
              "seed1": {"latency/tbt_us": [(0, 11.0), (64, 8.5)],
                        "rollout/ep_rew_mean": [(64, -3.0)]}}
    monkeypatch.setattr(tb, "read_scalars", lambda d: logged.get(Path(d).name, {}))
    dirs = {0: tmp_path / "seed0", 1: tmp_path / "seed1"}
    png = plots.plot_seed_curves(tmp_path, dirs)
    assert png == tmp_path / "learning_curves.png" and png.stat().st_size > 1000
    assert plots.plot_seed_curves(tmp_path, {2: tmp_path / "seed2"},
                                  path=tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
