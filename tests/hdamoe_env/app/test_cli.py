"""Subprocess smoke tests of the ``hdamoe`` CLI with tiny arguments (style.md R15)."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def run(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "hdamoe_env.app.cli", *args], capture_output=True,
                          text=True, env=ENV, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_simulate_tp_ep_json(tmp_path):
    out = tmp_path / "sim.json"
    proc = run("simulate", "--model", "deepseek-v2-lite", "--batch", "16", "--steps", "2",
               "--requests", "6", "--json", str(out))
    assert "placement ep: per MoE layer" in proc.stdout and "TBT/TP" in proc.stdout
    records = json.loads(out.read_text())
    assert [r["method"] for r in records] == ["tp", "ep"]
    assert records[0]["tbt_over_tp"] == 1.0 and records[1]["tbt_us"] > 0
    assert records[1]["meta"]["conventions"]["name"] == "faithful"
    assert len(records[1]["layers_us"]["t_comp_s"]) == 26


def test_simulate_paper_static_reproduces_tp_value():  # paper-model.md §14.4
    proc = run("simulate", "--model", "deepseek-v2-lite", "--conventions", "paper",
               "--evaluator", "static", "--placement", "tp", "--requests", "4")
    line = next(l for l in proc.stdout.splitlines() if l.strip().startswith("tp "))
    assert line.split()[1] == "3925.85"


def test_traces_gen_and_stats(tmp_path):
    path = tmp_path / "mx.hdtrace.npz"
    run("traces", "gen", "--model", "mixtral-8x7b", "--requests", "4", "--out", str(path))
    proc = run("traces", "stats", str(path), "synthetic:mixtral-8x7b", "--requests", "4")
    assert "gini" in proc.stdout and "mx.hdtrace.npz" in proc.stdout


def test_bench_sim_runs():
    proc = run("bench-sim", "--seconds", "0.3")
    assert "ratio" in proc.stdout and "agreement: True" in proc.stdout


def test_errors_are_clear(tmp_path):
    proc = run("simulate", "--model", "deepseek-v2-lit", check=False)
    assert proc.returncode == 2 and "did you mean 'deepseek-v2-lite'" in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"0": [[1, 2], [3]]}')
    proc = run("simulate", "--model", "mixtral-8x7b", "--trace", str(bad), check=False)
    assert proc.returncode == 2 and "bad.json" in proc.stderr
    proc = run("simulate", "--setting", "fast", check=False)
    assert proc.returncode == 2 and "TFLOPS/GBps" in proc.stderr


@pytest.mark.parametrize("topology", ["torus", "fattree"])
def test_simulate_other_topologies(topology):
    proc = run("simulate", "--topology", topology, "--batch", "8", "--steps", "1",
               "--requests", "4", "--placement", "ep")
    assert f"on {topology} 4x8" in proc.stdout
