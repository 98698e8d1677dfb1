"""``hdamoe place`` / ``sweep-mem`` front ends (tiny arguments)."""

from __future__ import annotations


import pytest

pytest.importorskip("pulp")

from hdamoe_env.app import place as cli
from hdamoe_env.app.cli import build_parser
from hdamoe_env.app.cli import main as hdamoe_main


def test_parsers_register_subcommands():
    parser = build_parser()
    args = parser.parse_args(["place", "--model", "mixtral", "--out", "x", "--layers", "0-3",
                              "--rho-mem", "1.5", "--lb-method", "anneal"])
    assert args.func is cli.run_place and args.rho_mem == 1.5 and args.layers == "0-3"
    args = parser.parse_args(["sweep-mem", "--model", "deepseek", "--out", "y"])
    assert args.func is cli.run_sweep


def test_place_smoke(tmp_path, capsys):
    argv = ["place", "--model", "mixtral", "--mesh", "2x2", "--layers", "0", "--requests", "2",
            "--bo-calls", "4", "--lb-method", "local", "--time-limit", "5", "--out",
            str(tmp_path), "--json", str(tmp_path / "rows.json")]
    assert hdamoe_main(argv) == 0
    out = capsys.readouterr().out
    assert "node_link:total" in out and "sum" in out and "1 layer(s) computed" in out
    assert (tmp_path / "placement.npz").exists() and (tmp_path / "rows.json").exists()
    assert hdamoe_main([*argv, "--resume"]) == 0
    assert "0 layer(s) computed, 1 reused" in capsys.readouterr().out
