"""Command-line value types and cross-field output checks (hdamoe_env/app/argtypes.py)."""

from __future__ import annotations

import argparse

import pytest

from hdamoe_env.app import argtypes
from hdamoe_env.app.cli import main
from hdamoe_env.config.errors import ConfigError, OutputPathError


@pytest.mark.parametrize("text", ["0,0", "-1", "0,,1", "1.5", "x", "", "4294967296"])
def test_seed_list_refuses_bad_seeds(text):
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.seed_list(text)


def test_seed_list_accepts_distinct_seeds():
    assert argtypes.seed_list("0, 3,4294967295") == "0, 3,4294967295"


@pytest.mark.parametrize("text", [",", "", "tp,,ep", "tp,tp", " "])
def test_name_list_refuses_empty_and_repeated_names(text):
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.name_list(text)


def test_bounded_float_ends():
    parse = argtypes.bounded_float(0.0, 1.0, lo_open=True)
    assert parse("1") == 1.0 and parse("0.5") == 0.5
    for bad in ("0", "1.01", "nan", "inf", "1e999", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert argtypes.finite_float("-3") == -3.0


@pytest.mark.parametrize("item", ["gamma=2", "gamma=-0.1", "clip_range=-1", "clip_range=0",
                                  "learning_rate=-1", "learning_rate=0", "n_steps=0",
                                  "n_steps=1.5", "batch_size=true", "gae_lambda=1.5"])
def test_hp_ranges(item):
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.hp_item(item)
    name, _, value = item.partition("=")
    import json

    with pytest.raises(ConfigError, match=name):
        argtypes.check_hyperparams({name: json.loads(value)})


def test_hp_in_range_and_unranged_pass():
    for item in ("gamma=0", "gamma=0.99", "clip_range=0.2", "n_steps=128", "policy=MlpPolicy",
                 "learning_rate=lin_3e-4", "net_arch=[64,64]"):
        assert argtypes.hp_item(item) == item


@pytest.mark.parametrize("parse, text", [(argtypes.model_list, "nosuch"),
                                         (argtypes.model_list, "../../x"),
                                         (argtypes.setting_list, "5/0"),
                                         (argtypes.setting_list, "1e9/50"),
                                         (argtypes.batch_list, "0"),
                                         (argtypes.batch_list, "32,32")])
def test_crossover_lists_check_every_item(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


def _ns(**kw):
    return argparse.Namespace(**kw)


def test_output_options_cross_checks(tmp_path):
    with pytest.raises(OutputPathError, match="empty"):
        argtypes.check_output_options(_ns(json=""), None)
    same = str(tmp_path / "o.json")
    with pytest.raises(OutputPathError, match="same file"):
        argtypes.check_output_options(_ns(json=same, csv=same), None)
    out = tmp_path / "p"
    for inside in ("layer_000.json", "run.json", "checkpoints/x.json"):
        with pytest.raises(OutputPathError, match="inside --out"):
            argtypes.check_output_options(_ns(json=str(out / inside), out=str(out)), "dir")
    argtypes.check_output_options(_ns(json=str(out / "rows.json"), out=str(out)), "dir")
    argtypes.check_output_options(_ns(json="-", csv=None), None)


@pytest.mark.parametrize("argv", [
    ["simulate", "--json", ""],
    ["simulate", "--placement", ","],
    ["simulate", "--placement", ""],
    ["bench", "--csv", "o.json", "--json", "o.json"],
    ["bench", "--seeds", "0,0"],
    ["bench", "--seeds", "-1"],
    ["simulate", "--hop-latency-ns", "1e308"],
    ["bench", "--trace-skew", "1e308"],
    ["crossover", "--out", "x", "--batches", "0"],
    ["evaluate", "--agent", ""],
])
def test_cli_refuses_in_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "error" in err[0], err
    assert not (tmp_path / "o.json").exists()


def test_output_targets_lock_the_out_dir_and_outside_files(tmp_path):
    out = tmp_path / "run"
    args = _ns(out=str(out), json=str(out / "rows.json"), csv=str(tmp_path / "r.csv"))
    assert argtypes.output_targets(args, "dir") == [(str(tmp_path / "r.csv"), "file"),
                                                    (str(out), "dir")]
    assert argtypes.output_targets(_ns(json="-", out=None), None) == []
