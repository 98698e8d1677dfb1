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


def test_pareto_shows_every_method_and_zooms(tmp_path):
    """Coincident methods share one labelled point; the axes zoom to the data."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {"tp": {"tbt_us": 7610.0, "top1_retention": 1.0},
            "node-balance": {"tbt_us": 6650.5, "top1_retention": 1.0},
            "node-link": {"tbt_us": 6650.5, "top1_retention": 1.0},
            "hd-moe": {"tbt_us": 6650.5, "top1_retention": 1.0, "gating_scale": 0.0},
            "hda-moe": {"tbt_us": 6534.9, "top1_retention": 0.999, "gating_scale": 1.0}}
    fig, ax = plt.subplots()
    plots.draw_pareto(ax, rows)
    texts = [t.get_text() for t in ax.texts]
    merged = next(t for t in texts if "node-link" in t)
    assert "node-balance" in merged and "hd-moe (s=0)" in merged        # one shared point
    assert any(t == "hda-moe (s=1)" for t in texts) and "tp" in texts
    assert not any("A (" in t for t in texts)                              # no cryptic labels
    assert "gating scale" in ax.get_xlabel()                               # labels explained
    left, right = ax.get_xlim()
    assert left > right and left - right < 1.0                             # inverted, zoomed
    low, high = ax.get_ylim()
    assert 6300 < low < 6534.9 and 7610 < high < 8000                     # not from 0
    plt.close(fig)


def test_normalised_bars_zoom_with_visible_error_bars(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("scipy")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    recs = [{"method": m, "seed": s, "tbt_us": tbt * (1 + 0.002 * s), "model": "tiny",
             "mesh": "2x2", "setting": "1/1", "batch": 8}
            for m, tbt in (("tp", 100.0), ("hybrid", 84.0), ("hda-moe", 89.0))
            for s in (0, 1, 2)]
    captured = {}
    real_save = plots._save

    def keep(fig, path):
        captured["ax"] = fig.axes[0]
        return real_save(fig, path)

    import unittest.mock as mock

    with mock.patch.object(plots, "_save", keep):
        plots.plot_normalised_tbt(recs, tmp_path / "n.png")
    ax = captured["ax"]
    low, high = ax.get_ylim()
    assert 0.7 < low < 0.84 and 1.0 < high < 1.1                 # zoomed to 0.84 … 1.0
    assert "zoomed" in ax.get_ylabel() and "95 % t interval" in ax.get_title()
    _png(tmp_path / "n.png")
    plt.close("all")


def test_pareto_labels_are_spread_apart_in_order():
    """Close points get labels at least one gap apart around their mean; far ones stay put."""
    from hdamoe_env.app.plots import _spread_labels

    ys = [7250.0, 5.0, 7251.0, 7249.0, 9000.0]
    out = _spread_labels(ys, gap=10.0)
    assert out[1] == 5.0 and out[4] == 9000.0
    close = sorted((ys[i], out[i]) for i in (0, 2, 3))
    assert [y for _, y in close] == sorted(y for _, y in close)        # order of the points kept
    assert all(b - a >= 10.0 - 1e-9 for (_, a), (_, b) in zip(close, close[1:]))
    assert abs(sum(y for _, y in close) / 3 - 7250.0) < 1e-9           # centred on their mean


def test_energy_latency_scatter(tmp_path):
    pytest.importorskip("matplotlib")
    rows = {"tp": {"tbt_us": 100.0, "j_per_token": 2e-3},
            "ep": {"tbt_us": 110.0, "j_per_token": 1.8e-3},
            "old": {"tbt_us": 90.0, "j_per_token": None}}        # a record without energy
    path = plots.plot_energy_latency(rows, tmp_path / "f" / "e.png", title="cell")
    assert path.exists() and path.stat().st_size > 0
    with pytest.raises(ValueError, match="no method has both"):
        plots.plot_energy_latency({"old": rows["old"]}, tmp_path / "x.png")
