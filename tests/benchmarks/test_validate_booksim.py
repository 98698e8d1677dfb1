"""``benchmarks/validate_booksim.py``: the DES against the recorded BookSim 2.0 makespans.

The benchmark ran BookSim 2.0 on every message list and wrote the fixture
``benchmarks/booksim/fixtures/booksim_makespans.csv`` (message-list hash, BookSim makespan and
the DES makespans of that run). Here the message lists are regenerated (same seeds, same traces
read in place), their hashes checked, and the DES re-run without BookSim:

* every DES variant reproduces its recorded makespan (relative 1e-9): a change to the DES shows
  up here and calls for a re-run of the benchmark;
* the default ``faithful`` NoC model (cut-through with network-interface ports of 0.75 hop
  latency each, ``ni_latency_hops``) stays within 5 % of BookSim on every case at B >= 32 but
  ``HOL_CASE`` (recorded −5.7 %: head-of-line blocking in BookSim's input-queued routers under
  converging traffic, docs/results/validation.md) and within ``TOL_ALL`` on every case; with a
  full hop latency per port (``ct_ni_hop``, the model before the knob) the latency-bound
  all-reduce steps were up to 12.0 % off, so the port latency must lower the mean error; the
  store-and-forward DES without ports (the ``paper*`` model) is worse on average — the evidence
  behind the default;
* the analytic twin's column (γ-fitted Eq. 2–3 for dispatch and combine, the closed-form ring
  step, the α–β broadcast) reproduces on one case of each kind, and on the per-layer sum of
  dispatch and combine — the quantity the twin predicts — it is recorded further from BookSim
  than the CT+NI DES it was fitted to.
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from hdamoe_env.config.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "benchmarks" / "booksim" / "fixtures" / "booksim_makespans.csv"
TOL_B32 = 0.05      # |CT+NI − BookSim| / BookSim, every case at B >= 32 but HOL_CASE
TOL_ALL = 0.06      # every case
HOL_CASE = "Mixtral/B128/combine/mesh4x8"


def _driver():
    spec = importlib.util.spec_from_file_location("validate_booksim",
                                                  ROOT / "benchmarks" / "validate_booksim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["validate_booksim"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows():
    drv = _driver()
    if not drv.TRACES.is_dir():
        pytest.skip("no reference traces at ../shared/reference-traces")
    with FIXTURE.open() as f:
        return drv, list(csv.DictReader(f))


def test_fixture_covers_the_grid(rows):
    drv, table = rows
    cases = {r["case"] for r in table}
    assert len(cases) == len(table) == len(drv.cases())
    assert {drv.parse_case_id(c)[2] for c in cases} == set(drv.KINDS)


def test_des_reproduces_fixture_and_matches_booksim(rows):
    drv, table = rows
    errors = {"ct_ni": [], "saf": [], "ct_ni_hop": []}
    for r in table:
        model, batch, kind, topo_kind, grid = drv.parse_case_id(r["case"])
        hop = float(r["hop_latency_s"])
        msgs = drv.build_messages(model, batch, kind, topo_kind, grid, hop)
        assert msgs.digest() == r["digest"], r["case"]
        assert msgs.src.size == int(r["messages"])
        ref = float(r["booksim_s"])
        for name, switching, ni in drv.VARIANTS:
            if name not in errors:
                continue
            got = drv.run_des(msgs, topo_kind, grid, hop, switching, ni)
            assert got == pytest.approx(float(r[f"{name}_s"]), rel=1e-9), (r["case"], name)
            errors[name].append(abs(got - ref) / ref)
        err = errors["ct_ni"][-1]
        assert err <= TOL_ALL, (r["case"], err)
        if batch >= 32 and r["case"] != HOL_CASE:
            assert err <= TOL_B32, (r["case"], err)
    assert np.mean(errors["ct_ni"]) < np.mean(errors["saf"])
    assert np.mean(errors["ct_ni"]) < np.mean(errors["ct_ni_hop"])
    assert max(errors["ct_ni"]) < max(errors["ct_ni_hop"])


def test_profiles_use_the_validated_models():
    assert PROFILES["faithful"].switching == "cut_through" and PROFILES["faithful"].ni_ports
    assert PROFILES["faithful"].ni_latency_hops == 0.75  # BookSim: 6 + 4·hops cycles
    for name in ("paper", "paper-hd"):
        assert PROFILES[name].switching == "store_and_forward" and not PROFILES[name].ni_ports


@pytest.mark.parametrize("case", ["DS-V2-Lite/B16/dispatch/mesh4x8",
                                  "DS-V2-Lite/B16/combine/mesh4x8",
                                  "Qwen2/B32/allreduce/torus8x8",
                                  "Mixtral/B0/broadcast/mesh8x8"])
def test_twin_reproduces_fixture(rows, case):
    drv, table = rows
    r = next(x for x in table if x["case"] == case)
    model, batch, kind, topo_kind, grid = drv.parse_case_id(case)
    hop = float(r["hop_latency_s"])
    msgs = drv.build_messages(model, batch, kind, topo_kind, grid, hop)
    got = drv.twin_estimate(msgs, model, batch, kind, topo_kind, grid, hop)
    assert got == pytest.approx(float(r["twin_s"]), rel=1e-9)
    if kind == "allreduce":  # one ring step: hop + bytes / 50 GB/s
        assert got == pytest.approx(hop + float(msgs.size_bytes[0]) / 50e9, rel=1e-12)


def test_twin_is_recorded_less_accurate_than_the_des(rows):
    """Per layer (dispatch + combine) the twin is farther from BookSim than the CT+NI DES."""
    _drv, table = rows
    pairs: dict[str, dict[str, dict[str, str]]] = {}
    for r in table:
        kind = r["case"].split("/")[2]
        if kind in ("dispatch", "combine"):
            pairs.setdefault(r["case"].replace(f"/{kind}/", "/"), {})[kind] = r
    twin, des = [], []
    for pair in pairs.values():
        ref = sum(float(p["booksim_s"]) for p in pair.values())
        twin.append(abs(sum(float(p["twin_s"]) for p in pair.values()) / ref - 1))
        des.append(abs(sum(float(p["ct_ni_s"]) for p in pair.values()) / ref - 1))
    assert len(pairs) == 30
    assert np.mean(twin) > np.mean(des) and max(des) < 0.05
