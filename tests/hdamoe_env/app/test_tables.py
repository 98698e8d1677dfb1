"""Tests of hdamoe_env.app.tables: the one table renderer (text, Markdown, LaTeX, CSV)."""

from __future__ import annotations

import csv
import io

import pytest

from hdamoe_env.app.tables import constant_columns, latex_escape, render_table
from hdamoe_env.config.errors import ConfigError

HEAD = ["method", "TBT µs", "± 95 %", "top-1"]
ROWS = [["hda-moe", 812.3456, 1.5, 1.0], ["tp", 1000.0, None, 1.0]]


def test_text_and_markdown():
    text = render_table(HEAD, ROWS, formats=[None, "{:.1f}", "{:.2f}", "{:.3f}"])
    lines = text.splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1   # aligned
    assert "812.3" in lines[1] and lines[2].split()[2] == "-"            # None -> missing
    md = render_table(HEAD, ROWS, style="markdown")
    assert md.splitlines()[0] == "| method | TBT µs | ± 95 % | top-1 |"
    assert md.splitlines()[1] == "|---|---|---|---|"
    assert "| hda-moe | 812.35 | 1.50 | 1.00 |" in md
    assert render_table(HEAD, ROWS, style="markdown", align="lrrr").splitlines()[1] == \
        "|:---|---:|---:|---:|"


def test_latex_escapes_and_booktabs():
    tex = render_table(HEAD + ["Δ %"], [r + ["+3_%"] for r in ROWS], style="latex",
                       caption="TBT_us")
    lines = tex.splitlines()
    assert lines[0] == "% TBT_us" and lines[1] == r"\begin{tabular}{lrrrr}"
    assert r"TBT $\mu$s & $\pm$ 95 \%" in tex and r"+3\_\%" in tex and r"$\Delta$ \%" in tex
    assert lines[-1] == r"\end{tabular}" and r"\bottomrule" in lines[-2]
    assert latex_escape("a&b#c") == r"a\&b\#c"


def test_csv_keeps_full_precision():
    text = render_table(HEAD, ROWS, style="csv")
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == HEAD and rows[1] == ["hda-moe", "812.3456", "1.5", "1.0"]
    assert rows[2][2] == ""                                   # missing value: empty field


def test_drop_constant_columns():
    assert constant_columns(HEAD, ROWS) == [3]
    md = render_table(HEAD, ROWS, style="markdown", drop_constant=True)
    assert "top-1" not in md and "method" in md
    one = render_table(HEAD, ROWS[:1], style="markdown", drop_constant=True)
    assert "top-1" in one                                     # one row: nothing to compare


def test_errors():
    with pytest.raises(ConfigError, match="table style"):
        render_table(HEAD, ROWS, style="html")
    with pytest.raises(ConfigError, match="row 0 has 2 cells"):
        render_table(HEAD, [["a", 1]])
    with pytest.raises(ConfigError, match="align"):
        render_table(HEAD, ROWS, align="lr")
