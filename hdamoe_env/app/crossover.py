"""Where each method wins, and which knob decides it (``hdamoe crossover``).

A sensitivity grid over models × hardware settings × batch sizes × cost-model knobs. Every cell
is one benchmark of the methods (TP, EP, hybrid, Node Balance, Node+Link, HD-MoE, HDA-MoE) on
identical episodes, run through the resumable cell machinery of :mod:`hdamoe_env.app.reproduce`
(one atomic JSON file per finished cell, process pool or Ray). The knob axis is
one-at-a-time around the base profile: the base cell of every (model, setting, B) uses the
profile as is; a knob cell changes one knob to one other value through a derived profile name
(``faithful+b_psum=2``, paper-model.md §4), so every record names the conventions that produced
it.

[decision] Placements of a knob cell are the ones optimised under the base profile
(``placement_from``): the question a knob cell answers is "would the ranking change if the
hardware behaved like this", not "what would the optimiser do"; ``replace=True`` re-optimises
the placements under every derived profile instead (one quick pipeline per knob value).

The workload axis ``trace_skew`` (:data:`TRACE_KNOBS`) is swept the same way but changes the
trace, not the profile: a cell runs the base profile on the synthetic trace generated with skew
power τ (``traces.synthetic``: expert popularity p ← p^τ) and every record names it
(``trace_skew``). [decision] Its placements are always optimised on the skewed trace (one
placement cell per τ, keyed by it): a deployment profiles the routing it serves, so keeping the
τ = 1 placements would measure a mismatch between profile and workload, not the effect of skew.
Models whose base trace is a real one (Mixtral on its reasoning trace) have no skew cells.

Energy (docs/PHYSICS.md §18): every cell's row carries each method's energy per token
(``j_per_token``), its ratio to TP's and the energy winner beside the latency winner. The four
pJ values of :data:`hdamoe_env.config.uncertainty.ENERGY_UNCERTAINTIES` (``dram_pj_per_bit``,
``noc_pj_per_bit_hop``, ``mac_pj``, ``static_w_per_node``; aliases ``e_dram``, ``e_hop``,
``e_mac``, ``p_static``) are knobs too, but they change no schedule: a knob cell of one of
them is not simulated, the base cell's recorded breakdown is re-priced exactly (each part is
linear in one value, as in ``hdamoe energy-report``), so only the energy winner can change
(``energy_knob_rows`` of ``crossover.json``, heat maps ``crossover_energy_<knob>.png``).

Outputs in ``OUT``: ``results.jsonl`` (every bench record), ``crossover.json`` (per cell: the
winner, the runner-up and the margin, TBT of every method), ``figures/crossover_<knob>.png``
(heat maps: rows = model · setting · B, columns = knob values, colour = winner, text = margin
over the runner-up) and ``crossover.md`` ("where each method wins and why").
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env.app.argtypes import batch_list, model_list, positive_int, seed_list, setting_list
from hdamoe_env.app.records import read_jsonl, summarise
from hdamoe_env.app.tables import render_table
from hdamoe_env.app.reproduce import (
    BACKENDS,
    DEFAULT_MIXTRAL_DIR,
    Cell,
    bench_cfg,
    dedupe_cells,
    model_trace,
    placement_key,
    run_suite_printing,
)
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.fileio import atomic_write, write_json
from hdamoe_env.config.profiles import Conventions, get_profile
from hdamoe_env.config.uncertainty import ENERGY_UNCERTAINTIES

__all__ = ["DEFAULT_KNOBS", "ENERGY_KNOBS", "KNOB_ALIASES", "METHODS", "TRACE_KNOBS", "analyse",
           "cmd_crossover", "crossover_cells", "energy_knob_rows", "parse_knob",
           "write_crossover_report"]

log = logging.getLogger(__name__)

#: Methods compared in every cell.
METHODS: tuple[str, ...] = ("tp", "tp-tiled", "ep", "hybrid", "node-balance", "node-link",
                            "hd-moe", "hda-moe", "eplb", "eplb-dynamic")
#: Knob values swept one at a time (only knobs the ``Conventions`` of this version define are
#: used): start-up latency per message / collective step, partial-sum bytes, PE-array tile
#: width, per-GEMM overhead, DRAM efficiency and the mean decode context (``context_len``)
#: (docs/PHYSICS.md gives each default and its source; ``--knob col_granularity=8,64`` or
#: ``--knob psum_combine=False`` sweep the other knobs of PHYSICS.md §2 and §4).
DEFAULT_KNOBS: dict[str, tuple[Any, ...]] = {
    "msg_alpha_s": (0.0, 1e-7, 1e-6),
    "hop_latency_s": (0.0, 2e-9, 1e-8),
    "b_psum": (2, 4),
    "tile_cols": (1, 64),
    "tile_tokens": (1, 8),
    "gemm_overhead_s": (0.0, 1e-7, 1e-6),
    "dram_efficiency": (0.7, 0.85, 1.0),
    "nonmoe_ctx_len": (512, 1226, 4096, 8192),
    "trace_skew": (0.5, 1.5, 2.0),
    # the energy values: the ends of their credible ranges (ENERGY_UNCERTAINTIES); re-priced
    **{k: (u.low, u.high) for k, u in ENERGY_UNCERTAINTIES.items()},
}
#: Energy knobs (``cost.energy.EnergySpec`` fields): swept by re-pricing the base cells.
ENERGY_KNOBS: tuple[str, ...] = tuple(ENERGY_UNCERTAINTIES)
#: Alternative names accepted by ``--knob`` (``context_len`` is the per-request mean context of
#: ``cost.context``, the profile knob ``nonmoe_ctx_len``; ``e_*`` / ``p_static`` the energy
#: values of docs/PHYSICS.md §18).
KNOB_ALIASES: dict[str, str] = {"context_len": "nonmoe_ctx_len", "e_dram": "dram_pj_per_bit",
                                "e_hop": "noc_pj_per_bit_hop", "e_mac": "mac_pj",
                                "p_static": "static_w_per_node"}
#: Knobs of the workload rather than of the profile, with their base value: ``trace_skew`` is
#: the skew power τ of the synthetic trace's expert popularity (p ← p^τ; 1 = fitted generator).
TRACE_KNOBS: dict[str, float] = {"trace_skew": 1.0}
SUITES = {
    "tiny": {"models": ("deepseek-v2-lite",), "settings": ("5/50",), "batches": (8,),
             "steps": 1, "seeds": (0,), "requests": 16},
    "quick": {"models": ("deepseek-v2-lite", "mixtral-8x7b"),
              "settings": ("2.5/75", "5/50", "10/25"), "batches": (128,), "steps": 4,
              "seeds": (0,), "requests": None},
    "full": {"models": ("deepseek-v2-lite", "mixtral-8x7b", "qwen2-57b-a14b"),
             "settings": ("2.5/75", "5/50", "10/25"), "batches": (32, 128), "steps": 8,
             "seeds": (0, 1), "requests": None},
}
_FIGURE = "crossover"


def parse_knob(text: str) -> tuple[str, tuple[Any, ...]]:
    """Parse ``NAME=v1,v2,…`` (values typed like the knob's default), or ``NAME`` alone.

    ``NAME`` alone selects the knob's values of :data:`DEFAULT_KNOBS`. ``trace_skew`` values
    are skew powers τ: finite numbers > 0.

    Raises:
        ConfigError: Unknown knob or a value of the wrong type (the message says which).
    """
    name, sep, values = text.partition("=")
    name = KNOB_ALIASES.get(name.strip(), name.strip())
    if not sep and name in DEFAULT_KNOBS:
        return name, tuple(DEFAULT_KNOBS[name])
    if not sep or not values.strip():
        raise ConfigError(f"--knob {text!r}: expected NAME=v1,v2 (e.g. b_psum=2,4 or "
                          f"trace_skew=0.5,2) or a knob name of the default grid "
                          f"{sorted(DEFAULT_KNOBS)}")
    raws = [v.strip() for v in values.split(",") if v.strip()]
    if name in TRACE_KNOBS:
        return name, tuple(_trace_knob_value(name, raw) for raw in raws)
    if name in ENERGY_KNOBS:
        from hdamoe_env.cost.energy import EnergySpec

        vals = []
        for raw in raws:
            try:
                vals.append(getattr(EnergySpec(**{name: float(raw)}), name))
            except ValueError:
                raise ConfigError(f"--knob {name}: {raw!r} is not a finite number >= 0; "
                                  f"expected e.g. {name}=0.2,2") from None
        return name, tuple(vals)
    parsed = []
    for raw in raws:
        conv = get_profile(f"faithful+{name}={raw}")   # typed, validated, names unknown knobs
        parsed.append(getattr(conv, name))
    return name, tuple(parsed)


def _trace_knob_value(name: str, raw: Any) -> float:
    """Return a workload-knob value (a skew power τ) as a float, or raise ``ConfigError``."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--knob {name}: {raw!r} is not a finite number > 0; expected skew "
                          f"powers like {name}=0.5,1.5,2")
    return value


def _knob_grid(base: Conventions, knobs: Mapping[str, Sequence[Any]]) -> list[tuple[str, Any]]:
    """Return (knob, value) pairs that differ from the base, for knobs this version defines.

    Profile knobs are compared with the base profile, workload knobs (:data:`TRACE_KNOBS`)
    with their base value.
    """
    fields = {f.name for f in dataclasses.fields(base)}
    grid = []
    for knob, values in knobs.items():
        if knob in TRACE_KNOBS:
            grid += [(knob, _trace_knob_value(knob, v)) for v in values
                     if _trace_knob_value(knob, v) != TRACE_KNOBS[knob]]
            continue
        if knob in ENERGY_KNOBS:     # no cells: the report re-prices the base cells
            continue
        if knob not in fields:
            log.info("knob %s is not defined by this version's profiles; skipped", knob)
            continue
        grid += [(knob, v) for v in values if v != getattr(base, knob)]
    return grid





def crossover_cells(*, base: str = "faithful", models: Sequence[str] = SUITES["quick"]["models"],
                    settings: Sequence[str] = SUITES["quick"]["settings"],
                    batches: Sequence[int] = (128,),
                    knobs: Mapping[str, Sequence[Any]] | None = None,
                    methods: Sequence[str] = METHODS, steps: int = 4,
                    seeds: Sequence[int] = (0,), requests: int | None = None,
                    mixtral_dir: str | None = DEFAULT_MIXTRAL_DIR,
                    replace: bool = False) -> list[Cell]:
    """Return the cells of a crossover grid (placement cells first).

    Args:
        base: Base profile (name or derived name).
        models: Model presets; Mixtral runs on its real reasoning trace (left out when
            ``mixtral_dir`` has none), the others on their synthetic traces.
        settings: Hardware settings ``TFLOPS/GBps``.
        batches: Batch sizes B.
        knobs: Knob → values swept one at a time (default :data:`DEFAULT_KNOBS`).
        methods: Methods compared in every cell.
        steps: Decode steps per episode.
        seeds: Episode seeds.
        requests: Requests of the synthetic traces (None: the generator's default).
        mixtral_dir: Directory of the real Mixtral traces.
        replace: Re-optimise the placements under every derived profile.

    Raises:
        ConfigError: Unknown profile or knob values.
    """
    base_conv = get_profile(base)
    grid = _knob_grid(base_conv, DEFAULT_KNOBS if knobs is None else knobs)
    cells: list[Cell] = []
    needs_placement = any(m not in ("tp", "tp-tiled", "ep") for m in methods)
    for model in models:
        trace = model_trace(model, mixtral_dir)
        if trace is None:
            continue
        extra = {} if requests is None else {"trace_requests": int(requests)}
        model_grid = grid
        if trace != "synthetic" and any(knob in TRACE_KNOBS for knob, _ in grid):
            log.warning("%s runs on a real trace; its trace-skew cells are skipped", model)
            model_grid = [(knob, value) for knob, value in grid if knob not in TRACE_KNOBS]
        for setting in settings:
            place_cfg = bench_cfg(model, trace, setting, 128, base_conv.name, **extra)
            if needs_placement:
                cells.append(Cell("placements", "placement",
                                  {"config": placement_key(place_cfg)}))
            for batch in batches:
                variants = [(None, None, base_conv.name)] + [
                    (knob, value, base_conv.name if knob in TRACE_KNOBS
                     else get_profile(base_conv, **{knob: value}).name)
                    for knob, value in model_grid]
                for knob, value, profile in variants:
                    workload = {knob: value} if knob in TRACE_KNOBS else {}
                    cfg = bench_cfg(model, trace, setting, int(batch), profile, steps=int(steps),
                                    **extra, **workload)
                    params: dict[str, Any] = {"config": cfg, "methods": list(methods),
                                              "seeds": [int(s) for s in seeds]}
                    if workload and needs_placement:   # placements optimised on this trace
                        skewed = bench_cfg(model, trace, setting, 128, base_conv.name, **extra,
                                           **workload)
                        cells.append(Cell("placements", "placement",
                                          {"config": placement_key(skewed)}))
                        params["placement_from"] = placement_key(skewed)
                    elif knob is not None and needs_placement:
                        if replace:
                            cells.append(Cell("placements", "placement",
                                              {"config": placement_key(cfg)}))
                        else:
                            params["placement_from"] = placement_key(place_cfg)
                    tags = {"base": base_conv.name, "knob": knob or "base",
                            "value": value if knob is not None else None}
                    cells.append(Cell(_FIGURE, "bench", params, tags))
    return dedupe_cells(cells)


# ------------------------------------------------------------------------------------ analysis
def analyse(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summarise every crossover cell: winner, runner-up, margin and TBT of every method.

    Args:
        records: Bench records of ``results.jsonl`` (others are ignored).

    Returns:
        One row per cell, in record order: model, setting, batch, profile, trace_skew, knob,
        value, winner, runner_up, margin (TBT(runner-up) ÷ TBT(winner)), tbt_us per method,
        top-1 retention of the winner; with energy records also ``j_per_token`` and
        ``energy_over_tp`` per method, ``energy_parts_j`` per method (mean step breakdown),
        ``energy_winner`` (ties within ``robust.TIE_RTOL`` go to the method listed first) and
        ``energy_margin`` (J(runner-up) ÷ J(winner)); None/absent for records without energy.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if rec.get("kind") == "bench" and rec.get("figure") == _FIGURE:
            groups.setdefault(rec["cell"], []).append(rec)
    rows = []
    for cell, recs in groups.items():
        summary = {r["method"]: r for r in summarise(recs)}
        ranked = sorted(summary.values(), key=lambda r: r["tbt_us"])
        first = ranked[0]
        second = ranked[1] if len(ranked) > 1 else None
        meta = recs[0]
        rows.append({
            "cell": cell, "model": meta["model"], "setting": meta["setting"],
            "batch": meta["batch"], "profile": meta["profile"],
            "trace_skew": float(meta.get("trace_skew", 1.0)), "knob": meta.get("knob"),
            "value": meta.get("value"), "winner": first["method"],
            "runner_up": None if second is None else second["method"],
            "margin": None if second is None else second["tbt_us"] / first["tbt_us"],
            "tbt_us": {m: r["tbt_us"] for m, r in summary.items()},
            "winner_top1_retention": first.get("top1_retention"),
            **_energy_fields(summary),
        })
    return rows


_PARTS = ("dram", "noc", "compute", "static")


def _energy_fields(summary: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Energy per method of one cell's summary rows, the energy winner and its margin."""
    have = {m: r for m, r in summary.items() if r.get("j_per_token") is not None}
    if not have:
        return {"j_per_token": {}, "energy_winner": None, "energy_margin": None}
    jpt = {m: float(r["j_per_token"]) for m, r in have.items()}
    winner, margin = _lowest(jpt)
    return {"j_per_token": jpt,
            "energy_over_tp": {m: r.get("energy_over_tp") for m, r in have.items()},
            "energy_parts_j": {m: {p: r.get(f"{p}_j") for p in _PARTS} for m, r in have.items()},
            "energy_winner": winner, "energy_margin": margin}


def _lowest(values: Mapping[str, float]) -> tuple[str, float | None]:
    """The lowest method (ties within TIE_RTOL: METHODS order) and runner-up ÷ winner."""
    from hdamoe_env.app.robust import lowest_winner

    order = [m for m in METHODS if m in values] + [m for m in values if m not in METHODS]
    winner, _ = lowest_winner(values, order)
    others = [v for m, v in values.items() if m != winner]
    return winner, (min(others) / values[winner] if others and values[winner] > 0 else None)


def energy_knob_rows(rows: Sequence[Mapping[str, Any]],
                     knobs: Mapping[str, Sequence[float]]) -> list[dict[str, Any]]:
    """Re-price every base cell under each energy knob value (no re-simulation).

    Each part of a method's recorded step energy is linear in one energy value (docs/PHYSICS.md
    §18: DRAM bits, NoC bit-hops, MACs, node-seconds), and none changes a latency, so under a
    knob value v the part scales by v ÷ the value the records were priced with (the base
    profile's ``EnergySpec``); TBT and the latency winner stay the base cell's.

    Args:
        rows: :func:`analyse` rows (base cells with energy are used).
        knobs: energy knob → values.

    Returns:
        One row per (base cell, knob, value ≠ base value): the base row's identity fields,
        ``knob``, ``value``, ``winner`` (the latency winner, unchanged), ``j_per_token`` per
        method, ``energy_winner`` and ``energy_margin``.
    """
    from hdamoe_env.app.energy_report import PART_KNOB
    from hdamoe_env.cost.energy import energy_spec_for

    out = []
    for row in rows:
        if row["knob"] != "base" or not row.get("energy_parts_j"):
            continue
        spec = energy_spec_for(row["profile"])
        for knob, values in knobs.items():
            if knob not in ENERGY_KNOBS:
                continue
            base_value = float(getattr(spec, knob))
            for value in values:
                if float(value) == base_value or base_value <= 0:
                    continue
                jpt = {}
                for method, parts in row["energy_parts_j"].items():
                    if any(parts.get(p) is None for p in _PARTS):
                        continue
                    total = sum(float(parts[p]) * (float(value) / base_value
                                                   if PART_KNOB[p] == knob else 1.0)
                                for p in _PARTS)
                    jpt[method] = total / float(row["batch"])
                if not jpt:
                    continue
                winner, margin = _lowest(jpt)
                out.append({k: row[k] for k in ("cell", "model", "setting", "batch", "profile",
                                                "trace_skew", "winner", "margin")}
                           | {"knob": knob, "value": float(value), "j_per_token": jpt,
                              "energy_winner": winner, "energy_margin": margin,
                              "base_energy_winner": row["energy_winner"]})
    return out


def _row_label(row: Mapping[str, Any]) -> str:
    return f"{row['model']} {row['setting']} B={row['batch']}"


def _base_value(knob: str, base_row: Mapping[str, Any]) -> Any:
    """Return the value a knob has in a base cell (its profile's, or the trace's skew)."""
    if knob in TRACE_KNOBS:
        return float(base_row.get(knob, TRACE_KNOBS[knob]))
    if knob in ENERGY_KNOBS:
        from hdamoe_env.cost.energy import energy_spec_for

        return float(getattr(energy_spec_for(base_row["profile"]), knob))
    return getattr(get_profile(base_row["profile"]), knob, None)


def _heatmaps(rows: Sequence[dict[str, Any]], out: Path, *, prefix: str = "crossover",
              what: str = "winner") -> list[str]:
    """Draw one winner heat map per knob; return the written file names (empty without mpl).

    ``prefix`` names the files (``<prefix>_<knob>.png``), ``what`` the title's quantity.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        log.warning("matplotlib is not installed; no heat maps (pip install 'hdamoe-env[plot]')")
        return []
    base = {_row_label(r): r for r in rows if r["knob"] == "base"}
    knobs = sorted({r["knob"] for r in rows if r["knob"] != "base"})
    methods = list(METHODS) + sorted({r["winner"] for r in rows} - set(METHODS))
    cmap = ListedColormap(plt.get_cmap("tab10").colors[: len(methods)])
    written = []
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for knob in knobs:
        sub = [r for r in rows if r["knob"] == knob]
        labels = sorted(base) if base else sorted({_row_label(r) for r in sub})
        values = sorted({r["value"] for r in sub} | {base[lab]["value"] for lab in base
                                                     if base[lab]["value"] is not None})
        default = _base_value(knob, next(iter(base.values()))) if base else None
        if default is not None and default not in values:
            values = sorted([*values, default])
        grid = [[None] * len(values) for _ in labels]
        for i, lab in enumerate(labels):
            for j, v in enumerate(values):
                hit = next((r for r in sub if _row_label(r) == lab and r["value"] == v), None)
                if hit is None and default is not None and default == v:
                    hit = base.get(lab)
                grid[i][j] = hit
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(values), 0.9 + 0.42 * len(labels)))
        codes = [[methods.index(c["winner"]) if c else -1 for c in row] for row in grid]
        arr = np.ma.masked_less(np.array(codes, dtype=float), 0)
        ax.imshow(arr, cmap=cmap, vmin=0, vmax=len(methods) - 1, aspect="auto")
        for i, row in enumerate(grid):
            for j, c in enumerate(row):
                if c is not None:
                    text = c["winner"] + (f"\n×{c['margin']:.2f}" if c["margin"] else "")
                    ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(values)), [f"{v:g}" if isinstance(v, float) else str(v)
                                           for v in values])
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel(knob)
        ax.set_title(f"{what} by {knob} (×: margin)", fontsize=9)
        fig.tight_layout()
        name = f"{prefix}_{knob}.png"
        fig.savefig(out / "figures" / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def write_crossover_report(out_dir: str | os.PathLike[str], *, command: str | None = None,
                           knobs: Mapping[str, Sequence[Any]] | None = None) -> Path:
    """Analyse ``OUT/results.jsonl``; write ``crossover.json``, heat maps and ``crossover.md``.

    ``knobs`` (default :data:`DEFAULT_KNOBS`): its energy knobs are swept by re-pricing the
    base cells (:func:`energy_knob_rows`).

    Returns:
        The path of ``crossover.md``.

    Raises:
        ConfigError: ``results.jsonl`` is missing or has no crossover records.
    """
    out = Path(out_dir)
    rows = analyse(read_jsonl(out, hint="run `hdamoe crossover --out DIR` first"))
    if not rows:
        raise ConfigError(f"{out / 'results.jsonl'} has no crossover records; run "
                          f"`hdamoe crossover --out {out}` first")
    energy_values = {k: v for k, v in (DEFAULT_KNOBS if knobs is None else knobs).items()
                     if k in ENERGY_KNOBS}
    e_rows = energy_knob_rows(rows, energy_values)
    write_json(out / "crossover.json", {"rows": rows, "energy_knob_rows": e_rows})
    figures = _heatmaps(rows, out)
    base = [r for r in rows if r["knob"] == "base"]
    lines = ["# Where each method wins and why", ""]
    if command:
        lines += [f"Regenerate: `{command}`.", ""]
    profiles = sorted({r["profile"] for r in base})
    lines += [f"Base profile: {', '.join(f'`{p}`' for p in profiles)}. Each knob cell changes "
              "one knob of the base profile (derived profile names in the `profile` column of "
              "`crossover.json`); TBT in µs per decode step, mean over the episode seeds. "
              "Margin = TBT(runner-up) ÷ TBT(winner).", ""]
    if any(r["knob"] in TRACE_KNOBS for r in rows):
        lines += ["`trace_skew` is the workload knob: the base profile on the synthetic trace "
                  "whose expert popularity is raised to the power τ (p ← p^τ, docs/PHYSICS.md "
                  "§10; τ = 1 is the base cell), with placements optimised on that same trace.",
                  ""]
    lines += ["## Winners under the base profile", "",
              render_table(["model", "setting", "B", "winner", "runner-up", "margin",
                            *METHODS],
                           [[r["model"], r["setting"], str(r["batch"]), r["winner"],
                             str(r["runner_up"]), f"{r['margin']:.3f}" if r["margin"] else "-",
                             *[f"{r['tbt_us'][m]:.1f}" if m in r["tbt_us"] else "-"
                               for m in METHODS]] for r in base], style="markdown"), ""]
    lines += _energy_section(base, e_rows, out)
    lines += ["## Knobs that change the winner", ""]
    by_cell = {_row_label(r): r for r in base}
    flips = []
    for r in rows:
        if r["knob"] == "base":
            continue
        ref = by_cell.get(_row_label(r))
        if ref is not None and ref["winner"] != r["winner"]:
            flips.append([_row_label(r), f"{r['knob']} = {r['value']}", ref["winner"],
                          r["winner"], f"{r['margin']:.3f}" if r["margin"] else "-"])
    if flips:
        lines += [render_table(["cell", "knob", "base winner", "winner", "margin"], flips,
                               style="markdown"), ""]
    else:
        lines += ["No single knob change in the grid changes any cell's winner.", ""]
    knobs = sorted({r["knob"] for r in rows if r["knob"] != "base"})
    for knob in knobs:
        sub = [r for r in rows if r["knob"] == knob]
        changed = sum(1 for r in sub if (ref := by_cell.get(_row_label(r))) is not None
                      and ref["winner"] != r["winner"])
        lines.append(f"* `{knob}`: {changed} of {len(sub)} knob cells change the winner.")
    if knobs:
        lines += ["", "## Every knob cell", "",
                  render_table(["model", "setting", "B", "knob", "value", "winner", "runner-up",
                                "margin", *METHODS],
                               [[r["model"], r["setting"], str(r["batch"]), r["knob"],
                                 f"{r['value']:g}" if isinstance(r["value"], float)
                                 else str(r["value"]), r["winner"], str(r["runner_up"]),
                                 f"{r['margin']:.3f}" if r["margin"] else "-",
                                 *[f"{r['tbt_us'][m]:.1f}" if m in r["tbt_us"] else "-"
                                   for m in METHODS]]
                                for knob in knobs for r in rows if r["knob"] == knob],
                               style="markdown")]
    if figures:
        lines += ["", "## Heat maps", ""] + [f"![{f}](figures/{f})" for f in figures]
    text = "\n".join(lines) + "\n"
    path = out / "crossover.md"
    atomic_write(path, lambda fh: fh.write(text))
    return path


def _energy_section(base: Sequence[Mapping[str, Any]], e_rows: Sequence[Mapping[str, Any]],
                    out: Path) -> list[str]:
    """The energy part of ``crossover.md``: energy winners and the re-priced energy knobs."""
    with_energy = [r for r in base if r.get("energy_winner")]
    if not with_energy:
        return []
    lines = ["## Energy per token under the base profile (docs/PHYSICS.md §18)", "",
             "mJ per token per method (energy ÷ TP's in brackets), means over the episode "
             "seeds; margin = energy of the runner-up ÷ the winner's.", "",
             render_table(["model", "setting", "B", "latency winner", "energy winner",
                           "same", "margin", *METHODS],
                          [[r["model"], r["setting"], str(r["batch"]), r["winner"],
                            r["energy_winner"], "yes" if r["winner"] == r["energy_winner"]
                            else "**no**",
                            f"{r['energy_margin']:.4f}" if r["energy_margin"] else "-",
                            *[f"{1e3 * r['j_per_token'][m]:.3f}"
                              + (f" ({r['energy_over_tp'][m]:.3f})"
                                 if r.get("energy_over_tp", {}).get(m) is not None else "")
                              if m in r["j_per_token"] else "-" for m in METHODS]]
                           for r in with_energy], style="markdown"), ""]
    if not e_rows:
        return lines
    knobs = sorted({r["knob"] for r in e_rows})
    lines += ["## Energy knobs (re-priced, not re-simulated)", "",
              "Each knob cell re-prices its base cell's recorded breakdown with one energy "
              "value changed (every part is linear in one value; no latency changes, so the "
              "latency winner stays the base cell's).", ""]
    flips = [[_row_label(r), f"{r['knob']} = {r['value']:g}", r["base_energy_winner"],
              r["energy_winner"], f"{r['energy_margin']:.4f}" if r["energy_margin"] else "-"]
             for r in e_rows if r["energy_winner"] != r["base_energy_winner"]]
    if flips:
        lines += [render_table(["cell", "knob", "base energy winner", "energy winner",
                                "margin"], flips, style="markdown"), ""]
    else:
        lines += ["No energy value in the grid changes any cell's energy winner.", ""]
    for knob in knobs:
        sub = [r for r in e_rows if r["knob"] == knob]
        changed = sum(1 for r in sub if r["energy_winner"] != r["base_energy_winner"])
        values = ", ".join(f"{v:g}" for v in sorted({r["value"] for r in sub}))
        lines.append(f"* `{knob}` ({values}): {changed} of {len(sub)} re-priced cells change "
                     "the energy winner.")
    heat = ([{**r, "winner": r["energy_winner"], "margin": r["energy_margin"]}
             for r in with_energy]
            + [{**r, "winner": r["energy_winner"], "margin": r["energy_margin"]}
               for r in e_rows])
    figures = _heatmaps(heat, out, prefix="crossover_energy", what="energy winner")
    if figures:
        lines += [""] + [f"![{f}](figures/{f})" for f in figures]
    return lines + [""]


# ----------------------------------------------------------------------------------------- CLI
def cmd_crossover(args: argparse.Namespace) -> int:
    """Run ``hdamoe crossover``; return the exit code."""
    suite = SUITES[args.suite]
    if getattr(args, "robust", False):
        from hdamoe_env.app.robust import cmd_robust

        return cmd_robust(args, suite)
    knobs = dict(parse_knob(k) for k in args.knob) if args.knob else None
    mixtral_dir = args.mixtral_dir if args.mixtral_dir and Path(args.mixtral_dir).is_dir() else None
    if "mixtral-8x7b" in (args.models or suite["models"]) and mixtral_dir is None:
        print(f"hdamoe crossover: {args.mixtral_dir!r} not found; Mixtral cells are skipped "
              "(pass --mixtral-dir DIR)", file=sys.stderr)
    cells = crossover_cells(
        base=args.conventions, models=args.models or suite["models"],
        settings=args.settings or suite["settings"], batches=args.batches or suite["batches"],
        knobs=knobs, steps=args.steps or suite["steps"], seeds=args.seeds or suite["seeds"],
        requests=suite["requests"], mixtral_dir=mixtral_dir, replace=args.replace,
        methods=args.methods or METHODS)
    if args.list:
        for cell in cells:
            print(f"{cell.key}  {cell.label}")
        print(f"{len(cells)} cells")
        return 0
    command = " ".join(
        ["hdamoe crossover", f"--suite {args.suite}", f"--out {args.out}"]
        + [f"--{name.replace('_', '-')} {','.join(str(v) for v in value)}"
           for name, value in (("models", args.models), ("settings", args.settings),
                               ("batches", args.batches), ("methods", args.methods),
                               ("seeds", args.seeds)) if value]
        + [f"--knob {k}" for k in args.knob]
        + ([f"--steps {args.steps}"] if args.steps else [])
        + ([f"--conventions {args.conventions}"] if args.conventions != "faithful" else [])
        + (["--replace"] if args.replace else []))
    if not args.report_only:
        run_suite_printing(cells, args.out, args, resume=not args.fresh)
    path = write_crossover_report(args.out, command=command, knobs=knobs)
    print(f"wrote {path}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Define the options of ``hdamoe crossover`` on ``p``."""
    def csv(kind: type) -> Any:
        def parse(text: str) -> list[Any]:
            try:
                return [kind(v) for v in text.split(",") if v.strip()]
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: expected a comma list of {kind.__name__} values") from None
        return parse

    p.add_argument("--out", required=True, help="output directory (cells/, results.jsonl, "
                   "crossover.json, crossover.md, figures/)")
    p.add_argument("--suite", default="quick", choices=sorted(SUITES),
                   help="grid size: tiny (seconds), quick (DeepSeek + Mixtral, 3 settings, "
                   "B=128), full (+ Qwen2, B=32 and 128, 2 seeds)")
    p.add_argument("--conventions", default="faithful", help="base profile (or derived name)")
    p.add_argument("--models", type=model_list, default=None, help="comma list of model presets "
                   "(default: the suite's)")
    p.add_argument("--settings", type=setting_list, default=None,
                   help="comma list of TFLOPS/GBps settings (default: the suite's)")
    p.add_argument("--batches", type=batch_list, default=None,
                   help="comma list of batch sizes (default: the suite's)")
    p.add_argument("--knob", action="append", default=[], metavar="NAME[=V1,V2]",
                   help="knob values swept one at a time (repeatable; NAME alone: its default "
                   "values; default: the msg_alpha_s, hop_latency_s, b_psum, tile_cols, "
                   "tile_tokens, gemm_overhead_s, dram_efficiency, nonmoe_ctx_len and "
                   "trace_skew grid, and the four energy values at the ends of their ranges; "
                   "trace_skew=0.5,2 sweeps the synthetic trace's popularity "
                   "skew power τ; context_len=512,8192 is nonmoe_ctx_len; e_dram, e_hop, "
                   "e_mac, p_static (= dram_pj_per_bit, noc_pj_per_bit_hop, mac_pj, "
                   "static_w_per_node) are re-priced from the base cells, not simulated)")
    p.add_argument("--methods", type=csv(str), default=None, help="comma list of methods "
                   "(default: tp,ep,hybrid,node-balance,node-link,hd-moe,hda-moe)")
    p.add_argument("--steps", type=positive_int, default=None, help="decode steps per episode")
    p.add_argument("--seeds", type=lambda t: [int(v) for v in seed_list(t).split(",")],
                   default=None, help="comma list of episode seeds")
    p.add_argument("--replace", action="store_true",
                   help="re-optimise placements under every derived profile")
    p.add_argument("--workers", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="parallel worker processes (or Ray CPUs)")
    p.add_argument("--backend", default="process", choices=BACKENDS,
                   help="process pool or Ray")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster address (default: start a local Ray instance)")
    p.add_argument("--mixtral-dir", default=DEFAULT_MIXTRAL_DIR,
                   help="directory of the real Mixtral traces (Mixtral cells are skipped "
                   "without it)")
    p.add_argument("--cache-dir", default=None, help="placement cache root")
    p.add_argument("--fresh", action="store_true", help="recompute finished cells")
    p.add_argument("--report-only", action="store_true",
                   help="only (re)write the analysis from --out/results.jsonl")
    p.add_argument("--list", action="store_true", help="list the cells and exit")
    p.add_argument("--robust", action="store_true",
                   help="robust rankings: every method under --samples joint Latin-hypercube "
                   "samples of all judgement knobs (config/uncertainty.py); per cell robust or "
                   "'depends on X' (writes robust.json, robust.md; --knob NAME restricts the "
                   "sampled knobs)")
    p.add_argument("--samples", type=int, default=64,
                   help="--robust: samples per cell (>= 64 for a published table)")
    p.add_argument("--seed", type=int, default=0, help="--robust: seed of the sampling")
    p.add_argument("--resume", action="store_true",
                   help="--robust: continue the run in a non-empty --out (finished cells skipped)")
    p.add_argument("--force", action="store_true",
                   help="--robust: recompute every cell in a non-empty --out")
    p.set_defaults(func=cmd_crossover)
