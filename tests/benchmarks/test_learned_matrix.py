"""``benchmarks/learned_matrix.py``: every command it would run parses with the real CLI.

The driver builds ``hdamoe tune`` / ``hdamoe train`` argument lists as text; a renamed or removed
flag would only show up hours into a matrix run. Parsing them with ``hdamoe_env.app.cli``'s
parser (no work is done) catches that here, for all 12 cells and both placements.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hdamoe_env.app import cli

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    spec = importlib.util.spec_from_file_location("learned_matrix",
                                                  ROOT / "benchmarks" / "learned_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_parses(tmp_path):
    drv = _driver()
    parser = cli.build_parser()
    cells = drv.cells()
    assert len(cells) == 12 and len({c[0] for c in cells}) == 12
    for name, m, setting, batch in cells:
        for eplb in (False, True):
            cmd = drv.tune_cmd(tmp_path / name, m, setting, batch, eplb=eplb)
            args = parser.parse_args(cmd[1:])
            assert args.placement == ("eplb" if eplb else "node_link")
            assert args.oracle == eplb and args.batch == batch
        for placement in ("node_link", "eplb"):
            cmd = drv.train_cmd(tmp_path / name, tmp_path / "tuned.json", m, setting, batch,
                                20480, ["--replica-shares", "4"], placement)
            args = parser.parse_args(cmd[1:])
            assert args.placement == placement and args.replica_shares == 4
            assert args.seeds == "0,1,2" and args.eval_baselines.endswith("tuned.json")
            if m == "mix":
                assert args.eval_trace.endswith("experts_stem_mixtral.json")


def test_summary_of_an_empty_run_has_only_headers(tmp_path):
    text = _driver().summary(tmp_path)
    assert text.count("\n|---") == 2 and "DeepSeek" not in text


def test_unknown_cell_is_refused(tmp_path, monkeypatch, capsys):
    drv = _driver()
    monkeypatch.setattr("sys.argv", ["learned_matrix.py", "--out", str(tmp_path), "--cells",
                                     "ds_1-1_B7"])
    assert drv.main() == 2
    assert "unknown cell" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        monkeypatch.setattr("sys.argv", ["learned_matrix.py", "--phase", "bogus"])
        drv.main()
