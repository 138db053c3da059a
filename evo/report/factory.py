"""The report of an engine factory (its directory read through :class:`archive.FactoryDir`): its searches on a timeline,
the served engine's sentences/s over time, each round's profile, searches and duel, every decision with its
reason, and a line per run.

It reports what is there: a factory killed mid-round has no duel yet, a line torn by a kill is skipped, an
unreadable file is left out. Runs are read through :class:`archive.Run` (read-only), as a run's report is.
"""

from __future__ import annotations

import html
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import matplotlib.pyplot as plt
import yaml

from archive import FactoryDir, Run, StoreError
from evo.report.figures import png  # also sets the backend, and texts from the files are never TeX
from evo.report.page import Report, Section, table

__all__ = ["FactoryLog", "RunLine", "build", "marker", "read_factory", "search_spans", "served", "timeline"]

_KERNEL, _ENGINE, _PROMOTED, _REJECTED = "#2a9d8f", "#264653", "#2a9d8f", "#9b2226"
_QUIET = {"searched", "planned", "not planned"}  # drawn as bars, or too many to mark


@dataclass(frozen=True)
class RunLine:
    """One run of the factory as its run view reads it (``error``: why it cannot be read yet)."""

    name: str
    task: str = ""
    evaluations: int = 0
    best: float | None = None
    unit: str = ""
    stamps: tuple[float, ...] = ()  # when each evaluated candidate was created and evaluated
    error: str = ""


@dataclass(frozen=True)
class FactoryLog:
    """Everything the factory directory holds now."""

    path: Path
    config: dict[str, Any]
    events: list[dict[str, Any]]
    promotions: list[dict[str, Any]]
    profiles: dict[int, dict[str, Any]]
    duels: dict[int, dict[str, Any]]
    runs: list[RunLine]


def read_factory(path: Path) -> FactoryLog:
    """What the factory in ``path`` holds now, each file as far as it can be read."""
    files = FactoryDir(path)
    runs = sorted((read_run_line(d) for d in files.run_dirs()), key=_first)
    return FactoryLog(path, _config(files), files.events(), files.promotions(), files.profiles.all(),
                      files.duels.all(), runs)  # fmt: skip


def _config(files: FactoryDir) -> dict[str, Any]:
    try:
        got = files.read_config()
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return got if isinstance(got, dict) else {}


def read_run_line(run_dir: Path) -> RunLine:
    """The run in ``run_dir`` in brief, read through its read-only view."""
    try:
        with Run.open(run_dir) as view:
            cands = list(view.evaluated())
            best = view.best(1)
            stamps = [t for c in cands for t in (c.created_at, c.evaluated_at) if _num(t)]
            return RunLine(run_dir.name, view.task_name, len(cands), best[0].fitness if best else None,
                           best[0].unit if best else "", tuple(sorted(stamps)))  # fmt: skip
    except StoreError as exc:  # created but not yet written by evo run, say
        return RunLine(run_dir.name, error=str(exc))


def _first(run: RunLine) -> tuple[float, str]:
    return (run.stamps[0] if run.stamps else math.inf, run.name)


def marker(path: Path) -> tuple[int, int, int]:
    """Changes whenever the factory or one of its runs records something: (bytes of the factory's own records,
    candidates of its runs, their evaluations and QD snapshots)."""
    files = FactoryDir(path)
    size = sum(p.stat().st_size for p in files.record_files() if p.is_file())
    runs = []
    for d in files.run_dirs():
        try:
            with Run.open(d) as view:
                runs.append(view.marker())
        except StoreError:
            continue
    return size, sum(r[0] for r in runs), sum(r[1] + r[2] for r in runs)


# --- what happened when -----------------------------------------------------------------------------


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _run_name(event: dict[str, Any]) -> str:
    """The run a ``searched`` event is about: a kernel task's run, or round N's engine run."""
    return FactoryDir.run_name(str(event.get("task")), event.get("round"))


def search_spans(log: FactoryLog) -> dict[str, list[tuple[float, float, bool]]]:
    """Run name -> its searches as (start, end, finished). A finished search ends at its ``searched`` event
    and began at the event before it (the factory does one step at a time); a search under way (or cut
    short) spans its run's evaluations since the last one finished."""
    spans: dict[str, list[tuple[float, float, bool]]] = {}
    last: float | None = None
    for e in log.events:
        at = e.get("at")
        if not _num(at):
            continue
        if e.get("event") == "searched":
            spans.setdefault(_run_name(e), []).append((at if last is None else last, at, True))
        last = at
    for run in log.runs:
        done = max((end for _, end, _ in spans.get(run.name, [])), default=-math.inf)
        since = [t for t in run.stamps if t > done]
        if since:
            spans.setdefault(run.name, []).append((since[0], since[-1], False))
    return spans


def _clock(log: FactoryLog) -> tuple[float, float, float, str]:
    """(first time, last time, seconds per unit, unit) of everything the factory recorded."""
    times = [e["at"] for e in log.events if _num(e.get("at"))] + [p["at"] for p in log.promotions if _num(p.get("at"))]
    times += [t for r in log.runs for t in r.stamps]
    t0, t1 = (min(times), max(times)) if times else (0.0, 0.0)
    return (t0, t1, 60.0, "min") if t1 - t0 > 300 else (t0, t1, 1.0, "s")


def timeline(log: FactoryLog) -> bytes | None:
    """One row per run with a bar per search, the factory's decisions as markers, promotions as vertical lines."""
    spans = search_spans(log)
    marks = [e for e in log.events if _num(e.get("at")) and e.get("event") not in _QUIET]
    if not spans and not marks:
        return None
    t0, t1, scale, unit = _clock(log)
    known = [r.name for r in log.runs]
    names = [n for n in known if n in spans] + sorted(n for n in spans if n not in known)  # runs/ gone: events only
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.45 * (len(names) + 1)))
    least = max(t1 - t0, 1.0) / scale / 400  # a search of no length still shows
    labelled: set[str] = set()

    def label(what: str) -> str:
        seen = what in labelled
        labelled.add(what)
        return "_" if seen else what

    for y, name in enumerate(names, start=1):
        kind, colour = ("engine", _ENGINE) if FactoryDir.is_engine_run(name) else ("kernel", _KERNEL)
        for start, end, done in spans[name]:
            bar = [((start - t0) / scale, max((end - start) / scale, least))]
            if done:
                ax.broken_barh(bar, (y - 0.35, 0.7), facecolors=colour, label=label(f"{kind} search"))
            else:
                ax.broken_barh(bar, (y - 0.35, 0.7), facecolors="none", edgecolors=colour, hatch="//",
                               label=label("search under way or cut short"))  # fmt: skip
    styles = {"profiled": ("^", "#e9a03b", "profile"), "promoted": ("D", _PROMOTED, "duel: promoted"),
              "not promoted": ("X", _REJECTED, "duel: not promoted")}  # fmt: skip
    for e in marks:
        shape, colour, what = styles.get(str(e.get("event")), ("o", "#6c757d", "other decision"))
        ax.scatter([(e["at"] - t0) / scale], [0], marker=shape, color=colour, s=60, zorder=3, label=label(what))
    for p in log.promotions:
        if _num(p.get("at")):
            ax.axvline((p["at"] - t0) / scale, color=_PROMOTED, linestyle="--", linewidth=1.2, label=label("promotion"))
    ax.set_yticks(range(len(names) + 1), ["decisions", *names])
    ax.set_ylim(len(names) + 0.6, -0.6)
    ax.set_xlabel(f"time since the factory started ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("factory timeline: searches, decisions, promotions")
    return png(fig)


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _duel_of(log: FactoryLog, event: dict[str, Any]) -> dict[str, Any]:
    n = event.get("round")
    return log.duels.get(n, {}) if isinstance(n, int) else {}


def _measures(log: FactoryLog) -> tuple[str, str, str]:
    """The factory's throughput unit, and its engines' fidelity figure and what to call it: a chat model's
    (``model:`` in its config) tokens/s and top-1 agreement, a sentence encoder's sentences/s and min cosine."""
    if log.config.get("model"):
        return "tokens/s", "top1", "top-1"
    return "sentences/s", "similarity", "min cosine"


def _figures(duel: dict[str, Any], side: str) -> dict[str, Any]:
    return _dict(_dict(duel.get("figures")).get(side))


def served(log: FactoryLog) -> bytes | None:
    """The served engine's throughput against time: the first duel's incumbent from the start, then each
    promotion's figure from when it landed; duels that promoted nothing as crosses."""
    first = next(iter(log.duels.values()), {})
    start = _figures(first, "incumbent").get("throughput")
    steps = [(p["at"], p["throughput"]) for p in log.promotions if _num(p.get("at")) and _num(p.get("throughput"))]
    if not steps and not _num(start):
        return None
    t0, t1, scale, unit = _clock(log)
    points = ([(t0, start)] if _num(start) else []) + steps
    points.append((max(t1, points[-1][0]), points[-1][1]))
    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.step([(t - t0) / scale for t, _ in points], [v for _, v in points], where="post", color=_ENGINE,
            label="served engine")  # fmt: skip
    ax.scatter([(t - t0) / scale for t, _ in steps], [v for _, v in steps], marker="D", color=_PROMOTED, zorder=3,
               label="promoted")  # fmt: skip
    rejected = [(e["at"], _figures(_duel_of(log, e), "candidate").get("throughput"))
                for e in log.events if e.get("event") == "not promoted" and _num(e.get("at"))]  # fmt: skip
    rejected = [(t, v) for t, v in rejected if _num(v)]
    if rejected:
        ax.scatter([(t - t0) / scale for t, _ in rejected], [v for _, v in rejected], marker="X", color=_REJECTED,
                   zorder=3, label="not promoted")  # fmt: skip
    ax.set_xlabel(f"time since the factory started ({unit})")
    ax.set_ylabel(_measures(log)[0])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("the served engine's throughput")
    return png(fig)


# --- the page ---------------------------------------------------------------------------------------


def build(path: Path) -> Report:
    """Every section of the factory's report, from what its directory holds now."""
    mark = marker(path)  # first: what changes while this reads is picked up by the next build
    log = read_factory(path)
    report = Report(title=f"evoforge factory {log.config.get('name') or path.resolve().name}", marker=mark)
    body = report.figure("timeline", timeline(log), "factory timeline")
    body += report.figure("served", served(log), f"the served engine's {_measures(log)[0]} over time")
    report.sections += [_summary(log), Section("timeline", "Timeline", body), _profiles(log), _searches(log),
                        _duels(log), _decisions(log), _runs(log)]  # fmt: skip
    return report


def _pct(v: Any) -> str | None:
    return f"{v:+.1%}" if _num(v) else None


def _when(at: Any) -> str | None:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if _num(at) else None


def _engine(v: Any) -> str:
    """A promoted or duelled engine as its run's name and elite id."""
    e = _dict(v)
    return f"{Path(str(e.get('run_dir', '?'))).name} {str(e.get('elite', '?'))[:12]}" if e else "the default"


def _summary(log: FactoryLog) -> Section:
    last = log.promotions[-1] if log.promotions else None
    now = (f"{_engine(last)}: {last.get('throughput')} {_measures(log)[0]} (round {last.get('round')})" if last
           else "the default configuration (nothing promoted yet)")  # fmt: skip
    decided = log.events[-1] if log.events else {}
    rows = [("directory", str(log.path)), ("rounds profiled", len(log.profiles)), ("rounds duelled", len(log.duels)),
            ("rounds planned in all", _dict(log.config.get("budget")).get("rounds")), ("served now", now),
            ("last decision", f"{decided.get('event')} at {_when(decided.get('at'))}" if decided else None)]
    return Section("factory", "Factory", table(None, rows, "kv"))


def _profiles(log: FactoryLog) -> Section:
    if not log.profiles:
        return Section("profiles", "Profiles", '<p class="none">no round profiled yet.</p>')
    shares = [_dict(p.get("shares")) for p in log.profiles.values()]
    parts = sorted({k for s in shares for k in s}, key=lambda k: (-max(_share(s.get(k)) for s in shares), k))
    rows: list[tuple[Any, ...]] = [(k, *(f"{s[k]:.1%}" if _num(s.get(k)) else None for s in shares)) for k in parts]
    rows.append(("engine time per pass (ms)", *(1e3 * p["total_s"] if _num(p.get("total_s")) else None
                                               for p in log.profiles.values())))  # fmt: skip
    return Section("profiles", "Profiles: where the engine's time went",
                   table(("slot or part", *(f"round {n}" for n in log.profiles)), rows))  # fmt: skip


def _share(v: Any) -> float:
    return float(v) if _num(v) else 0.0


def _searches(log: FactoryLog) -> Section:
    units = {r.name: r.unit for r in log.runs}
    rows = []
    for e in log.events:
        if e.get("event") == "searched":
            unit = units.get(_run_name(e), "")
            before, after = e.get("before"), e.get("after", e.get("best"))
            gain = after / before - 1 if _num(before) and _num(after) and before else None
            rows.append((e.get("round"), e.get("task"), e.get("evaluations"), _value(before, unit), _value(after, unit),
                         _pct(gain)))  # fmt: skip
    if not rows:
        return Section("searches", "Searches", '<p class="none">no search finished yet.</p>')
    return Section("searches", "Searches",
                   table(("round", "task", "evaluations", "best before", "best after", "gain"), rows))  # fmt: skip


def _value(v: Any, unit: str) -> str | None:
    return f"{v:.4g} {unit}".strip() if _num(v) else None


def _duels(log: FactoryLog) -> Section:
    unit, key, label = _measures(log)
    rows = []
    for n, d in log.duels.items():
        chosen = _dict(_dict(d.get("engines")).get("candidate")).get("elite")
        # a round of several finalists: a row for each one's duel, the promoted one marked
        for f in d.get("finalists") or [{**d, "elite": chosen}]:
            c, i = _figures(f, "candidate"), _figures(f, "incumbent")
            promoted = d.get("promoted") is True and f.get("elite") == chosen
            rows.append((n, str(f.get("elite") or "")[:12], "yes" if promoted else "no", _pct(f.get("gain")),
                         c.get("throughput"), c.get("p99_ms"), c.get(key), i.get("throughput"), i.get("p99_ms"),
                         f.get("why")))  # fmt: skip
    head = ("round", "engine", "promoted", "gain", unit, "p99 (ms)", label, f"incumbent's {unit}",
            "incumbent's p99 (ms)", "why")  # fmt: skip
    body = table(head, rows) if rows else '<p class="none">no duel yet.</p>'
    promoted = [(p.get("round"), _engine(p), p.get("throughput"), p.get("p99_ms"), p.get(key),
                 _pct(p.get("gain")), _when(p.get("at"))) for p in log.promotions]  # fmt: skip
    body += "<h3>Promotions</h3>" + (table(("round", "engine", unit, "p99 (ms)", label, "gain", "when"), promoted)
                                     if promoted
                                     else '<p class="none">nothing promoted yet.</p>')  # fmt: skip
    return Section("duels", "Duels and promotions", body)


def _decisions(log: FactoryLog) -> Section:
    t0 = _clock(log)[0]
    rows = [(f"{e['at'] - t0:.0f}" if _num(e.get("at")) else None, e.get("round"), e.get("event"), _what(e),
             e.get("why")) for e in log.events]  # fmt: skip
    body = table(("t (s)", "round", "event", "what", "why"), rows) if rows else '<p class="none">no decision yet.</p>'
    return Section("decisions", "Decision log", body)


def _what(event: dict[str, Any]) -> str:
    """An event's fields other than its time, name, round and reason, briefly."""
    return ", ".join(f"{k}={_brief(k, v)[:100]}" for k, v in event.items() if k not in ("at", "event", "round", "why"))


def _brief(key: str, v: Any) -> str:
    if key == "engine":
        return _engine(v)
    if isinstance(v, float) and _num(v):
        return f"{v:.4g}"
    return v if isinstance(v, str) else json.dumps(v, default=str)


def _runs(log: FactoryLog) -> Section:
    lines = []
    files = FactoryDir(log.path)
    for r in log.runs:
        where = files.run_dir(r.name).relative_to(files.path).as_posix()
        if r.error:
            what = f"not readable yet ({html.escape(r.error)})"
        else:
            best = f"best {r.best:.4g} {html.escape(r.unit)}" if _num(r.best) else "no ok result yet"
            what = f"task {html.escape(r.task)}, {r.evaluations} evaluations, {best}"
        hint = html.escape(f"evo report {log.path / where}")
        lines.append(f'<li><b>{html.escape(r.name)}</b>: {what}; its own report: <code>{hint}</code>, then '
                     f'<a href="{html.escape(quote(where))}/report.html">{html.escape(where)}/report.html</a></li>')
    body = f"<ul>{''.join(lines)}</ul>" if lines else '<p class="none">no run yet.</p>'
    return Section("runs", "Runs", body)
