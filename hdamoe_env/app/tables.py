"""The one table renderer of the application layer: text, Markdown, LaTeX and CSV.

Every command that prints or writes a table goes through :func:`render_table` (``bench``,
``compare``, ``evaluate``, ``place``, ``simulate``, ``tune``, ``crossover``, ``claims``,
``traces stats``, ``traces fidelity``, ``bench-env``, the TensorBoard config text). A table is a
header and rows of cells; a cell that is not a string is formatted with its column's format
(``formats``) or the table's ``number`` format. No third-party dependency: neither tabulate nor
pandas is a dependency of the package.

Styles:

* ``"text"`` — columns padded to equal width, two spaces apart; right-aligned unless
  ``align`` says ``"l"`` (the terminal).
* ``"markdown"`` — a GitHub pipe table (alignment row from ``align``).
* ``"latex"`` — a ``booktabs`` ``tabular`` (``\\toprule``/``\\midrule``/``\\bottomrule``); the
  characters LaTeX treats specially are escaped and ``±``, ``×``, ``−``, ``µ``, ``≥``, ``≤``,
  ``÷`` become math-mode symbols, so the output compiles with ``\\usepackage{booktabs}`` alone.
* ``"csv"`` — RFC 4180 through the ``csv`` module; numbers are written unformatted
  (``repr``-exact), so the file keeps full precision.

``drop_constant=True`` removes the columns whose cells are identical in every row (after
formatting), except the first ``keep`` columns (the labels): a comparison table shows only
what differs between methods; the dropped columns are returned by :func:`constant_columns`
for a caption.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from typing import Any

from hdamoe_env.config.errors import ConfigError, unknown_name

__all__ = ["TABLE_STYLES", "constant_columns", "fmt", "latex_escape", "render_table"]

#: The output styles of :func:`render_table`.
TABLE_STYLES = ("text", "markdown", "latex", "csv")

_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                  "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}",
                  "^": r"\textasciicircum{}", "±": r"$\pm$", "×": r"$\times$", "−": r"$-$",
                  "µ": r"$\mu$", "μ": r"$\mu$", "≥": r"$\geq$", "≤": r"$\leq$", "÷": r"$\div$",
                  "–": "--", "—": "---", "·": r"$\cdot$", "τ": r"$\tau$", "γ": r"$\gamma$",
                  "Δ": r"$\Delta$", "‖": r"$\|$"}


def fmt(value: Any, spec: str = "{:.2f}", missing: str = "-") -> str:
    """Format a number with ``spec``; ``missing`` for None and non-finite floats."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return spec.format(value)


def latex_escape(text: str) -> str:
    """Return ``text`` with LaTeX's special characters escaped (and symbols in math mode)."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def _format_cell(cell: Any, spec: str, missing: str) -> str:
    if isinstance(cell, str):
        return cell
    return fmt(cell, spec, missing)


def _raw_cell(cell: Any) -> str:
    if cell is None or (isinstance(cell, float) and not math.isfinite(cell)):
        return ""
    if isinstance(cell, float):
        return repr(cell)
    return str(cell)


def constant_columns(head: Sequence[str], rows: Sequence[Sequence[Any]], *, keep: int = 1,
                     number: str = "{:.2f}", formats: Sequence[str | None] | None = None,
                     missing: str = "-") -> list[int]:
    """Return the indices (≥ ``keep``) of the columns whose formatted cells never differ.

    A table with fewer than two rows has no constant column (nothing is compared).
    """
    if len(rows) < 2:
        return []
    specs = _specs(head, number, formats)
    out = []
    for j in range(keep, len(head)):
        seen = {_format_cell(r[j], specs[j], missing) for r in rows}
        if len(seen) == 1:
            out.append(j)
    return out


def _specs(head: Sequence[str], number: str,
           formats: Sequence[str | None] | None) -> list[str]:
    if formats is None:
        return [number] * len(head)
    if len(formats) != len(head):
        raise ConfigError(f"formats has {len(formats)} entries for {len(head)} columns")
    return [number if f is None else f for f in formats]


def render_table(head: Sequence[str], rows: Iterable[Sequence[Any]], *, style: str = "text",
                 number: str = "{:.2f}", formats: Sequence[str | None] | None = None,
                 align: str | None = None, drop_constant: bool = False, keep: int = 1,
                 missing: str = "-", caption: str | None = None) -> str:
    """Render a table in one of :data:`TABLE_STYLES`.

    Args:
        head: Column titles.
        rows: Rows of cells, one per column; strings are printed as they are, other cells
            formatted with the column's entry of ``formats`` (else ``number``); None and
            non-finite floats print as ``missing`` (an empty CSV field).
        style: ``"text"``, ``"markdown"``, ``"latex"`` or ``"csv"``.
        number: Default format of non-string cells.
        formats: Per-column formats (None entries fall back to ``number``).
        align: One letter per column, ``"l"`` or ``"r"`` (default: all right-aligned in text,
            left for the first column in Markdown/LaTeX).
        drop_constant: Drop the columns that are identical in every row (not the first
            ``keep``); only with at least two rows.
        keep: Leading label columns never dropped.
        missing: Text of a missing value.
        caption: LaTeX only: a ``% caption`` comment line above the tabular (the surrounding
            ``table`` environment is the paper's business).

    Returns:
        The table, one line per row, without a trailing newline (CSV: with ``\\n`` line ends,
        no trailing newline either).

    Raises:
        ConfigError: Unknown style, or rows whose length differs from the header.
    """
    if style not in TABLE_STYLES:
        raise unknown_name("table style", style, TABLE_STYLES)
    head = list(head)
    rows = [list(r) for r in rows]
    for i, r in enumerate(rows):
        if len(r) != len(head):
            raise ConfigError(f"table row {i} has {len(r)} cells for {len(head)} columns: {r}")
    specs = _specs(head, number, formats)
    if align is not None and len(align) != len(head):
        raise ConfigError(f"align {align!r} has {len(align)} letters for {len(head)} columns")
    aligns = list(align) if align is not None else (
        ["r"] * len(head) if style == "text" else ["l"] + ["r"] * (len(head) - 1))
    if drop_constant:
        dropped = set(constant_columns(head, rows, keep=keep, number=number, formats=formats,
                                       missing=missing))
        kept = [j for j in range(len(head)) if j not in dropped]
        head = [head[j] for j in kept]
        rows = [[r[j] for j in kept] for r in rows]
        specs = [specs[j] for j in kept]
        aligns = [aligns[j] for j in kept]
    if style == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(head)
        writer.writerows([_raw_cell(c) for c in r] for r in rows)
        return buf.getvalue().rstrip("\n")
    cells = [[_format_cell(c, specs[j], missing) for j, c in enumerate(r)] for r in rows]
    if style == "markdown":
        rule = (["---"] * len(head) if align is None else
                ["---:" if a == "r" else ":---" for a in aligns])
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in cells]
        return "\n".join(lines)
    if style == "latex":
        lines = [f"% {caption}"] if caption else []
        lines += [r"\begin{tabular}{" + "".join(aligns) + "}", r"\toprule",
                  " & ".join(latex_escape(h) for h in head) + r" \\", r"\midrule"]
        lines += [" & ".join(latex_escape(c) for c in r) + r" \\" for r in cells]
        lines += [r"\bottomrule", r"\end{tabular}"]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[j]) for r in cells)) if cells else len(h)
              for j, h in enumerate(head)]

    def line(items: Sequence[str]) -> str:
        return "  ".join(t.ljust(w) if a == "l" else t.rjust(w)
                         for t, w, a in zip(items, widths, aligns, strict=True)).rstrip()

    return "\n".join([line(head), *(line(r) for r in cells)])
