"""The ``evo`` command line: run a search, query its archive."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from archive import Run, operator_stats, rebuild_archive
from evo.config import RunConfig, load_config
from evo.confirm import provenance
from evo.errors import UserError
from evo.rundir import create_run, frozen_config, open_run
from evo.unfiltered import warn_if_unfiltered

__all__ = ["main"]

log = logging.getLogger("evo")


def _configure_logging(log_file: Path | None) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    if log_file is not None:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="evoforge")
def cli() -> None:
    """evoforge: evolve faster kernels, keep the elites, query them."""
    from runtime import isa

    try:
        isa.level()
    except isa.IsaError as exc:
        raise UserError(str(exc)) from None
    # Candidate processes may run as this user: none may read this process's memory (an API key, a
    # serve key) through /proc/PID/mem. (PR_SET_DUMPABLE = 4.)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)


def _with_overrides(config: RunConfig, **kw: Any) -> RunConfig:
    budget = {k: v for k, v in (("max_evals", kw["max_evals"]), ("max_time", kw["max_time"])) if v is not None}
    search = {k: v for k, v in (("workers", kw["workers"]), ("seed", kw["seed"])) if v is not None}
    execution = {"kind": "ray", "address": kw["ray"]} if kw.get("ray") else {}
    return config.model_copy(update={
        "budget": config.budget.model_copy(update=budget),
        "search": config.search.model_copy(update=search),
        "execution": config.execution.model_copy(update=execution),
    })


@cli.command("run")
@click.argument("config_path", metavar="CONFIG", type=click.Path(path_type=Path))
@click.option("--run-dir", type=click.Path(path_type=Path), help="where the run lives [default: runs/<config name>]")
@click.option("--max-evals", type=click.IntRange(min=1), help="stop after this many evaluations in total")
@click.option("--max-time", type=click.FloatRange(min=0, min_open=True), help="stop after this many seconds")
@click.option("--workers", type=click.IntRange(min=1), help="evaluation workers [default: cores]")
@click.option("--seed", type=int, help="run seed (not with --resume)")
@click.option("--resume", is_flag=True, help="continue the run in the run dir from where it stopped")
@click.option("--ray", metavar="[ADDRESS]", is_flag=False, flag_value="auto", default=None,
              help="evaluate on a Ray cluster (default address: auto, the one `ray start` made here)")
@click.option("--no-confirm", is_flag=True, help="stop without confirming the best (for a session the run is "
              "resumed from: the session that ends the run confirms)")
def run_command(config_path: Path, run_dir: Path | None, resume: bool, no_confirm: bool, **overrides: Any) -> None:
    """Run the search described by CONFIG (a YAML file)."""
    from evo.progress import RichReporter
    from evo.search import Search
    from runtime.toolchain.cc import CompilerNotFound, compiler_version

    config = load_config(config_path)
    try:
        compiler_version(config.evaluation.compiler.cc)
    except CompilerNotFound as exc:
        raise UserError(str(exc)) from None
    require_backend(config, config_path)  # e.g. a CUDA task without a GPU: one line, and the fix
    warn_if_unfiltered()
    path = run_dir or Path("runs") / (config.name or config_path.stem)
    if resume:
        run = open_run(path, writable=True)
        frozen = frozen_config(run)
        if overrides["seed"] is not None and overrides["seed"] != frozen.search.seed:
            raise UserError(f"--seed cannot change on --resume: this run's seed is {frozen.search.seed} "
                            "(drop --seed)")  # fmt: skip
        kept = {"budget", "search", "execution"}
        if frozen.model_dump(exclude=kept) != config.model_dump(exclude=kept):
            click.echo(f"note: {config_path} differs from the config stored in {path}; the stored one is used "
                       "(only the budget, workers and execution may change on --resume)", err=True)
        # a resumed run keeps its frozen config; budget, workers and where it runs may change
        search = frozen.search.model_copy(update={"workers": config.search.workers})
        frozen = frozen.model_copy(update={"budget": config.budget, "search": search, "execution": config.execution})
        config = _with_overrides(frozen, **overrides)
    else:
        config = _with_overrides(config, **overrides)
        run = create_run(path, config)
    _configure_logging(run.log_dir / "run.log")
    if no_confirm:  # this session only: the stored config keeps its confirmation
        unconfirmed = config.search.confirm.model_copy(update={"repeats": 0})
        config = config.model_copy(update={"search": config.search.model_copy(update={"confirm": unconfirmed})})
    task = config.make_task()
    search = Search(config, run, reporter=RichReporter(unit=task.unit))
    try:
        search.run()
    except KeyboardInterrupt:
        click.echo(f"interrupted: every finished evaluation is stored; continue with "
                   f"evo run {config_path} --run-dir {path} --resume", err=True)
        sys.exit(130)
    finally:
        run.close()


@cli.group()
def archive() -> None:
    """Query a run's archive (every candidate, its elites, their lineage)."""


def _open(run_dir: Path) -> Run:
    return open_run(run_dir)


def _row(c: Any) -> dict[str, Any]:
    d = c.to_dict()
    return {k: d.get(k) for k in ("id", "status", "fitness", "unit", "metrics", "params", "descriptors",
                                  "operator", "parents", "error", "timings", "created_at", "evaluated_at")}


@archive.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--top", "top", default=10, show_default=True, type=click.IntRange(min=1), help="how many")
@click.option("--json", "as_json", is_flag=True, help="print JSON (a list of objects)")
def best(run_dir: Path, top: int, as_json: bool) -> None:
    """The best ok candidates of a run, best first: the confirmed ones (measured again after the search, ranked
    by vs_reference), then the fittest others."""
    rd = _open(run_dir)
    cands = rd.store.best(top)
    if as_json:
        click.echo(json.dumps([_row(c) for c in cands], indent=2))
        return
    if not cands:
        click.echo(f"no ok candidate in {run_dir} yet")
        return
    table = Table(title=f"best of {run_dir}", caption="fitness: as measured; vs_reference: the ratio to the "
                  "reference timed beside it (normalised, what ranks the confirmed ones)")  # fmt: skip
    for col in ("#", "id", "fitness", "vs_reference", "measured", "operator", "params"):
        table.add_column(col, justify="right" if col in ("#", "fitness", "vs_reference") else "left")
    for i, c in enumerate(cands, 1):
        vs = c.metrics.get("vs_reference")
        params = " ".join(f"{k}={v}" for k, v in c.params.items()) or "(code genome)"
        table.add_row(str(i), c.id[:12], f"{c.fitness:.2f} {c.unit}", f"{vs:.3f}x" if vs else "-",
                      provenance(c.metrics, short=True), c.operator, params)  # fmt: skip
    Console().print(table)


def _get(rd: Run, cid: str) -> Any:
    try:
        cand = rd.store.get(cid)
    except KeyError as exc:
        raise UserError(str(exc.args[0] if exc.args else exc)) from None
    if cand is None:
        raise UserError(f"no candidate {cid!r} in {rd.path} (list some with: evo archive best {rd.path})")
    return cand


@archive.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("candidate_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def show(run_dir: Path, candidate_id: str, as_json: bool) -> None:
    """One candidate: params, source, metrics and lineage (ID may be a unique prefix)."""
    rd = _open(run_dir)
    cand = _get(rd, candidate_id)
    task = frozen_config(rd).make_task()
    source = task.render(cand.genome)
    lineage = [{"id": a.id, "operator": a.operator, "status": a.status, "fitness": a.fitness}
               for a in rd.store.lineage(cand.id)[1:]]
    if as_json:
        click.echo(json.dumps({**_row(cand), "source": source, "lineage": lineage}, indent=2))
        return
    con = Console()
    con.print(f"[bold]{cand.id}[/bold]  {cand.status}  operator={cand.operator}")
    if cand.fitness is not None:
        con.print(f"fitness {cand.fitness:.3f} {cand.unit}   vs_reference {cand.metrics.get('vs_reference', 0):.3f}x"
                  f"   ({provenance(cand.metrics)})")
    if cand.error:
        con.print(f"[red]error:[/red] {cand.error}")
    con.print("params: " + (json.dumps(cand.params) if cand.params else "(none: code genome)"))
    con.print("descriptors: " + json.dumps(cand.descriptors))
    con.print("metrics: " + json.dumps(cand.metrics, default=str))
    con.print("lineage: " + (" <- ".join(f"{a['id'][:12]} ({a['operator']}, {a['fitness'] or a['status']})"
                                         for a in lineage) or "(initial population)"))
    con.print(Syntax(source, "c", line_numbers=False))


@archive.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("candidate_id", metavar="ID")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="file to write")
def export(run_dir: Path, candidate_id: str, output: Path) -> None:
    """Write a candidate's rendered, compilable source to a file."""
    rd = _open(run_dir)
    cand = _get(rd, candidate_id)
    task = frozen_config(rd).make_task()
    try:
        output.write_text(task.render(cand.genome))
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror} (choose another path with -o)") from None
    click.echo(f"wrote {output} ({task.signature})")


@archive.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def stats(run_dir: Path, as_json: bool) -> None:
    """QD metrics, counts by status, and per operator and per model: proposals, applied, compiled, correct,
    improved, tokens."""
    rd = _open(run_dir)
    config = frozen_config(rd)
    task = config.make_task()
    names = config.archive.descriptors
    arch = rebuild_archive(rd.store)
    qd = arch.stats(qd_offset=config.archive.qd_offset)
    out = {
        "candidates": rd.store.count(),
        "by_status": rd.store.counts_by_status(),
        "by_operator": rd.store.counts_by_operator(),
        "by_operator_detail": operator_stats(rd.store),
        "llm": {"by_model": rd.store.llm_stats("model")},
        "archive": {"kind": config.archive.kind, "descriptors": names, "cells": qd.cells, "filled": qd.filled,
                    "coverage": qd.coverage, "qd_score": qd.qd_score, "qd_offset": config.archive.qd_offset,
                    "best": qd.best, "mean": qd.mean},
        "unit": task.unit,
    }
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    con = Console()
    con.print(f"[bold]{run_dir}[/bold]: {out['candidates']} candidates")
    con.print("by status:   " + ", ".join(f"{k} {v}" for k, v in sorted(out["by_status"].items())))
    con.print("by operator: " + ", ".join(f"{k} {v}" for k, v in sorted(out["by_operator"].items())))
    a = out["archive"]
    con.print(f"archive ({a['kind']} over {', '.join(names)}): {a['filled']}/{a['cells']} cells, "
              f"coverage {a['coverage']:.1%}, QD-score {a['qd_score']:.1f} (offset {a['qd_offset']:g}), "
              f"best {a['best'] or 0:.2f} {task.unit}, mean elite {a['mean'] or 0:.2f} {task.unit}")
    _stats_table(con, "per operator", out["by_operator_detail"])
    if out["llm"]["by_model"]:
        by_model = {m: {**r, "tokens": r["tokens_in"] + r["tokens_out"]} for m, r in out["llm"]["by_model"].items()}
        _stats_table(con, "per model", by_model)


@archive.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--objectives", default="throughput,-p99_ms", show_default=True,
              help="metrics (or fitness) separated by commas; a leading - minimises")
@click.option("--json", "as_json", is_flag=True, help="print JSON (a list of objects)")
def pareto(run_dir: Path, objectives: str, as_json: bool) -> None:
    """The ok candidates no other beats on every objective (e.g. an engine run's throughput against its p99)."""
    from archive import Objective, StoreError

    try:
        objs = Objective.parse_list(objectives)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        with Run.open(run_dir) as opened:
            front = opened.pareto(objs)
            empty = not front and [o.metric for o in objs if not any(o.raw(c) is not None for c in opened.best(1000))]
    except StoreError as exc:
        raise UserError(str(exc)) from None
    if empty:
        raise UserError(f"no ok candidate of {run_dir} has {', '.join(empty)}: choose other --objectives "
                        "(metrics of a candidate: evo archive show RUN ID)")  # fmt: skip
    if as_json:
        click.echo(json.dumps([{**_row(c), "objectives": {o.metric: o.raw(c) for o in objs}} for c in front], indent=2))
        return
    table = Table(title=f"Pareto front of {run_dir} over {', '.join(str(o) for o in objs)}")
    table.add_column("id")
    for o in objs:
        table.add_column(o.metric, justify="right")
    for c in front:
        table.add_row(c.id[:12], *(f"{o.raw(c):.4g}" for o in objs))
    Console().print(table)


def _stats_table(con: Console, title: str, rows: dict[str, dict[str, int]]) -> None:
    cols = ("proposals", "applied", "compiled", "correct", "improved", "tokens")
    table = Table(title=title)
    table.add_column(title.split()[-1])
    for col in cols:
        table.add_column(col, justify="right")
    for name, r in sorted(rows.items()):
        table.add_row(name, *(str(r.get(c, 0)) for c in cols))
    con.print(table)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors end in one line and exit 2; internal errors exit 1 with the traceback logged."""
    try:
        cli.main(args=argv, prog_name="evo", standalone_mode=False)
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()} (see evo --help)", err=True)
        sys.exit(exc.exit_code)
    except Exception:
        import traceback

        traceback.print_exc()
        if logging.getLogger().handlers:  # the run's log file keeps the traceback too
            log.exception("internal error")
        click.echo("internal error: the traceback is above; please report it", err=True)
        sys.exit(1)
    sys.exit(0)


from evo.check_cli import check, require_backend  # noqa: E402 - a command in its own module
from evo.factory_cli import factory  # noqa: E402 - a command group in its own module
from evo.memory_cli import memory  # noqa: E402 - a command group in its own module
from evo.report_cli import dashboard, report  # noqa: E402 - commands in their own module
from evo.serve_cli import serve  # noqa: E402 - a command in its own module

cli.add_command(memory)
cli.add_command(check)
cli.add_command(serve)
cli.add_command(report)
cli.add_command(dashboard)
cli.add_command(factory)
