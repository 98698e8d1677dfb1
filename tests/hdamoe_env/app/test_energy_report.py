"""Tests of the energy report (hdamoe_env/app/energy_report.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hdamoe_env.app.cli import main
from hdamoe_env.app.energy_report import (analyse_energy, energy_samples, load_records,
                                          render_energy_section, reprice)
from hdamoe_env.config.errors import ConfigError, InputFileError
from hdamoe_env.config.uncertainty import ENERGY_UNCERTAINTIES
from hdamoe_env.cost.energy import energy_spec_for


def _rec(method: str, parts: dict[str, float], tbt_us: float, seed: int = 0,
         batch: int = 128) -> dict:
    full = {"dram": 0.0, "noc": 0.0, "compute": 0.0, "static": 0.0, **parts}
    full["total"] = sum(full.values())
    return {"kind": "bench", "model": "deepseek-v2-lite", "setting": "5/50", "batch": batch,
            "mesh": "4x8", "topology": "mesh", "profile": "faithful", "method": method,
            "seed": seed, "tbt_us": tbt_us, "energy_j": full,
            "j_per_token": full["total"] / batch}


def test_reprice_is_linear_per_part() -> None:
    spec = energy_spec_for("faithful")
    base = {"dram_pj_per_bit": spec.dram_pj_per_bit, "noc_pj_per_bit_hop": spec.noc_pj_per_bit_hop,
            "mac_pj": spec.mac_pj, "static_w_per_node": spec.static_w_per_node}
    parts = {"dram": 1.0, "noc": 2.0, "compute": 3.0, "static": 4.0}
    values = {"dram_pj_per_bit": np.array([2 * base["dram_pj_per_bit"]]),
              "noc_pj_per_bit_hop": np.array([0.5 * base["noc_pj_per_bit_hop"]]),
              "mac_pj": np.array([base["mac_pj"]]),
              "static_w_per_node": np.array([3 * base["static_w_per_node"]])}
    # hand formula: 1*2 + 2*0.5 + 3*1 + 4*3
    assert reprice(parts, base, values)[0] == pytest.approx(2.0 + 1.0 + 3.0 + 12.0)
    # an unsampled knob keeps its base value
    assert reprice(parts, base, {"mac_pj": np.array([0.0])})[0] == pytest.approx(7.0)


def test_samples_are_a_latin_hypercube_in_range_and_seeded() -> None:
    a = energy_samples(64, 0)
    assert sorted(a) == sorted(ENERGY_UNCERTAINTIES)
    for k, v in a.items():
        u = ENERGY_UNCERTAINTIES[k]
        assert v.shape == (64,) and v.min() >= u.low and v.max() <= u.high
        # one sample per stratum of the log range
        q = np.log(v / u.low) / math.log(u.high / u.low)
        assert sorted(np.floor(q * 64).astype(int)) == list(range(64))
    b = energy_samples(64, 0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["mac_pj"], energy_samples(64, 1)["mac_pj"])


def test_winner_flips_across_noc_threshold_is_conditional_on_noc() -> None:
    base_noc = energy_spec_for("faithful").noc_pj_per_bit_hop
    # TP: 1 J of NoC; EP: 0.7 J of DRAM. Only the NoC value is sampled: TP wins the energy
    # iff noc_pj < 0.7 * base, i.e. below 0.49 pJ (≈ 39 % of the log range 0.2-2).
    recs = [_rec("tp", {"noc": 1.0}, tbt_us=100.0), _rec("ep", {"dram": 0.7}, tbt_us=200.0)]
    knobs = {"noc_pj_per_bit_hop": ENERGY_UNCERTAINTIES["noc_pj_per_bit_hop"]}
    [row] = analyse_energy(recs, samples=64, seed=0, knobs=knobs)
    assert row["latency_winner"] == "tp"
    e = row["energy"]
    assert e["winner"] == "ep"                 # at base: 1.0 J vs 0.7 J
    assert not e["robust"]
    assert e["deciding"] == "noc_pj_per_bit_hop"
    split = e["splits"]["noc_pj_per_bit_hop"]
    assert split["accuracy"] == 1.0 and split["below"] == "tp" and split["above"] == "ep"
    assert 0.7 * base_noc * 0.9 < split["threshold"] <= 0.7 * base_noc
    assert e["mark"].startswith("depends on noc_pj_per_bit_hop")
    assert 0.3 < e["counts"]["tp"] / 64 < 0.5
    # per-method numbers
    assert row["methods"]["ep"]["mj_per_token"] == pytest.approx(1e3 * 0.7 / 128)
    assert row["methods"]["ep"]["e_over_tp"] == pytest.approx(0.7)
    assert row["methods"]["ep"]["tbt_over_tp"] == pytest.approx(2.0)
    text = render_energy_section([row], samples=64, seed=0)
    assert "energy winner ep, latency winner tp (conditional: depends on noc_pj" in text


def test_clear_winner_is_robust_over_all_knobs() -> None:
    parts = {"dram": 1.0, "noc": 1.0, "compute": 1.0, "static": 1.0}
    recs = [_rec("tp", parts, tbt_us=100.0),
            _rec("ep", {k: 0.5 * v for k, v in parts.items()}, tbt_us=150.0)]
    [row] = analyse_energy(recs, samples=64, seed=0)
    assert row["energy"]["winner"] == "ep" and row["energy"]["robust"]
    assert row["energy"]["mark"] == "robust (100%)"
    # EDP: TP 4 J * 100 us = 4e-4, EP 2 J * 150 us = 3e-4 in every sample (factor common)
    assert row["edp"]["winner"] == "ep" and row["edp"]["robust"]
    assert row["latency_winner"] == "tp"
    text = render_energy_section([row], samples=64, seed=0)
    assert "robust (100%)" in text and "| tp |" in text.replace("latency winner", "")
    assert "energy winner ep, latency winner tp (robust: robust (100%))" in text


def test_means_over_seeds_and_ties_go_to_first_method() -> None:
    recs = [_rec("tp", {"dram": 1.0}, 100.0, seed=0), _rec("tp", {"dram": 3.0}, 300.0, seed=1),
            _rec("node-link", {"dram": 2.0}, 200.0, seed=0),
            _rec("node-link", {"dram": 2.0}, 200.0, seed=1)]
    [row] = analyse_energy(recs, samples=8, seed=0)
    assert row["methods"]["tp"]["tbt_us"] == pytest.approx(200.0)
    assert row["methods"]["node-link"]["e_over_tp"] == pytest.approx(1.0)
    assert row["energy"]["winner"] == "tp" and row["latency_winner"] == "tp"


def test_load_records_errors(tmp_path) -> None:
    with pytest.raises(InputFileError):
        load_records([str(tmp_path / "missing.json")])
    old = _rec("tp", {}, 1.0)
    del old["energy_j"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps([old]))
    with pytest.raises(ConfigError, match="energy"):
        load_records([str(path)])


def test_cli_energy_report(tmp_path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps([_rec("tp", {"noc": 1.0}, 100.0),
                                _rec("ep", {"dram": 0.7}, 200.0)]))
    assert main(["energy-report", str(path), "--samples", "16"]) == 0
    out = capsys.readouterr().out
    assert "energy winner" in out and "deepseek-v2-lite" in out and "16 samples" in out
    assert main(["energy-report", str(path), "--samples", "16", "--methods", "ep"]) == 0
    out = capsys.readouterr().out
    assert "| tp |" not in out and "| ep |" in out
    assert main(["energy-report", str(path), "--methods", "eplb"]) == 2
    assert "eplb" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["missing", "no-energy"])
def test_cli_bad_input_one_line_exit_2(tmp_path, capsys, kind: str) -> None:
    path = tmp_path / "r.json"
    if kind == "no-energy":
        rec = _rec("tp", {}, 1.0)
        del rec["energy_j"]
        path.write_text(json.dumps([rec]))
    assert main(["energy-report", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hdamoe: error:") and "\n" not in err
