"""Robust rankings: does a winner survive the judgement knobs? (``hdamoe crossover --robust``)

The crossover (:mod:`hdamoe_env.app.crossover`) moves one knob at a time. Here every judgement
knob of :data:`hdamoe_env.config.uncertainty.UNCERTAINTIES` (whatever that table holds at run
time) is sampled *jointly* across its credible range: N Latin-hypercube samples (one seed, the
same samples in every cell, so cells are compared on common draws), each applied as a derived
profile (``faithful+gemm_overhead_s=…+tile_cols=32+…``). Every sample of every cell (model ×
setting × B on the 4×8 mesh) is one bench cell of :mod:`hdamoe_env.app.reproduce`: it runs
every method (default: every method of the registry, ``methods.DEFAULT_METHODS``) on the same
episodes, is written atomically to ``OUT/cells/<key>.json`` and skipped on a resumed run, and
runs on the same process pool or Ray backend as ``reproduce``. The unperturbed base profile is
evaluated as one more sample (``sample = "base"``) with the same evaluator settings.

Verdict per cell:

* the winner of a sample is the fastest method (mean TBT over the episode seeds); methods within
  a relative :data:`TIE_RTOL` of the fastest tie, and a tie goes to the method listed first (so
  that Node+Link falling back to TP through its guard counts as a TP win, not as a coin flip);
* the cell is **robust** when one method wins at least :data:`ROBUST_SHARE` (90 %) of the
  samples, else it **depends on X**;
* the deciding knob X is the knob whose best single threshold split predicts the winner labels
  most accurately (a decision stump: below t the majority label of the samples below t, above it
  theirs). [decision] A stump rather than a rank correlation because the winner is a category
  (one of several methods), not an ordinal value; a split compares orders only, so it is blind to
  a knob's sampling scale (log or linear) and it says where the winner changes ("hybrid below
  tile_cols = 32, TP above"). The report gives the accuracy against the majority-label baseline;
  a knob that does not beat the baseline decides nothing ("no single knob": an interaction).

[decision] Placements are those optimised under the base profile (as in the crossover's knob
cells: the question is "would the ranking change if the hardware behaved like this"), except
where the sample's hardware cannot execute them: a knob that changes the share grid (a tile
width whose unit the base grid is not a multiple of) gets placements optimised under the base
profile with those knobs set to the sample's values (one placement cell per distinct grid).

Routing quality: a gating method (HDA-MoE) can win by changing expert choices, so every row
states the top-1 retention of its modal winner (minimum over the cell's records), and when a
method changed routing the report adds the same verdicts among the methods that keep it
(``analyse_robust(keep_routing=True)``): the ranking at unchanged routing quality.

Outputs (in ``OUT``): ``results.jsonl`` (every bench record), ``robust.json`` (per cell: the
samples' knob values and winners, the verdict, the deciding knob and its split; ``rows`` over
all methods, ``rows_keep_routing`` over those that keep the routing) and ``robust.md`` (the
report section).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env.app.records import read_jsonl, summarise
from hdamoe_env.app.reproduce import (
    DEFAULT_MIXTRAL_DIR,
    Cell,
    bench_cfg,
    dedupe_cells,
    model_trace,
    placement_key,
)
from hdamoe_env.app.tables import render_table
from hdamoe_env.config.errors import ConfigError, OutputPathError
from hdamoe_env.config.fileio import atomic_write, write_json
from hdamoe_env.config.profiles import Conventions, get_profile
from hdamoe_env.config.specs import get_model
from hdamoe_env.config.uncertainty import UNCERTAINTIES, Uncertainty, sample_profiles

__all__ = ["FIGURE", "MIN_PUBLISHED_SAMPLES", "ROBUST_SEEDS", "ROBUST_SHARE", "ROBUST_STEPS",
           "TIE_RTOL", "analyse_robust", "cell_verdict", "check_out_dir", "cmd_robust",
           "finished_records", "lowest_winner", "mark", "placement_profile", "render_section",
           "robust_cells", "sample_count_warning", "stump_split", "write_robust_report"]

log = logging.getLogger(__name__)

#: Figure id of the robust bench cells (keeps their records apart from the crossover's).
FIGURE = "robust"
#: A cell is robust when one method wins at least this share of the samples.
ROBUST_SHARE = 0.9
#: Smallest sample count of a published robust table (smaller runs print a warning).
MIN_PUBLISHED_SAMPLES = 64
#: Evaluator of a sample (``--steps`` / ``--seeds`` override): the DES on 4 decode steps of
#: episode seed 0, as the quick crossover; one sample of one cell is one bench of every method.
ROBUST_STEPS = 4
ROBUST_SEEDS: tuple[int, ...] = (0,)
#: Methods whose TBT is within this relative distance of the fastest tie with it.
TIE_RTOL = 1e-6


# ----------------------------------------------------------------------------------- samples
def _units(model: Any, conv: Conventions) -> int | None:
    """Return the number of share units in one expert (None: continuous shares, no grid)."""
    from hdamoe_env.sim.placement import share_unit

    if conv.tile_cols == 1:   # check_tile_grid's rule: tile_cols = 1 means continuous shares
        return None
    return max(1, round(1.0 / share_unit(model, conv)))


def placement_profile(model: Any, base: Conventions, sample: Conventions,
                      knobs: Sequence[str]) -> Conventions:
    """Return the profile the placements of ``sample`` are optimised under.

    The base profile, unless a sampled knob changes the share grid so that the base placements
    are off the sample's grid (its units per expert are not a multiple of the base's); then the
    base with exactly those grid knobs set to the sample's values.

    Args:
        model: The ``ModelSpec``.
        base: The base profile.
        sample: A sampled (derived) profile.
        knobs: The sampled knob names.
    """
    u_base, u_sample = _units(model, base), _units(model, sample)
    if u_sample is None or (u_base is not None and u_sample % u_base == 0):
        return base
    grid = {k: getattr(sample, k) for k in knobs
            if _units(model, base.derive(**{k: getattr(sample, k)})) != u_base}
    return base.derive(**grid)


def _select_knobs(names: Sequence[str] | None) -> dict[str, Uncertainty]:
    """Return the uncertainties to sample: all of :data:`UNCERTAINTIES`, or the named ones."""
    if not names:
        return dict(UNCERTAINTIES)
    from hdamoe_env.config.errors import unknown_name

    for name in names:
        if name not in UNCERTAINTIES:
            raise unknown_name("uncertainty", name, UNCERTAINTIES)
    return {name: UNCERTAINTIES[name] for name in names}


def robust_cells(*, base: str = "faithful", models: Sequence[str], settings: Sequence[str],
                 batches: Sequence[int], methods: Sequence[str] | None = None,
                 samples: int = MIN_PUBLISHED_SAMPLES, seed: int = 0, steps: int = 4,
                 seeds: Sequence[int] = (0,), requests: int | None = None,
                 mixtral_dir: str | None = DEFAULT_MIXTRAL_DIR,
                 knobs: Mapping[str, Uncertainty] | Sequence[str] | None = None) -> list[Cell]:
    """Return the cells of a robust run (placement cells first).

    Args:
        base: Base profile (name or derived name).
        models: Model presets (Mixtral on its real reasoning trace; left out without it).
        settings: Hardware settings ``TFLOPS/GBps``.
        batches: Batch sizes B.
        methods: Methods compared (default: ``methods.DEFAULT_METHODS``, the registry).
        samples: Latin-hypercube samples N of the uncertainties.
        seed: Seed of the sampling generator (the same samples in every cell).
        steps: Decode steps per episode.
        seeds: Episode seeds.
        requests: Requests of the synthetic traces (None: the generator's default).
        mixtral_dir: Directory of the real Mixtral traces.
        knobs: Uncertainties to sample: a mapping, names of :data:`UNCERTAINTIES`, or None
            (all of them).

    Raises:
        ConfigError: Unknown profile, uncertainty or method, or ``samples`` < 1.
    """
    from hdamoe_env.app.methods import DEFAULT_METHODS, parse_method

    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"--samples must be an integer >= 1, got {samples!r}")
    table = (dict(knobs) if isinstance(knobs, Mapping) else _select_knobs(knobs))
    methods = list(DEFAULT_METHODS if methods is None else methods)
    for name in methods:
        parse_method(name)
    base_conv = get_profile(base)
    drawn = sample_profiles(base_conv, samples, np.random.default_rng(seed), knobs=table)
    names = sorted(table)
    variants: list[tuple[str, Conventions]] = [("base", base_conv)]
    variants += [(str(i), conv) for i, conv in enumerate(drawn)]
    needs_placement = any(parse_method(m).placement not in ("tp", "ep") for m in methods)
    cells: list[Cell] = []
    for model in models:
        trace = model_trace(model, mixtral_dir)
        if trace is None:
            continue
        spec = get_model(model)
        extra = {} if requests is None else {"trace_requests": int(requests)}
        for setting in settings:
            for batch in batches:
                for label, conv in variants:
                    cfg = bench_cfg(model, trace, setting, int(batch), conv.name,
                                    steps=int(steps), **extra)
                    params: dict[str, Any] = {"config": cfg, "methods": methods,
                                              "seeds": [int(s) for s in seeds]}
                    if needs_placement:
                        place_conv = placement_profile(spec, base_conv, conv, names)
                        src = placement_key(bench_cfg(model, trace, setting, 128,
                                                      place_conv.name, **extra))
                        cells.append(Cell("placements", "placement", {"config": src}))
                        params["placement_from"] = src
                    tags = {"base": base_conv.name, "robust_sample": label,
                            "robust_n": samples, "robust_seed": int(seed),
                            "robust_knobs": names}
                    cells.append(Cell(FIGURE, "bench", params, tags))
    return dedupe_cells(cells)


# ---------------------------------------------------------------------------------- analysis
def stump_split(values: Sequence[float], labels: Sequence[str]) -> dict[str, Any]:
    """Return the best single threshold split of ``labels`` on ``values`` (a decision stump).

    Each side predicts its majority label; the split maximises the share of correct labels.

    Args:
        values: float [n] knob values.
        labels: [n] winner labels.

    Returns:
        ``{"accuracy", "baseline", "threshold", "below", "above"}``: accuracy of the best split,
        of the majority label alone, the threshold t (samples with value <= t go below; None if no
        split beats the baseline), and the majority label on each side.
    """
    x = np.asarray(values, dtype=np.float64)
    y = list(labels)
    n = len(y)
    if n == 0 or x.shape != (n,):
        raise ConfigError(f"stump_split needs equal non-empty values and labels, got "
                          f"{x.shape} and {n}")
    overall = Counter(y).most_common(1)[0]
    best: dict[str, Any] = {"accuracy": overall[1] / n, "baseline": overall[1] / n,
                            "threshold": None, "below": overall[0], "above": overall[0]}
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ys = [y[i] for i in order]
    left: Counter[str] = Counter()
    right = Counter(ys)
    for i in range(n - 1):
        left[ys[i]] += 1
        right[ys[i]] -= 1
        if xs[i] == xs[i + 1]:
            continue
        lo, hi = left.most_common(1)[0], right.most_common(1)[0]
        accuracy = (lo[1] + hi[1]) / n
        if accuracy > best["accuracy"] + 1e-12:
            best.update(accuracy=accuracy, threshold=float(xs[i]), below=lo[0], above=hi[0])
    return best


def lowest_winner(tbt: Mapping[str, float], order: Sequence[str]) -> tuple[str, list[str]]:
    """Return the winner (first of ``order`` within TIE_RTOL of the lowest value) and the tied set.

    Args:
        tbt: method → value to minimise (TBT, or energy / EDP in ``energy_report``).
        order: Method order; a tie goes to the first.
    """
    fastest = min(tbt.values())
    tied = [m for m in order if m in tbt and tbt[m] <= fastest * (1.0 + TIE_RTOL)]
    return tied[0], tied


def cell_verdict(knob_values: Mapping[str, Sequence[float]], winners: Sequence[str], *,
                 base_winner: str | None = None) -> dict[str, Any]:
    """Return the verdict of one cell from its samples' knob values and winners.

    Args:
        knob_values: knob → float [n] values of the n samples.
        winners: [n] winner of every sample.
        base_winner: Winner under the unperturbed base profile (the headline's winner).

    Returns:
        ``{"n", "counts", "modal", "modal_share", "base_winner", "base_share", "robust",
        "deciding", "splits"}``: ``robust`` is whether the modal winner wins >= ROBUST_SHARE of
        the samples; ``base_share`` the share of samples the base winner wins; ``deciding``
        the knob whose stump split is most accurate and beats the baseline (None if robust or
        none does); ``splits`` every knob's split (:func:`stump_split`).
    """
    n = len(winners)
    if n == 0:
        raise ConfigError("cell_verdict needs at least one sample")
    counts = Counter(winners)
    modal, top = counts.most_common(1)[0]
    splits = {k: stump_split(v, winners) for k, v in sorted(knob_values.items())}
    robust = top / n >= ROBUST_SHARE
    deciding = None
    if not robust and splits:
        knob = max(sorted(splits), key=lambda k: splits[k]["accuracy"])  # ties: first name
        if splits[knob]["threshold"] is not None:
            deciding = knob
    reference = base_winner if base_winner is not None else modal
    return {"n": n, "counts": dict(counts.most_common()), "modal": modal,
            "modal_share": top / n, "base_winner": base_winner,
            "base_share": counts.get(reference, 0) / n, "robust": robust,
            "deciding": deciding, "splits": splits}


def mark(verdict: Mapping[str, Any]) -> str:
    """Return the short mark of a verdict: ``robust``, ``depends on X`` or ``conditional``.

    The percentage is the share of samples won by the base profile's winner.
    """
    share = verdict["base_share"]
    if verdict["robust"] and (verdict["base_winner"] in (None, verdict["modal"])):
        return f"robust ({share:.0%})"
    if verdict["robust"]:   # a robust winner, but not the base profile's
        return (f"conditional ({share:.0%}; {verdict['modal']} wins "
                f"{verdict['modal_share']:.0%} of the samples)")
    if verdict["deciding"] is None:
        return f"conditional ({share:.0%}, no single knob)"
    return f"depends on {verdict['deciding']} ({share:.0%})"


def changes_routing(rec: Mapping[str, Any]) -> bool:
    """Whether a bench record's method changed any expert choice (gating changed fraction > 0)."""
    gating = rec.get("gating") or {}
    return float(gating.get("changed_fraction", 0.0) or 0.0) > 0.0


def top1_kept(rec: Mapping[str, Any]) -> float:
    """The record's top-1 retention (1 for methods that keep the routing)."""
    gating = rec.get("gating") or {}
    value = gating.get("top1_retention")
    return 1.0 if value is None else float(value)


def analyse_robust(records: Sequence[Mapping[str, Any]], *,
                   keep_routing: bool = False) -> list[dict[str, Any]]:
    """Group robust bench records per cell and return one verdict row per cell.

    Args:
        records: Records of ``results.jsonl`` (others than :data:`FIGURE` are ignored).
        keep_routing: Rank only the methods that change no expert choice in any record of the
            cell (:func:`changes_routing`), i.e. the ranking at unchanged routing quality; the
            row's ``excluded`` names the methods left out.

    Returns:
        One row per (model, setting, B, mesh), in record order: the cell, the base profile's
        winner and TBT per method, every sample's profile, knob values, winner and tied set,
        and the :func:`cell_verdict` fields.
    """
    groups: dict[tuple[Any, ...], dict[str, list[Mapping[str, Any]]]] = {}
    for rec in records:
        if rec.get("kind") != "bench" or rec.get("figure") != FIGURE:
            continue
        key = (rec["model"], rec["setting"], int(rec["batch"]), rec.get("mesh", "4x8"),
               rec.get("base"), rec.get("robust_n"), rec.get("robust_seed"))
        groups.setdefault(key, {}).setdefault(str(rec["robust_sample"]), []).append(rec)
    rows = []
    for (model, setting, batch, mesh, *_), by_sample in groups.items():
        first = next(iter(by_sample.values()))[0]
        knobs = list(first.get("robust_knobs", ()))
        cell_recs = [r for recs in by_sample.values() for r in recs]
        top1_min: dict[str, float] = {}
        for r in cell_recs:
            top1_min[r["method"]] = min(top1_min.get(r["method"], 1.0), top1_kept(r))
        excluded = (sorted({r["method"] for r in cell_recs if changes_routing(r)})
                    if keep_routing else [])
        if excluded:
            by_sample = {label: [r for r in recs if r["method"] not in excluded]
                         for label, recs in by_sample.items()}
        order: list[str] = []
        for recs in by_sample.values():
            order += [r["method"] for r in recs if r["method"] not in order]
        samples = []
        base_row = None
        for label, recs in by_sample.items():
            tbt = {r["method"]: r["tbt_us"] for r in summarise(list(recs))}
            winner, tied = lowest_winner(tbt, order)
            conv = get_profile(recs[0]["profile"])
            row = {"sample": label, "profile": conv.name, "winner": winner, "tied": tied,
                   "knobs": {k: getattr(conv, k) for k in knobs}, "tbt_us": tbt}
            if label == "base":
                base_row = row
            else:
                samples.append(row)
        samples.sort(key=lambda r: int(r["sample"]))
        out: dict[str, Any] = {"model": model, "setting": setting, "batch": batch,
                               "mesh": mesh, "base_profile": first.get("base"),
                               "knobs": knobs, "robust_seed": first.get("robust_seed"),
                               "samples_planned": first.get("robust_n"),
                               "base": base_row, "samples": samples,
                               "top1_min": top1_min, "excluded": excluded}
        if samples:
            values = {k: [float(s["knobs"][k]) for s in samples] for k in knobs}
            out.update(cell_verdict(values, [s["winner"] for s in samples],
                                    base_winner=None if base_row is None
                                    else base_row["winner"]))
            out["mark"] = mark(out)
        rows.append(out)
    return rows


# ------------------------------------------------------------------------------------ report
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _split_text(row: Mapping[str, Any]) -> str:
    knob = row.get("deciding")
    if knob is None:
        return "-"
    s = row["splits"][knob]
    ties = [k for k, v in row["splits"].items()
            if k != knob and v["threshold"] is not None and v["accuracy"] >= s["accuracy"] - 1e-12]
    return (f"{s['below']} if {knob} ≤ {_fmt(s['threshold'])}, {s['above']} above "
            f"({s['accuracy']:.0%} of samples; majority alone {s['baseline']:.0%})"
            + (f"; {', '.join(ties)} split{'s' if len(ties) == 1 else ''} as well"
               if ties else ""))


def render_section(rows: Sequence[Mapping[str, Any]], *, command: str | None = None,
                   level: int = 2, keep_routing: bool = False) -> str:
    """Render the Markdown section of a robust run (one row per cell).

    ``keep_routing``: the rows rank only the methods that keep the routing
    (``analyse_robust(keep_routing=True)``); the section says so and names the ones left out.
    """
    h = "#" * level
    title = ("Among the methods that keep the routing" if keep_routing
             else "Robust rankings: which winners depend on which uncertainty")
    lines = [f"{h} {title}", ""]
    if command:
        lines += [f"Regenerate: `{command}`.", ""]
    done = [r for r in rows if r.get("samples")]
    if not done:
        return "\n".join(lines + ["No finished robust cell.", ""])
    if keep_routing:
        left_out = sorted({m for r in done for m in r.get("excluded", ())})
        lines += ["The same samples, ranking only the methods that change no expert choice in "
                  "any sample of the cell (gating changed fraction 0), i.e. the ranking at "
                  "unchanged routing quality"
                  + (f"; left out: {', '.join(f'`{m}`' for m in left_out)}." if left_out
                     else "."), ""]
    knobs = done[0]["knobs"]
    n = max(len(r["samples"]) for r in done)
    lines += [f"Every cell is evaluated under the base profile `{done[0]['base_profile']}` and "
              f"under {n} joint Latin-hypercube samples (seed {done[0]['robust_seed']}) of the "
              f"judgement knobs {', '.join(f'`{k}`' for k in knobs)} across their credible "
              "ranges (hdamoe_env/config/uncertainty.py, docs/PHYSICS.md). A cell is *robust* "
              f"when one method wins ≥ {ROBUST_SHARE:.0%} of the samples; otherwise the deciding "
              "knob is the one whose best single threshold split predicts the winner most "
              "accurately (a decision stump). Share = samples won by the base profile's "
              "winner.", ""]
    table = []
    for r in rows:
        if not r.get("samples"):
            table.append([r["model"], r["setting"], str(r["batch"]), "-", "-", "-",
                          "not run", "-", "-"])
            continue
        counts = ", ".join(f"{m} {c}" for m, c in r["counts"].items())
        missing = ("" if r["samples_planned"] in (None, len(r["samples"]))
                   else f" ({len(r['samples'])} of {r['samples_planned']} samples)")
        kept = r.get("top1_min", {}).get(r["modal"], 1.0)
        table.append([r["model"], r["setting"], str(r["batch"]),
                      "-" if r["base"] is None else r["base"]["winner"],
                      f"{r['base_share']:.0%}", counts + missing, r["mark"], f"{kept:.1%}",
                      _split_text(r)])
    lines += [render_table(["model", "setting", "B", "base winner", "share", "winners over "
                            "samples", "verdict", "top-1 kept by the modal winner (min)",
                            "deciding split"], table, style="markdown"),
              ""]
    lines += ["Per knob, the share of samples whose winner its best single split predicts "
              "(the majority winner alone predicts the `majority` column):", ""]
    head = ["model", "setting", "B", "majority", *knobs]
    body = [[r["model"], r["setting"], str(r["batch"]), f"{r['modal_share']:.0%}",
             *[f"{r['splits'][k]['accuracy']:.0%}" for k in knobs]]
            for r in done]
    lines += [render_table(head, body, style="markdown"), ""]
    return "\n".join(lines)


def finished_records(out: Path) -> list[dict[str, Any]]:
    """Return the records of every finished cell file in ``OUT/cells`` (else ``results.jsonl``).

    Reading the cell files, not ``results.jsonl`` (which holds the cells of the last call only),
    lets runs of parts of a grid into one ``OUT`` (e.g. one model at a time, ``--resume``) and
    an interrupted run report every cell that finished.

    Raises:
        ConfigError: Neither cell files nor ``results.jsonl`` exist.
    """
    import json

    files = sorted((out / "cells").glob("*.json")) if (out / "cells").is_dir() else []
    if not files:
        return read_jsonl(out, hint="run `hdamoe crossover --robust --out DIR` first")
    records = []
    for path in files:
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("%s is unreadable; skipped", path)
            continue
        records += [r for r in payload.get("records", []) if r.get("figure") == FIGURE]
    records.sort(key=lambda r: (r["model"], r["setting"], int(r["batch"]),
                                str(r.get("robust_sample"))))
    return records


def write_robust_report(out_dir: str | Path, *, command: str | None = None) -> Path:
    """Analyse ``OUT/results.jsonl``; write ``robust.json`` and ``robust.md``.

    Returns:
        The path of ``robust.md``.

    Raises:
        ConfigError: ``results.jsonl`` is missing or has no robust records.
    """
    out = Path(out_dir)
    records = finished_records(out)
    rows = analyse_robust(records)
    if not rows:
        raise ConfigError(f"{out / 'results.jsonl'} has no robust records; run "
                          f"`hdamoe crossover --robust --out {out}` first")
    kept = analyse_robust(records, keep_routing=True)
    write_json(out / "robust.json", {"rows": rows, "rows_keep_routing": kept,
                                     "robust_share": ROBUST_SHARE, "tie_rtol": TIE_RTOL})
    text = render_section(rows, command=command, level=1)
    if any(r.get("excluded") for r in kept):
        text += "\n" + render_section(kept, level=2, keep_routing=True)
    path = out / "robust.md"
    atomic_write(path, lambda fh: fh.write(text))
    return path


def check_out_dir(out: Path, *, resume: bool, force: bool) -> None:
    """Refuse a non-empty ``out`` unless ``resume`` (a robust run's own) or ``force``.

    Raises:
        OutputPathError: ``out`` is not empty and neither flag allows using it.
    """
    if force or not out.exists() or not any(out.iterdir()):
        return
    ours = (out / "robust.json").exists() or _suite_is_robust(out)
    if resume and ours:
        return
    what = ("holds a robust run" if ours else "is not empty and is not an `hdamoe crossover "
            "--robust` output")
    raise OutputPathError(f"--out {str(out)!r} {what}; pass --resume to continue it, --force "
                          "to recompute every cell there, or use a new directory")


def _suite_is_robust(out: Path) -> bool:
    import json

    try:
        cells = json.loads((out / "suite.json").read_text())["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    figures = {c.get("figure") for c in cells}
    return FIGURE in figures and figures <= {FIGURE, "placements"}


def sample_count_warning(samples: int) -> str | None:
    """Return the warning for a run too small to publish (None from 64 samples)."""
    if samples >= MIN_PUBLISHED_SAMPLES:
        return None
    return (f"--samples {samples} < {MIN_PUBLISHED_SAMPLES}: fine for a test, too few for a "
            "published robust table")


# ----------------------------------------------------------------------------------------- CLI
def cmd_robust(args: Any, suite: Mapping[str, Any]) -> int:
    """Run ``hdamoe crossover --robust`` (``args`` of ``crossover.add_arguments``); exit code.

    Args:
        args: The parsed crossover options (``--samples``, ``--seed``, ``--resume``,
            ``--force``; ``--knob NAME`` restricts the sampled uncertainties to NAME).
        suite: The crossover suite's defaults (models, settings, batches, steps, seeds).

    Raises:
        ConfigError: Bad options (``--knob`` with values, unknown names, ``--samples`` < 1).
        OutputPathError: A non-empty ``--out`` without ``--resume`` / ``--force``.
    """
    import sys

    from hdamoe_env.app.reproduce import run_suite_printing

    knob_names = []
    for text in args.knob:
        if "=" in text:
            raise ConfigError(f"--knob {text!r}: with --robust, --knob NAME selects an "
                              "uncertainty to sample (its range comes from "
                              "config/uncertainty.py); values are not allowed")
        knob_names.append(text.strip())
    warning = sample_count_warning(args.samples)
    if warning:
        print(f"hdamoe crossover: warning: {warning}", file=sys.stderr)
    mixtral_dir = args.mixtral_dir if args.mixtral_dir and Path(args.mixtral_dir).is_dir() else None
    models = args.models or suite["models"]
    if "mixtral-8x7b" in models and mixtral_dir is None:
        print(f"hdamoe crossover: {args.mixtral_dir!r} not found; Mixtral cells are skipped "
              "(pass --mixtral-dir DIR)", file=sys.stderr)
    cells = robust_cells(
        base=args.conventions, models=models, settings=args.settings or suite["settings"],
        batches=args.batches or suite["batches"], methods=args.methods,
        samples=args.samples, seed=args.seed, steps=args.steps or ROBUST_STEPS,
        seeds=args.seeds or ROBUST_SEEDS, requests=suite["requests"], mixtral_dir=mixtral_dir,
        knobs=knob_names or None)
    if args.list:
        for cell in cells:
            print(f"{cell.key}  {cell.label}")
        print(f"{len(cells)} cells")
        return 0
    out = Path(args.out)
    command = " ".join(
        ["hdamoe crossover --robust", f"--suite {args.suite}", f"--out {args.out}",
         f"--samples {args.samples}", f"--seed {args.seed}"]
        + [f"--{name.replace('_', '-')} {','.join(str(v) for v in value)}"
           for name, value in (("models", args.models), ("settings", args.settings),
                               ("batches", args.batches), ("methods", args.methods),
                               ("seeds", args.seeds)) if value]
        + [f"--knob {k}" for k in knob_names]
        + ([f"--steps {args.steps}"] if args.steps else [])
        + ([f"--conventions {args.conventions}"] if args.conventions != "faithful" else []))
    if not args.report_only:
        check_out_dir(out, resume=args.resume, force=args.force)

        run_suite_printing(cells, out, args, resume=not args.force)
    path = write_robust_report(out, command=command)
    print(f"wrote {path}")
    return 0
