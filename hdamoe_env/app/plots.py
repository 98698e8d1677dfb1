"""PNG figures of a benchmark run: normalised TBT, latency breakdown, link-congestion heat map.

Application layer (style.md §2): reads the records written by :mod:`hdamoe_env.app.bench` and draws
them with matplotlib (the ``plot`` extra), imported lazily inside every function; pyplot's global
state is never touched (figures are ``matplotlib.figure.Figure`` objects rendered by the Agg
canvas), so plotting is safe in worker processes and tests.

* :func:`plot_normalised_tbt` — TBT ÷ TBT of TP per method, mean over seeds with its 95 %
  t interval (paper Fig. 10 style; the value axis zooms to the data);
* :func:`plot_breakdown` — stacked compute / communication / memory / other µs per decode step
  (paper Fig. 13 style);
* :func:`plot_link_heatmap` — mean busy time of every directed link per decode step drawn on the
  X×Y endpoint grid (paper Figs. 18–19 style): each directed link is an arrow between its two
  endpoints, offset to its right-hand side so that both directions are visible; torus wrap links
  are drawn as stubs at the border; on a fat-tree (links to switches) the endpoint cells are
  coloured by the busy time of their injection plus ejection links;
* :func:`plot_pareto` — TBT against top-1 routing retention: every method a point, HDA-MoE at
  its gating scales (HD-MoE = scale 0, ``hda-moe@qNN`` / ``@sX``, ``hda-moe`` = 1) a curve
  (:func:`draw_pareto` draws it on a given axes, for the reproduce report); axes zoomed to the
  data, every method labelled (coincident methods share one label), the labels explained;
* :func:`plot_energy_latency` — energy per token against TBT, one point per method of a cell
  (docs/PHYSICS.md §18; the lower-left corner wins both), with the latency and energy winners
  named in the title.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from hdamoe_env.config.errors import DependencyNotInstalled

__all__ = ["draw_pareto", "gating_curve", "plot_breakdown", "plot_energy_latency",
           "plot_learning_curve",
           "plot_link_heatmap", "plot_normalised_tbt", "plot_pareto", "plot_seed_curves",
           "write_plots"]

log = logging.getLogger(__name__)

_BREAKDOWN = (("compute_us", "compute"), ("communication_us", "communication"),
              ("memory_us", "memory"), ("extra_us", "other"))


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise DependencyNotInstalled('plots need matplotlib; run `pip install "hdamoe-env[plot]"`'
                                     ) from exc
    return Figure(figsize=(width, height), dpi=120, layout="constrained")


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _methods_in_order(records: Sequence[dict[str, Any]]) -> list[str]:
    seen: list[str] = []
    for rec in records:
        if rec["method"] not in seen:
            seen.append(rec["method"])
    return seen


def _by_method(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        out.setdefault(rec["method"], []).append(rec)
    return out


def _title(records: Sequence[dict[str, Any]]) -> str:
    rec = records[0]
    return (f"{rec.get('model', '?')} · {rec.get('topology', 'mesh')} {rec.get('mesh', '')} · "
            f"{rec.get('setting', '')} · B={rec.get('batch', '?')}")


def _zoomed_limits(low: Sequence[float], high: Sequence[float], *, frac: float = 0.15,
                   floor: float = 1e-3) -> tuple[float, float]:
    """Axis limits around the finite values of [low, high] with ``frac`` of the span as margin."""
    lo = [v for v in low if np.isfinite(v)]
    hi = [v for v in high if np.isfinite(v)]
    if not lo or not hi:
        return 0.0, 1.0
    a, b = min(lo), max(hi)
    pad = max(frac * (b - a), floor * max(abs(a), abs(b), 1e-12))
    return a - pad, b + pad


def plot_normalised_tbt(records: Sequence[dict[str, Any]], path: str | Path, *,
                        baseline: str = "tp") -> Path:
    """Draw TBT ÷ TBT(baseline) per method: the mean over seeds with its 95 % interval.

    The value axis zooms to the data (the bars do not start at 0; the axis label says so), so
    differences of a few per cent and the error bars stay visible. Error bar: the 95 %
    Student-t interval over seeds (``hdamoe_env.app.intervals``; scipy), or the sample standard
    deviation without scipy; none for a single seed.

    Args:
        records: Bench records (one per method and seed) of one configuration.
        path: PNG file to write.
        baseline: Method that normalises (its bar is 1); absolute TBT in µs when it is absent.

    Returns:
        The path written.
    """
    groups = _by_method(records)
    base = {r["seed"]: r["tbt_us"] for r in groups.get(baseline, [])}
    methods = _methods_in_order(records)
    means, spreads = [], []
    what = "95 % t interval over seeds"
    for m in methods:
        if base:
            vals = [r["tbt_us"] / base[r["seed"]] for r in groups[m] if r["seed"] in base]
        else:
            vals = [r["tbt_us"] for r in groups[m]]
        means.append(float(np.mean(vals)) if vals else np.nan)
        half = 0.0
        if len(vals) > 1:
            try:
                from hdamoe_env.app.intervals import t_interval

                half = float(t_interval(vals).half_width or 0.0)
            except DependencyNotInstalled:
                half, what = float(np.std(vals, ddof=1)), "std over seeds"
        spreads.append(half)
    fig = _figure(max(4.0, 0.9 * len(methods) + 1.5), 3.4)
    ax = fig.add_subplot()
    x = np.arange(len(methods))
    lo, hi = _zoomed_limits([m - e for m, e in zip(means, spreads, strict=True)],
                            [m + e for m, e in zip(means, spreads, strict=True)], frac=0.25)
    heights = [m - lo if np.isfinite(m) else 0.0 for m in means]
    bars = ax.bar(x, heights, bottom=lo, color="#8fa9d6", edgecolor="#4c72b0", zorder=2)
    ax.errorbar(x, means, yerr=spreads, fmt="none", ecolor="black", elinewidth=1.2,
                capsize=5, capthick=1.2, zorder=3)
    for bar, value, err in zip(bars, means, spreads, strict=True):
        ax.annotate(f"{value:.3f}" if base else f"{value:.0f}",
                    (bar.get_x() + bar.get_width() / 2, value + err),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_ylim(lo, hi + 0.08 * (hi - lo))
    ax.set_xticks(x, methods, rotation=20, ha="right")
    unit = f"TBT / TBT({baseline})" if base else "TBT (µs)"
    ax.set_ylabel(f"{unit}\n(axis zoomed, not from 0)", fontsize=8)
    if base and lo < 1.0 < hi:
        ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
    ax.set_title(f"normalised TBT — {_title(records)}\nerror bars: {what}", fontsize=9)
    return _save(fig, path)


def plot_breakdown(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Draw stacked compute / communication / memory / other µs per decode step per method.

    Args:
        records: Bench records; ``breakdown_us`` is averaged over seeds.
        path: PNG file to write.

    Returns:
        The path written.
    """
    groups = _by_method(records)
    methods = _methods_in_order(records)
    fig = _figure(max(4.0, 0.9 * len(methods) + 2.5), 3.4)
    ax = fig.add_subplot()
    x = np.arange(len(methods))
    bottom = np.zeros(len(methods))
    colors = ("#4c72b0", "#dd8452", "#55a868", "#8172b3")
    for (key, label), color in zip(_BREAKDOWN, colors, strict=True):
        vals = np.array([np.mean([r["breakdown_us"].get(key, 0.0) for r in groups[m]])
                         for m in methods])
        ax.bar(x, vals, bottom=bottom, label=label, color=color)
        bottom += vals
    ax.set_xticks(x, methods, rotation=20, ha="right")
    ax.set_ylabel("µs per decode step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"latency breakdown — {_title(records)}", fontsize=9)
    return _save(fig, path)


def plot_link_heatmap(topology: Any, link_busy_us: ArrayLike, path: str | Path, *,
                      title: str = "") -> Path:
    """Draw the busy time of every directed link on the endpoint grid.

    Args:
        topology: ``hdamoe_env.noc.topology.Topology`` (``grid_shape``, ``endpoint_coords``,
            ``link_src``, ``link_dst``, ``num_endpoints``).
        link_busy_us: float [num_links] busy time per directed link (µs per decode step).
        path: PNG file to write.
        title: Figure title.

    Returns:
        The path written.

    Raises:
        ValueError: ``link_busy_us`` does not have one value per link.
    """
    from matplotlib import colormaps
    from matplotlib.collections import LineCollection
    from matplotlib.colors import Normalize

    busy = np.asarray(link_busy_us, dtype=np.float64)
    if busy.shape != (topology.num_links,):
        raise ValueError(f"link_busy_us has shape {busy.shape}; expected [{topology.num_links}]"
                         " (one value per directed link)")
    X, Y = topology.grid_shape
    N = topology.num_endpoints
    coords = np.asarray(topology.endpoint_coords)[:N]
    src = np.asarray(topology.link_src)
    dst = np.asarray(topology.link_dst)
    fig = _figure(1.2 * Y + 2.0, 1.2 * X + 1.0)
    ax = fig.add_subplot()
    cmap = colormaps["inferno_r"]
    norm = Normalize(vmin=0.0, vmax=max(float(busy.max()), 1e-12))
    node_busy = np.zeros(N)
    segments, colors = [], []
    for link in range(topology.num_links):
        u, v = int(src[link]), int(dst[link])
        if u >= N or v >= N:                       # a switch: fat-tree
            if min(u, v) < N:                      # injection or ejection link of an endpoint
                node_busy[min(u, v)] += busy[link]
            continue
        (r1, c1), (r2, c2) = coords[u], coords[v]
        dr, dc = int(r2 - r1), int(c2 - c1)
        wrap = abs(dr) + abs(dc) != 1
        if wrap:                                   # torus wrap link: a stub leaving the grid
            dr, dc = -int(np.sign(dr)), -int(np.sign(dc))
        # offset to the right-hand side of the direction of travel (rows grow downwards)
        off_r, off_c = 0.12 * dc, -0.12 * dr
        start = np.array([c1 + off_c, r1 + off_r], dtype=float)
        length = 0.45 if wrap else 1.0
        end = start + length * np.array([dc, dr], dtype=float)
        start = start + 0.18 * np.array([dc, dr])
        end = end - (0.0 if wrap else 0.18) * np.array([dc, dr])
        segments.append([start, end])
        colors.append(cmap(norm(busy[link])))
        ax.annotate("", xy=end, xytext=start,
                    arrowprops={"arrowstyle": "-|>", "color": cmap(norm(busy[link])),
                                "lw": 2.2, "shrinkA": 0, "shrinkB": 0})
    if segments:
        ax.add_collection(LineCollection(segments, colors=colors, linewidths=0))
    cell_norm = Normalize(vmin=0.0, vmax=max(float(node_busy.max()), 1e-12))
    for node in range(N):
        r, c = coords[node]
        face = cmap(cell_norm(node_busy[node])) if node_busy.any() else "white"
        ax.add_patch(_square(c, r, face))
        ax.text(c, r, str(node), ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.8, Y - 0.2)
    ax.set_ylim(X - 0.2, -0.8)
    ax.set_aspect("equal")
    ax.set_xticks(range(Y))
    ax.set_yticks(range(X))
    ax.set_xlabel("column")
    ax.set_ylabel("row")
    from matplotlib.cm import ScalarMappable

    mappable = ScalarMappable(norm=norm if segments else cell_norm, cmap=cmap)
    label = "link busy µs / decode step" if segments else "endpoint link busy µs / step"
    fig.colorbar(mappable, ax=ax, label=label, shrink=0.8)
    ax.set_title(title or f"link congestion ({topology.kind} {X}x{Y})", fontsize=9)
    return _save(fig, path)


def _square(col: float, row: float, face: Any) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((col - 0.18, row - 0.18), 0.36, 0.36, facecolor=face, edgecolor="0.3",
                     lw=0.8, zorder=3)


def gating_curve(rows: dict[str, dict[str, Any]]) -> list[tuple[float, str]]:
    """Return (gating scale, method) of the HDA-MoE family in ``rows``, by ascending scale.

    The family is HD-MoE (scale 0: same placement and pre-broadcast, no gating), ``hda-moe``
    and every ``hda-moe@...`` variant; the scale is the row's measured ``gating_scale``.
    """
    family = []
    for method, row in rows.items():
        if method == "hd-moe" or method == "hda-moe" or method.startswith("hda-moe@"):
            scale = row.get("gating_scale")
            if scale is None or not np.isfinite(scale):
                scale = 0.0 if method == "hd-moe" else 1.0 if method == "hda-moe" else np.nan
            if np.isfinite(scale):
                family.append((float(scale), method))
    return sorted(family)


def _pareto_points(rows: dict[str, dict[str, Any]], curve: list[tuple[float, str]]
                   ) -> list[tuple[float, float, list[str]]]:
    """Group methods that fall on the same point: [(retention %, TBT µs, [labels])]."""
    scale = {m: sc for sc, m in curve}
    points: dict[tuple[float, float], list[str]] = {}
    for method, row in rows.items():
        x = 100.0 * (row.get("top1_retention") or np.nan)
        y = row.get("tbt_us", np.nan)
        if not (np.isfinite(x) and np.isfinite(y)):
            continue
        label = f"{method} (s={scale[method]:.3g})" if method in scale else method
        points.setdefault((round(x, 3), round(y, 2)), []).append(label)
    return [(x, y, labels) for (x, y), labels in points.items()]


def _spread_labels(ys: list[float], gap: float) -> list[float]:
    """Return label heights near ``ys`` with at least ``gap`` between neighbours (order kept).

    Labels of points closer than ``gap`` are pushed apart symmetrically around their group's
    mean, so no two labels overlap and each stays as close to its point as the gap allows.
    """
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    out = [0.0] * len(ys)
    groups: list[list[int]] = []
    for i in order:
        groups.append([i])
        # merge while the last two groups' label blocks overlap
        while len(groups) > 1:
            a, b = groups[-2], groups[-1]
            top_a = _block(ys, a, gap)[1]
            low_b = _block(ys, b, gap)[0]
            if low_b - top_a >= gap:
                break
            groups[-2:] = [a + b]
    for g in groups:
        low = _block(ys, g, gap)[0]
        for k, i in enumerate(g):
            out[i] = low + k * gap
    return out


def _block(ys: list[float], group: list[int], gap: float) -> tuple[float, float]:
    """Lowest and highest label height of ``group`` centred on its points' mean."""
    mean = sum(ys[i] for i in group) / len(group)
    low = mean - gap * (len(group) - 1) / 2
    return low, low + gap * (len(group) - 1)


def draw_pareto(ax: Any, rows: dict[str, dict[str, Any]], *, title: str = "") -> None:
    """Draw TBT (µs) against top-1 routing retention (%) on ``ax``.

    Every method is labelled next to its point; methods on the same point (e.g. HD-MoE and
    Node+Link when no expert is pre-broadcast) share one point whose label lists them all. The
    axes zoom to the data. The HDA-MoE family (HD-MoE = gating scale 0, ``hda-moe``,
    ``hda-moe@…``) is joined by a line in order of its gating scale s (× the default gating
    coefficients), written as ``(s=…)``.

    Args:
        ax: A matplotlib axes.
        rows: ``{method: summary row}`` (:func:`hdamoe_env.app.records.summarise` rows with
            ``tbt_us``, ``top1_retention`` and ``gating_scale``).
        title: Axes title.
    """
    curve = gating_curve(rows)
    points = _pareto_points(rows, curve)
    if curve:
        xs = [100.0 * (rows[m].get("top1_retention") or np.nan) for _, m in curve]
        ys = [rows[m].get("tbt_us", np.nan) for _, m in curve]
        ax.plot(xs, ys, "-", color="C0", lw=1.0, zorder=1,
                label="HDA-MoE family by gating scale s")
    family = {m for _, m in curve}
    label_y: list[float] = []
    if points:
        px = [p[0] for p in points]
        py = [p[1] for p in points]
        x0, x1 = _zoomed_limits(px, px, frac=0.15, floor=0.001)
        x0, x1 = min(x0, min(px) - 0.05), max(x1, max(px) + 0.05)
        y0, y1 = _zoomed_limits(py, py, frac=0.15)
        ax.set_xlim(min(x1, 100.05), x0)                      # inverted: 100 % on the left
        ax.ticklabel_format(axis="both", useOffset=False, style="plain")
        ax.set_ylim(y0, y1 + 0.1 * (y1 - y0))
        label_y = _spread_labels(py, gap=0.045 * (y1 + 0.1 * (y1 - y0) - y0))
        dx = 0.03 * (max(x1, x0) - min(x1, x0))    # the x axis is inverted: right = lower x
    for j, (x, y, labels) in enumerate(points):
        in_family = any(lab.split(" (s=")[0] in family for lab in labels)
        ax.plot([x], [y], "s" if in_family else "o", color="C0" if in_family else f"C{j % 9 + 1}",
                ms=6, zorder=3)
        moved = abs(label_y[j] - y) > 1e-12
        note = ax.annotate(" = ".join(labels), (x, y), xytext=(x - dx, label_y[j]), fontsize=6,
                           textcoords="data", zorder=4, va="center", ha="left",
                           arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5",
                                       "shrinkA": 0, "shrinkB": 3} if moved else None)
        note.set_in_layout(False)          # long labels must not squeeze small report panels
    ax.set_xlabel("top-1 routing retention (%), ← better\n"
                  "labels: method, (s=…) gating scale × default coefficients, a = b: same point",
                  fontsize=7)
    ax.set_ylabel("TBT (µs per decode step), ↓ better")
    if curve:
        ax.legend(fontsize=6, loc="best")
    if title:
        ax.set_title(title, fontsize=8)


def plot_pareto(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Draw the speed-vs-routing-quality plane of a benchmark run (see :func:`draw_pareto`).

    Args:
        records: Bench records of one configuration.
        path: Output PNG.

    Raises:
        DependencyNotInstalled: matplotlib is missing.
    """
    from hdamoe_env.app.records import summarise

    rows = {r["method"]: r for r in summarise(records)}
    fig = _figure(5.5, 3.8)
    draw_pareto(fig.subplots(), rows, title=_title(records))
    return _save(fig, path)


def plot_energy_latency(rows: dict[str, dict[str, Any]], path: str | Path, *,
                        title: str = "") -> Path:
    """Scatter energy per token (mJ) against TBT (µs), one labelled point per method.

    Args:
        rows: method → summary row with ``tbt_us`` and ``j_per_token``
            (``hdamoe_env.app.records.summarise``); methods without energy are left out.
        path: PNG path.
        title: Title prefix (e.g. the cell's model, setting and B).

    Returns:
        The written path.

    Raises:
        DependencyNotInstalled: matplotlib is missing.
        ValueError: No method has both values.
    """
    pts = [(m, float(r["tbt_us"]), 1e3 * float(r["j_per_token"])) for m, r in rows.items()
           if r.get("tbt_us") is not None and r.get("j_per_token") is not None]
    if not pts:
        raise ValueError("no method has both TBT and energy per token")
    fig = _figure(5.0, 3.6)
    ax = fig.subplots()
    xs, ys = [p[1] for p in pts], [p[2] for p in pts]
    ax.scatter(xs, ys, s=22, zorder=3)
    for name, x, y in pts:
        ax.annotate(name, (x, y), xytext=(4, 3), textcoords="offset points", fontsize=7)
    lat_w = min(pts, key=lambda p: p[1])[0]
    en_w = min(pts, key=lambda p: p[2])[0]
    ax.set_xlim(*_zoomed_limits(xs, xs))
    ax.set_ylim(*_zoomed_limits(ys, ys))
    ax.set_xlabel("TBT per decode step (µs)")
    ax.set_ylabel("energy per token (mJ)")
    ax.grid(alpha=0.3)
    head = f"{title}: " if title else ""
    ax.set_title(f"{head}latency winner {lat_w}, energy winner {en_w}", fontsize=8)
    return _save(fig, path)


def write_plots(records: Sequence[dict[str, Any]], out_dir: str | Path, *,
                topology: Any = None, heatmap_method: str | None = None,
                baseline: str = "tp") -> list[Path]:
    """Write the figures of a benchmark run into ``out_dir``.

    Normalised TBT, breakdown, the link heat map (with a topology) and, when a gating method
    ran, the TBT-vs-top-1-retention plane (``pareto.png``).

    Args:
        records: Bench records of one configuration.
        out_dir: Directory (created).
        topology: The run's topology (needed for the heat map; skipped when None).
        heatmap_method: Method whose mean ``link_busy_us`` is drawn (default: the last method
            with link data, ``hda-moe`` when it ran).
        baseline: Normalising method of the TBT bars.

    Returns:
        The PNG paths written.
    """
    out = Path(out_dir)
    if not records:
        log.warning("no bench records to plot")
        return []
    paths = [plot_normalised_tbt(records, out / "normalised_tbt.png", baseline=baseline),
             plot_breakdown(records, out / "breakdown.png")]
    if any((r.get("gating_scale") or 0.0) > 0 for r in records):
        paths.append(plot_pareto(records, out / "pareto.png"))
    if topology is not None:
        groups = _by_method(records)
        candidates = [m for m in _methods_in_order(records)
                      if any(r.get("link_busy_us") for r in groups[m])]
        fallback = "hda-moe" if "hda-moe" in candidates else (
            candidates[-1] if candidates else None)
        method = heatmap_method if heatmap_method in candidates else fallback
        if heatmap_method is not None and heatmap_method not in candidates:
            log.warning("method %r has no link data (TP's all-reduce is analytic); drawing %r",
                        heatmap_method, method)
        if method is not None:
            busy = np.mean([r["link_busy_us"] for r in groups[method] if r.get("link_busy_us")],
                           axis=0)
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in method)
            paths.append(plot_link_heatmap(
                topology, busy, out / f"link_heatmap_{safe}.png",
                title=f"{method}: link busy time per decode step — {_title(records)}"))
    return paths


def plot_learning_curve(out_dir: str | os.PathLike[str], path: str | os.PathLike[str] | None = None,
                        reference: dict[str, float] | None = None) -> Path:
    """Write ``learning_curve.png``: mean training TBT and episode reward over env steps.

    Args:
        out_dir: Output directory of ``hdamoe train``.
        path: PNG path (default ``out_dir/learning_curve.png``).
        reference: Horizontal lines, label → TBT µs (e.g. heuristic agents on the twin).

    Raises:
        DependencyNotInstalled: matplotlib or tensorboard missing.
    """
    from hdamoe_env.app.tb import read_scalars

    scalars = read_scalars(out_dir)
    fig = _figure(10, 3.5)
    axes = fig.subplots(1, 2)
    for ax, tag, label in ((axes[0], "latency/tbt_us", "training TBT (µs, analytic twin)"),
                           (axes[1], "rollout/ep_rew_mean", "episode reward")):
        data = scalars.get(tag, [])
        if data:
            ax.plot([s for s, _ in data], [v for _, v in data], label="learned")
        if tag == "latency/tbt_us":
            for i, (name, value) in enumerate((reference or {}).items()):
                ax.axhline(value, ls="--", lw=1, color=f"C{i + 1}", label=name)
            ax.legend(fontsize=8)
        ax.set_xlabel("env steps")
        ax.set_title(label, fontsize=10)
    target = Path(path) if path is not None else Path(out_dir) / "learning_curve.png"
    fig.savefig(target, dpi=100)
    return target


def plot_seed_curves(out_dir: str | os.PathLike[str], seed_dirs: dict[int, Path],
                     path: str | os.PathLike[str] | None = None) -> Path | None:
    """Write ``learning_curves.png`` of a ``--seeds`` run: every seed's training curves.

    Left: TensorBoard ``latency/tbt_us`` (mean TBT of the training episodes, training trace and
    fidelity); right: ``rollout/ep_rew_mean`` (the reward the policy optimised, quality term
    included). One line per seed.

    Args:
        out_dir: Output directory of ``hdamoe train --seeds``.
        seed_dirs: Seed → its run directory (``OUT/seed<S>``).
        path: PNG path (default ``out_dir/learning_curves.png``).

    Returns:
        The PNG path, or None when no seed has TensorBoard scalars.

    Raises:
        DependencyNotInstalled: matplotlib or tensorboard missing.
    """
    from hdamoe_env.app.tb import read_scalars

    curves = {seed: read_scalars(d) for seed, d in sorted(seed_dirs.items())}
    if not any(curves.values()):
        return None
    fig = _figure(10, 3.5)
    axes = fig.subplots(1, 2)
    for ax, tag, label in ((axes[0], "latency/tbt_us", "training TBT (µs)"),
                           (axes[1], "rollout/ep_rew_mean", "episode reward")):
        for i, (seed, scalars) in enumerate(curves.items()):
            data = scalars.get(tag, [])
            if data:
                ax.plot([s for s, _ in data], [v for _, v in data], color=f"C{i}",
                        label=f"seed {seed}")
        ax.set_xlabel("env steps")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    target = Path(path) if path is not None else Path(out_dir) / "learning_curves.png"
    fig.savefig(target, dpi=100)
    return target
