"""Tests of hdamoe_env.app.cli: subprocess smoke tests of the ``hdamoe`` commands with tiny
arguments (style.md R15), and the parser's usability — every option has help, defaults are shown
once, ``--json -`` writes JSON to stdout only, ``main`` configures logging."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from hdamoe_env.app.cli import build_parser, main
from hdamoe_env.app.logs import configure_logging

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


def _parsers(parser, path=("hdamoe",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_option_has_help_and_defaults_appear_once():
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction
                          | argparse._SubParsersAction):
                continue
            assert action.help, f"{' '.join(path)} {action.option_strings or action.dest}"
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, path
        for block in re.split(r"\n  (?=-)", text):
            assert block.count("(default:") <= 1, (path, block)
            if "(default:" in block:                  # said by the formatter only
                assert block.lower().count("default") == 1, (path, block)


def test_defaults_are_shown():
    parser = dict(_parsers(build_parser()))[("hdamoe", "bench")]
    help_text = " ".join(parser.format_help().split())
    assert "--batch BATCH tokens per decode step B (default: 128)" in help_text
    assert "--k-b K_B manual pre-broadcast slots per layer (default: the budget rule)" in help_text


def test_json_dash_writes_json_to_stdout_and_text_to_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["simulate", "--model", "mixtral", "--mesh", "2x2", "--setting", "1/1",
                 "--batch", "8", "--steps", "1", "--requests", "4", "--json", "-"])
    assert code == 0
    out, err = capsys.readouterr()
    records = json.loads(out)                          # stdout is the JSON and nothing else
    assert {r["method"] for r in records} == {"tp", "ep"}
    assert "summary (µs per decode step)" in err
    assert not (tmp_path / "-").exists()


@pytest.fixture
def restore_logging():
    yield
    configure_logging(0, False)


def test_main_configures_logging_from_the_global_flags(restore_logging, monkeypatch):
    seen = {}
    monkeypatch.setattr("hdamoe_env.app.cli.configure_logging",
                        lambda verbose, quiet: seen.update(verbose=verbose, quiet=quiet))
    with pytest.raises(SystemExit):
        main(["--version"])
    main(["traces", "stats", "synthetic:mixtral-8x7b", "--requests", "2", "--batch", "4"])
    # until the global -v/-q flags exist, main() passes the neutral values
    assert seen == {"verbose": 0, "quiet": False}


def test_simulate_tp_tiled_and_hybrid(tmp_path):
    out = tmp_path / "sim.json"
    run("simulate", "--model", "deepseek-v2-lite", "--batch", "16", "--steps", "1",
        "--requests", "4", "--placement", "tp-tiled,hybrid", "--evaluator", "static",
        "--json", str(out))
    records = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"tp", "tp-tiled", "hybrid"}
    # tile-aligned TP pays TP's all-reduce, on fewer padded columns
    assert records["tp-tiled"]["breakdown_us"]["communication_s"] == pytest.approx(
        records["tp"]["breakdown_us"]["communication_s"])
    assert records["tp-tiled"]["tbt_us"] < records["tp"]["tbt_us"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v2-lite", "qwen2-57b-a14b",
                                   "qwen3.5-35b-a3b"])
def test_simulate_16x16_every_baseline(model):
    """Issue acceptance: TP, tp-tiled, EP (more nodes than experts) and the hybrid on 16x16."""
    proc = run("simulate", "--model", model, "--mesh", "16x16", "--steps", "1",
               "--requests", "4", "--placement", "tp,tp-tiled,ep,hybrid")
    assert all(f"placement {p}:" in proc.stdout for p in ("tp-tiled", "ep", "hybrid"))
