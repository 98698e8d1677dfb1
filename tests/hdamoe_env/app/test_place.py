"""Tests of hdamoe_env.app.place: the ``hdamoe place`` / ``sweep-mem`` front ends with tiny
arguments (Node Balance and EPLB placements)."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from hdamoe_env.app import place as cli
from hdamoe_env.app.cli import build_parser
from hdamoe_env.app.cli import main as hdamoe_main
from hdamoe_env.sim.placement import Placement

# Node Balance (the default placement method) solves a MILP with pulp
needs_pulp = pytest.mark.skipif(find_spec("pulp") is None, reason="pulp is not installed")


@needs_pulp
def test_parsers_register_subcommands():
    parser = build_parser()
    args = parser.parse_args(["place", "--model", "mixtral", "--out", "x", "--layers", "0-3",
                              "--rho-mem", "1.5", "--lb-method", "anneal"])
    assert args.func is cli.run_place and args.rho_mem == 1.5 and args.layers == "0-3"
    args = parser.parse_args(["sweep-mem", "--model", "deepseek", "--out", "y"])
    assert args.func is cli.run_sweep


@needs_pulp
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


def test_place_method_eplb_cli(tmp_path, capsys):
    """Mixtral (E=8) on a 2x2 mesh, rho_mem 1.5: S = floor(1.5·8/4) = 3, 12 physical experts."""
    from hdamoe_env.app.cli import main as hdamoe_main

    argv = ["place", "--model", "mixtral", "--mesh", "2x2", "--requests", "2", "--method",
            "eplb", "--rho-mem", "1.5", "--layers", "0-1", "--out", str(tmp_path)]
    assert hdamoe_main(argv) == 0
    out = capsys.readouterr().out
    assert "EPLB max/mean" in out and "S=3" in out and "12 physical experts" in out
    pl = Placement.load(tmp_path / "placement_eplb.npz")
    assert pl.method == "eplb" and (pl.copies().sum(axis=1) == 12).all()
    assert hdamoe_main(argv) == 2                              # refuses to overwrite
    assert "already exists" in capsys.readouterr().err
    # whole copies of 8 experts on 32 nodes do not fit rho_mem 1.5: one-line typed error
    assert hdamoe_main([*argv[:4], "4x8", *argv[5:-1], str(tmp_path / "b")]) == 2
    assert "rho_mem >= 4" in capsys.readouterr().err


@needs_pulp
def test_place_objective_energy_prints_the_objective_table(tmp_path, capsys):
    """--objective energy: the per-layer latency/energy winners and the latency cost."""
    import json

    argv = ["place", "--model", "mixtral", "--mesh", "2x2", "--layers", "0", "--requests", "2",
            "--bo-calls", "4", "--lb-method", "local", "--time-limit", "5", "--objective",
            "energy", "--out", str(tmp_path), "--json", str(tmp_path / "rows.json")]
    assert hdamoe_main(argv) == 0
    out = capsys.readouterr().out
    assert "Objective energy" in out and "energy winner" in out and "latency cost µs" in out
    row = json.loads((tmp_path / "rows.json").read_text())[0]["objective_costs"]
    assert row["objective"] == "energy" and row["chosen_uj"] == row["energy_best_uj"]
    assert row["latency_cost_us"] == row["chosen_us"] - row["latency_best_us"] >= 0
    assert Placement.load(tmp_path / "placement.npz").meta["objective"] == "energy"


@pytest.mark.parametrize("extra, needle", [
    (["--objective", "power"], "invalid choice: 'power'"),
    (["--objective", "energy", "--lb-objective", "mst"],
     "needs a simulated Link-Balance objective"),
])
def test_place_bad_objective_is_one_line_exit_2(tmp_path, capsys, extra, needle):
    argv = ["place", "--model", "mixtral", "--mesh", "2x2", "--out", str(tmp_path / "o"), *extra]
    try:
        code = hdamoe_main(argv)
    except SystemExit as exc:          # argparse choices: usage + one error line
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and needle in err[-1]
    if extra[1] == "energy":
        assert len(err) == 1
