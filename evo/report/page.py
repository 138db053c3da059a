"""The report of a run as sections of self-contained HTML (figures embedded as PNG data, no network).

:func:`build` reads a :class:`archive.Run` once and returns a :class:`Report`: its sections (what the
HTML file and the live dashboard show) and its figures (what ``--png DIR`` writes).
"""

from __future__ import annotations

import base64
import difflib
import html
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from archive import Candidate, Objective, Run, StoreError, operator_stats
from evo.confirm import provenance
from evo.report import figures

__all__ = ["Report", "Section", "build", "document", "table"]


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    body: str  # HTML


@dataclass
class Report:
    title: str
    marker: tuple[int, int, int]
    sections: list[Section] = field(default_factory=list)
    figures: dict[str, bytes] = field(default_factory=dict)

    def figure(self, name: str, data: bytes | None, alt: str) -> str:
        """An ``<img>`` of the figure embedded as data (and kept for ``--png``); a note when there is none."""
        if data is None:
            return f'<p class="none">{html.escape(alt)}: nothing to draw yet.</p>'
        self.figures[name] = data
        b64 = base64.b64encode(data).decode()
        return f'<img class="plot" data-plot="{name}" alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def build(view: Run) -> Report:
    """Every section of the run's report, from what the run holds now."""
    cands = list(view.evaluated())
    ok = [c for c in cands if str(c.status) == "ok" and c.fitness is not None]
    unit = ok[0].unit if ok else ""
    report = Report(title=f"evoforge run {view.name}", marker=view.marker())
    best = view.best(1)
    report.sections.append(_summary(view, cands, best[0] if best else None))
    report.sections.append(_archive(report, view, ok))
    report.sections.append(_progress(report, view, cands, unit))
    report.sections.append(_operators(report, view))
    if best:
        report.sections.append(_lineage(view, best[0]))
    engine = _engine(report, view, cands)
    if engine is not None:
        report.sections.append(engine)
    report.sections.append(_quality(report, cands))
    return report


def table(head: Sequence[str] | None, rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    """A table; ``head`` ``None``: a key-value table without a header row."""
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in head or ())
    thead = f"<thead><tr>{th}</tr></thead>" if head is not None else ""
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table class="{cls}">{thead}<tbody>{body}</tbody></table>'


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.4g}"
    return "-" if v is None else html.escape(str(v))


def _summary(view: Run, cands: list[Candidate], best: Candidate | None) -> Section:
    counts = figures.status_counts(cands)
    started = min((c.created_at for c in cands), default=None)
    last = max((c.evaluated_at or 0.0 for c in cands), default=None)
    rows: list[tuple[str, Any]] = [
        ("task", f"{view.task_name} {json.dumps(view.task_args, sort_keys=True)}"),
        ("evaluations", f"{len(cands)} ({', '.join(f'{n} {s}' for s, n in counts.most_common())})" if cands else 0),
        ("wall time", f"{last - started:.0f} s" if started and last else None),
        ("last result", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last)) if last else None),
    ]
    if best is not None:
        vs = best.metrics.get("vs_reference")
        rows += [("best", f"{best.fitness:.4g} {best.unit}" + (f" (vs_reference {vs:.3f}x)" if _num(vs) else "")),
                 ("best's figure", provenance(best.metrics)),
                 ("best id", best.id[:16]), ("best's operator", best.operator)]  # fmt: skip
        hw = view.store.hardware(best.hardware_id) if best.hardware_id else None
        if hw:
            rows.append(("measured on", hw.get("cpu_model") or hw.get("cpu") or json.dumps(hw)[:120]))
    return Section("summary", "Summary", table(None, rows, "kv"))


def _archive(report: Report, view: Run, ok: list[Candidate]) -> Section:
    try:
        archive = view.archive()
    except (StoreError, ValueError) as exc:  # no layout yet, or stored descriptors that do not fit it
        return Section("archive", "Archive", f'<p class="none">no archive layout yet ({html.escape(str(exc))}).</p>')
    elite_ids = {e.id for e in archive.elites()}
    by_id = {c.id: c for c in ok if c.id in elite_ids}
    fit = {i: float(c.fitness) for i, c in by_id.items() if c.fitness is not None}
    vs = {i: float(c.metrics["vs_reference"]) for i, c in by_id.items() if _num(c.metrics.get("vs_reference"))}
    unit = next(iter(by_id.values())).unit if by_id else ""
    body = report.figure("archive_fitness", figures.archive_map(archive, fit, f"fitness ({unit})"),
                         "archive coloured by fitness")  # fmt: skip
    if vs:
        body += report.figure("archive_vs_reference", figures.archive_map(archive, vs, "vs_reference (x)"),
                              "archive coloured by vs_reference")  # fmt: skip
    desc = ", ".join(f"{n} [{lo:g}, {hi:g}]" for n, (lo, hi) in zip(archive.names, archive.ranges, strict=True))
    return Section("archive", "Archive", f"<p>{archive.kind} over {html.escape(desc)}</p>{body}")


def _progress(report: Report, view: Run, cands: list[Candidate], unit: str) -> Section:
    curve: list[tuple[int, float, float, float | None]] = []
    top = -math.inf
    start = min((c.created_at for c in cands), default=0.0)
    for c in cands:
        if str(c.status) == "ok" and c.fitness is not None and c.fitness > top and c.eval_seq is not None:
            top = c.fitness
            vs = c.metrics.get("vs_reference")
            curve.append((c.eval_seq, (c.evaluated_at or start) - start, c.fitness, float(vs) if _num(vs) else None))
    done = [c for c in cands if c.eval_seq is not None]
    if curve and done and done[-1].eval_seq != curve[-1][0]:  # the best holds until the last evaluation
        curve.append((done[-1].eval_seq or 0, (done[-1].evaluated_at or start) - start, *curve[-1][2:]))
    body = report.figure("progress", figures.progress(view.store.qd_history(), curve, unit),
                         "best, QD score and coverage over the run")  # fmt: skip
    body += report.figure("statuses", figures.statuses(cands), "statuses over the run")
    return Section("progress", "Progress", body)


_FUNNEL = ("proposals", "applied", "compiled", "correct", "improved", "tokens")


def _operators(report: Report, view: Run) -> Section:
    try:
        ops = operator_stats(view.store)
    except (StoreError, ValueError) as exc:  # no archive layout yet, or descriptors that do not fit it
        return Section("operators", "Operators and models", f'<p class="none">{html.escape(str(exc))}</p>')
    body = table(("operator", *_FUNNEL), [(n, *(r.get(k, 0) for k in _FUNNEL)) for n, r in sorted(ops.items())])
    body += report.figure("operators", figures.funnel(ops, "funnel per operator"), "funnel per operator")
    models = view.store.llm_stats("model")
    if models:
        keys = ("proposals", "applied", "compiled", "correct", "improved", "calls", "cached", "tokens_in", "tokens_out")
        body += "<h3>Models</h3>" + table(("model", *keys), [(m, *(r.get(k, 0) for k in keys))
                                                             for m, r in sorted(models.items())])  # fmt: skip
        body += report.figure("models", figures.funnel(models, "funnel per model"), "funnel per model")
    bandit = view.store.bandit_history()
    search = view.config.get("search")
    operators = search.get("operators") if isinstance(search, dict) else None
    adaptive = isinstance(operators, dict) and operators.get("adaptive")
    if bandit:
        body += report.figure("bandit", figures.bandit_weights(bandit), "operator weights of the bandit")
    elif adaptive:
        body += '<p class="none">the bandit is on, but no weights are stored yet (or the run predates them).</p>'
    return Section("operators", "Operators and models", body)


def _lineage(view: Run, best: Candidate) -> Section:
    chain = view.path_to(best.id)
    rows = []
    steps = []
    for i, c in enumerate(chain):
        vs = c.metrics.get("vs_reference")
        rows.append((i, c.id[:12], c.operator, str(c.status), c.fitness, float(vs) if _num(vs) else None))
        if i:
            steps.append(_step_diff(chain[i - 1], c, i))
    body = table(("step", "id", "operator", "status", f"fitness ({best.unit})", "vs_reference"), rows, "lineage")
    n = len(chain) - 1
    steps_from = "a seed itself" if n == 0 else f"{n} step{'s' * (n > 1)} from its seed"
    title = f"Lineage of the best ({steps_from})"
    return Section("lineage", title, body + "".join(steps))


def _step_diff(parent: Candidate, child: Candidate, i: int) -> str:
    """What changed from ``parent`` to ``child``: the source diff for code genomes, the parameters otherwise."""
    parts = []
    changed = {k: (parent.params.get(k), v) for k, v in child.params.items() if parent.params.get(k) != v}
    changed.update({k: (v, None) for k, v in parent.params.items() if k not in child.params})
    if changed:
        esc = html.escape
        parts.append(", ".join(f"{esc(str(k))}: {esc(json.dumps(a))} &rarr; {esc(json.dumps(b))}"
                               for k, (a, b) in sorted(changed.items(), key=lambda kv: str(kv[0]))))
    if (parent.source or "") != (child.source or ""):
        diff = difflib.unified_diff((parent.source or "").splitlines(), (child.source or "").splitlines(),
                                    f"{parent.id[:12]}", f"{child.id[:12]}", lineterm="", n=2)  # fmt: skip
        parts.append(f'<pre class="diff">{html.escape(chr(10).join(diff))}</pre>')
    what = "".join(f"<div>{p}</div>" for p in parts) or "<div>no change in the genome</div>"
    return (f'<details class="step"><summary>step {i}: {html.escape(child.operator)} '
            f"({child.id[:12]})</summary>{what}</details>")  # fmt: skip


def _engine(report: Report, view: Run, cands: list[Candidate]) -> Section | None:
    if not any(_num(c.metrics.get("throughput")) and _num(c.metrics.get("p99_ms")) for c in cands):
        return None
    budget = view.task_args.get("p99_budget_ms")
    body = report.figure("engine", figures.engine_front(cands, float(budget) if _num(budget) else None),
                         "engine throughput against p99")  # fmt: skip
    front = view.pareto([Objective("throughput"), Objective("p99_ms", maximise=False)])
    rows = [(c.id[:12], c.metrics.get("throughput"), c.metrics.get("p99_ms"), c.metrics.get("memory_mb"))
            for c in front]  # fmt: skip
    body += "<h3>Pareto front</h3>" + table(("id", "throughput", "p99 (ms)", "memory (MB)"), rows)
    return Section("engine", "Engine runs", body)


def _quality(report: Report, cands: list[Candidate]) -> Section:
    duels = [c.metrics["duel"] for c in cands if isinstance(c.metrics.get("duel"), dict)]
    won = sum(1 for d in duels if d.get("won"))
    flagged = [c for c in cands if c.metrics.get("flagged")]
    body = report.figure("uncertainty", figures.uncertainty(cands), "timing uncertainty")
    body += table(None, [("duels won", won), ("duels lost", len(duels) - won),
                              ("flagged (implausible speed-ups re-verified)", len(flagged))], "kv")  # fmt: skip
    if flagged:
        body += table(("id", "status", "fitness", "first timing"),
                       [(c.id[:12], str(c.status), c.fitness, c.metrics.get("fitness_first_timing")) for c in flagged])
    return Section("quality", "Measurement quality", body)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #1d2d35; }
h1 { font-size: 1.5rem; } h2 { border-bottom: 1px solid #ccd; padding-bottom: .2rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: .6rem 0; } td, th { padding: .2rem .6rem; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f4f6f8; } table.kv td:first-child { color: #556; }
img.plot { max-width: 100%; display: block; margin: .6rem 0; }
pre.diff { background: #f8f8f8; padding: .5rem; overflow-x: auto; font-size: 12px; }
p.none { color: #889; font-style: italic; } .stamp { color: #889; font-size: 12px; }
"""


def document(report: Report, *, script: str = "") -> str:
    """The whole HTML page; ``script`` (the dashboard's) goes at its end."""
    sections = "".join(f'<section id="{s.id}"><h2>{html.escape(s.title)}</h2><div class="body">{s.body}</div>'
                       "</section>" for s in report.sections)  # fmt: skip
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(report.title)}</title>'
            f'<style>{_CSS}</style></head><body><h1>{html.escape(report.title)}</h1>'
            f'<p class="stamp">as of <span id="stamp">{stamp}</span></p>{sections}{script}</body></html>')  # fmt: skip
