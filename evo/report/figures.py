"""The report's figures, drawn with matplotlib (Agg) into PNG bytes, from a :class:`archive.Run`.

Each function returns ``None`` when the run holds nothing to draw (no engine metrics, no bandit, ...).
Colours of the archive map are fixed per run: from the lowest to the highest value any elite has.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["text.parse_math"] = False  # names from a run (operators, units) are text, never TeX

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from archive import Archive, Candidate, CVTArchive, Elite, GridArchive, Objective, pareto_front  # noqa: E402

__all__ = ["archive_map", "bandit_weights", "engine_front", "funnel", "progress", "statuses", "uncertainty"]

_DPI = 96
_STATUS_COLOURS = {"ok": "#2a9d8f", "compile_error": "#e9c46a", "wrong": "#e76f51", "crash": "#9b2226",
                   "timeout": "#6c757d", "invalid": "#7b2cbf", "pending": "#adb5bd"}  # fmt: skip


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _finish(fig: Figure, ax: Any, colours: Any, label: str, title: str) -> bytes:
    """An archive map's colour bar and title, drawn."""
    fig.colorbar(colours, ax=ax, label=label)
    ax.set_title(title)
    return png(fig)


def archive_map(archive: Archive, values: dict[str, float], label: str) -> bytes | None:
    """The archive's cells coloured by ``values`` (elite id -> value), empty cells blank: a grid in 1D or 2D,
    Voronoi cells for a 2D CVT, parallel axes over more descriptors."""
    elites = [e for e in archive.elites() if e.id in values]
    if not elites:
        return None
    vals = [values[e.id] for e in elites]
    lo, hi = min(vals), max(vals)
    norm = matplotlib.colors.Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1e-9)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    dims = len(archive.names)
    if dims > 2:
        return _parallel_axes(archive, elites, values, norm, cmap, label)
    if isinstance(archive, CVTArchive) and dims == 2:
        return _voronoi(archive, elites, values, norm, cmap, label)
    if isinstance(archive, GridArchive):
        return _grid(archive, elites, values, norm, cmap, label)
    return _scatter(archive, elites, values, norm, cmap, label)  # a 1D CVT: its centroids on a line


def _grid(archive: GridArchive, elites: list[Elite], values: dict[str, float], norm: Any, cmap: Any,
          label: str) -> bytes:  # fmt: skip
    shape = archive.bins if len(archive.bins) == 2 else (1, archive.bins[0])
    grid = np.full(shape, np.nan)
    for e in elites:
        idx = archive.grid_index(e.cell)
        grid[idx if len(idx) == 2 else (0, idx[0])] = values[e.id]
    edges = archive.boundaries()
    fig, ax = plt.subplots(figsize=(6.4, 4.8 if len(edges) == 2 else 1.8))
    if len(edges) == 2:  # rows: the first descriptor, columns: the second
        mesh = ax.pcolormesh(edges[1], edges[0], np.ma.masked_invalid(grid), cmap=cmap, norm=norm,
                             edgecolors="#dddddd", linewidth=0.3)  # fmt: skip
        ax.set_xlabel(archive.names[1])
        ax.set_ylabel(archive.names[0])
    else:
        mesh = ax.pcolormesh(edges[0], [0, 1], np.ma.masked_invalid(grid), cmap=cmap, norm=norm,
                             edgecolors="#dddddd", linewidth=0.3)  # fmt: skip
        ax.set_yticks([])
        ax.set_xlabel(archive.names[0])
    return _finish(fig, ax, mesh, label, f"archive: {len(elites)} of {archive.cells} cells filled")


def _voronoi(archive: CVTArchive, elites: list[Elite], values: dict[str, float], norm: Any, cmap: Any,
             label: str) -> bytes:  # fmt: skip
    from scipy.spatial import Voronoi

    lo, hi = np.array([r[0] for r in archive.ranges]), np.array([r[1] for r in archive.ranges])
    unit = (archive.centroids - lo) / (hi - lo)
    far = np.array([[-10, -10], [-10, 11], [11, -10], [11, 11]])  # closes the outer cells
    vor = Voronoi(np.vstack([unit, far]))
    cell_value = {e.cell: values[e.id] for e in elites}
    polys, colours = [], []
    for i in range(archive.cells):
        region = vor.regions[vor.point_region[i]]
        if -1 in region or not region:
            continue
        poly = np.clip(vor.vertices[region], 0, 1) * (hi - lo) + lo
        polys.append(poly[:, ::-1])  # x: the second descriptor, as in the grid
        v = cell_value.get(i)
        colours.append((1, 1, 1, 1) if v is None else cmap(norm(v)))
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    ax.add_collection(PolyCollection(polys, facecolors=colours, edgecolors="#bbbbbb", linewidths=0.4))
    ax.set_xlim(lo[1], hi[1])
    ax.set_ylim(lo[0], hi[0])
    ax.set_xlabel(archive.names[1])
    ax.set_ylabel(archive.names[0])
    return _finish(fig, ax, matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), label,
                   f"archive (CVT): {len(elites)} of {archive.cells} cells filled")


def _scatter(archive: Archive, elites: list[Elite], values: dict[str, float], norm: Any, cmap: Any,
             label: str) -> bytes:  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.4, 1.8))
    sc = ax.scatter([e.descriptors[0] for e in elites], [0] * len(elites), c=[values[e.id] for e in elites],
                    cmap=cmap, norm=norm, s=60)  # fmt: skip
    ax.set_xlim(*archive.ranges[0])
    ax.set_yticks([])
    ax.set_xlabel(archive.names[0])
    return _finish(fig, ax, sc, label, f"archive: {len(elites)} of {archive.cells} cells filled")


def _parallel_axes(archive: Archive, elites: list[Elite], values: dict[str, float], norm: Any, cmap: Any,
                   label: str) -> bytes:  # fmt: skip
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    xs = range(len(archive.names))
    for e in sorted(elites, key=lambda e: values[e.id]):  # the best drawn last, on top
        ys = [(v - lo) / (hi - lo) for v, (lo, hi) in zip(e.descriptors, archive.ranges, strict=True)]
        ax.plot(xs, np.clip(ys, 0, 1), color=cmap(norm(values[e.id])), alpha=0.8, linewidth=1.2)
    ax.set_xticks(list(xs), [f"{n}\n[{lo:g}, {hi:g}]" for n, (lo, hi) in zip(archive.names, archive.ranges,
                                                                             strict=True)])  # fmt: skip
    ax.set_yticks([0, 1], ["low", "high"])
    return _finish(fig, ax, matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), label,
                   f"archive: {len(elites)} of {archive.cells} cells filled, one line per elite")


def progress(history: Sequence[Any], best_curve: Sequence[tuple[int, float, float, float | None]],
             unit: str) -> bytes | None:  # fmt: skip
    """Best fitness, its ``vs_reference``, the QD score and coverage, against evaluations (left) and wall time
    (right). ``best_curve``: (evaluation, seconds in, best fitness, its vs_reference) at every new best."""
    if not history and not best_curve:
        return None
    rows = [("best", f"best ({unit})"), ("vs_reference", "best's vs_reference (x)"), ("qd_score", "QD score"),
            ("coverage", "coverage (%)")]  # fmt: skip
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 8.8), sharex="col", constrained_layout=True)
    series = {
        "best": ([h.evals for h in history], [h.elapsed_s for h in history],
                 [h.best if h.best is not None else math.nan for h in history]),
        "vs_reference": ([b[0] for b in best_curve], [b[1] for b in best_curve],
                         [b[3] if b[3] is not None else math.nan for b in best_curve]),
        "qd_score": ([h.evals for h in history], [h.elapsed_s for h in history], [h.qd_score for h in history]),
        "coverage": ([h.evals for h in history], [h.elapsed_s for h in history],
                     [100 * h.coverage for h in history]),
    }  # fmt: skip
    colours = {"best": "#264653", "vs_reference": "#e76f51", "qd_score": "#2a9d8f", "coverage": "#e9a03b"}
    for r, (key, label) in enumerate(rows):
        evals, secs, ys = series[key]
        for c, xs in enumerate((evals, secs)):
            ax = axes[r][c]
            if key == "vs_reference":
                ax.step(xs, ys, where="post", color=colours[key])
            else:
                ax.plot(xs, ys, color=colours[key])
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel(label)
    axes[-1][0].set_xlabel("evaluations")
    axes[-1][1].set_xlabel("wall time (s)")
    fig.suptitle("progress")
    return png(fig)


def statuses(cands: Sequence[Candidate]) -> bytes | None:
    """How many evaluations ended in each status, cumulated over the run."""
    done = [c for c in cands if c.eval_seq is not None]
    if not done:
        return None
    names = sorted({str(c.status) for c in done}, key=lambda s: (s != "ok", s))
    counts = dict.fromkeys(names, 0)
    series: dict[str, list[int]] = {n: [] for n in names}
    for c in done:
        counts[str(c.status)] += 1
        for n in names:
            series[n].append(counts[n])
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.stackplot(range(1, len(done) + 1), [series[n] for n in names], labels=names,
                 colors=[_STATUS_COLOURS.get(n, "#888888") for n in names])  # fmt: skip
    ax.set_xlabel("evaluations")
    ax.set_ylabel("evaluations ended so far")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("statuses over the run")
    return png(fig)


def funnel(rows: dict[str, dict[str, int]], title: str) -> bytes | None:
    """Per operator (or model): proposed, applied, compiled, correct, improved, as grouped bars."""
    if not rows:
        return None
    stages = ["proposals", "applied", "compiled", "correct", "improved"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.4 * len(names)), 3.4))
    width = 0.8 / len(stages)
    for i, stage in enumerate(stages):
        ax.bar(np.arange(len(names)) + i * width, [rows[n].get(stage, 0) for n in names], width, label=stage)
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
    ax.set_ylabel("candidates")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return png(fig)


def bandit_weights(history: Sequence[tuple[int, float, dict[str, float]]]) -> bytes | None:
    """The adaptive operator choice's expected reward of each operator over the run."""
    if not history:
        return None
    names = sorted({n for _, _, w in history for n in w})
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for n in names:
        ax.plot([e for e, _, _ in history], [w.get(n, math.nan) for _, _, w in history], label=n)
    ax.set_xlabel("evaluations")
    ax.set_ylabel("expected reward")
    ax.legend(fontsize=8)
    ax.set_title("operator weights (bandit)")
    return png(fig)


def engine_front(cands: Sequence[Candidate], budget_ms: float | None) -> bytes | None:
    """Throughput against p99 for every engine evaluation with both, the Pareto front, the p99 budget, and
    memory as the points' colour."""
    pts = [c for c in cands if str(c.status) == "ok" and _num(c.metrics.get("throughput"))
           and _num(c.metrics.get("p99_ms"))]  # fmt: skip
    if not pts:
        return None
    front = pareto_front(pts, [Objective("throughput"), Objective("p99_ms", maximise=False)])
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    mem = [float(c.metrics["memory_mb"]) if _num(c.metrics.get("memory_mb")) else 0.0 for c in pts]
    sc = ax.scatter([c.metrics["p99_ms"] for c in pts], [c.metrics["throughput"] for c in pts], c=mem, cmap="plasma",
                    s=28, alpha=0.85)  # fmt: skip
    fig.colorbar(sc, ax=ax, label="memory (MB)")
    f = sorted(front, key=lambda c: c.metrics["p99_ms"])
    ax.step([c.metrics["p99_ms"] for c in f], [c.metrics["throughput"] for c in f], where="post", color="#222222",
            label="Pareto front")  # fmt: skip
    if budget_ms:
        ax.axvline(budget_ms, color="#e63946", linestyle="--", label=f"p99 budget ({budget_ms:g} ms)")
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("throughput")
    ax.legend(fontsize=8)
    ax.set_title("engine: throughput against p99")
    return png(fig)


def uncertainty(cands: Sequence[Candidate]) -> bytes | None:
    """The spread of the timings' relative uncertainty."""
    vals = [100 * float(c.metrics["rel_uncertainty"]) for c in cands
            if _num(c.metrics.get("rel_uncertainty")) and math.isfinite(c.metrics["rel_uncertainty"])]  # fmt: skip
    if not vals:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.hist(vals, bins=min(40, max(5, len(vals) // 5)), color="#457b9d")
    ax.set_xlabel("relative uncertainty of the median (%)")
    ax.set_ylabel("evaluations")
    ax.set_title(f"timing uncertainty: median {np.median(vals):.2f}%")
    return png(fig)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def status_counts(cands: Sequence[Candidate]) -> Counter[str]:
    return Counter(str(c.status) for c in cands)
