"""CLI usability (issue 14): help texts, ``--json -``, logging configuration."""

from __future__ import annotations

import argparse
import json
import logging
import re

import pytest

from hdamoe_env.app import progress
from hdamoe_env.app.cli import build_parser, main
from hdamoe_env.app.logs import PACKAGES, configure_logging


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


def test_configure_logging_levels(restore_logging):
    assert configure_logging(0, False) == logging.WARNING
    assert configure_logging(1, False) == logging.INFO
    assert configure_logging(2, False) == logging.DEBUG
    assert all(logging.getLogger(p).level == logging.DEBUG for p in PACKAGES)
    assert logging.getLogger("numba").getEffectiveLevel() >= logging.WARNING
    handlers = [h for h in logging.getLogger().handlers if h.get_name() == "hdamoe-cli"]
    assert len(handlers) == 1                          # idempotent
    assert configure_logging(3, True) == logging.ERROR
    assert progress.bar(1, "x").__class__.__name__ == "_Silent"


def test_main_configures_logging_from_the_global_flags(restore_logging, monkeypatch):
    seen = {}
    monkeypatch.setattr("hdamoe_env.app.cli.configure_logging",
                        lambda verbose, quiet: seen.update(verbose=verbose, quiet=quiet))
    with pytest.raises(SystemExit):
        main(["--version"])
    main(["traces", "stats", "synthetic:mixtral-8x7b", "--requests", "2", "--batch", "4"])
    # until the global -v/-q flags exist, main() passes the neutral values
    assert seen == {"verbose": 0, "quiet": False}
