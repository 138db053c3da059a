"""``evo memory``: search, inspect, fill and share the memory of discoveries."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from archive.memory import Memory, MemorySettings, MemoryStoreError, default_memory_dir, entries_from_run
from evo.errors import UserError

__all__ = ["memory"]


def _open(ctx: click.Context, *, create: bool = False) -> Memory:
    """The memory at ``--path`` with the embedder it was made with (``--embedder`` for a new one)."""
    path: Path = ctx.obj["path"]
    stored = Memory.stored_embedder(path)
    if stored is None and not create:
        raise UserError(f"no memory in {path}: fill one with evo memory add RUN_DIR (or pass --path DIR)")
    embedder = stored or ctx.obj["embedder"]
    try:
        return Memory(path, settings=MemorySettings(path=str(path), embedder=embedder))
    except (MemoryStoreError, ValueError) as exc:
        raise UserError(str(exc)) from None
    except ImportError as exc:
        raise UserError(f"{exc}") from None


@click.group()
@click.option("--path", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="memory directory [default: $EVOFORGE_MEMORY_DIR, else ~/.cache/evoforge/memory]")
@click.option("--embedder", default=None,
              help="embedder of a new memory: minilm, hash or module:Class (an existing one keeps its own)"
              " [default: minilm]")
@click.pass_context
def memory(ctx: click.Context, path: Path | None, embedder: str | None) -> None:
    """The memory of discoveries shared by runs: search it, fill it from runs, share it."""
    ctx.obj = {"path": path or default_memory_dir(), "embedder": embedder or MemorySettings().embedder}


@memory.command()
@click.argument("text")
@click.option("--task", default=None, help="only entries of this task (e.g. matmul)")
@click.option("--kind", type=click.Choice(["improvement", "failure"]), default=None, help="only entries of this kind")
@click.option("--k", "k", default=10, show_default=True, type=click.IntRange(min=1), help="how many")
@click.option("--json", "as_json", is_flag=True, help="print JSON (a list of objects)")
@click.pass_context
def search(ctx: click.Context, text: str, task: str | None, kind: str | None, k: int, as_json: bool) -> None:
    """The entries whose summary is nearest in meaning to TEXT."""
    with _open(ctx) as mem:
        hits = mem.search(text, k=k, task=task, kind=kind)  # type: ignore[arg-type]
    if as_json:
        click.echo(json.dumps([h.to_dict() for h in hits], indent=2))
        return
    if not hits:
        click.echo("no entry matches")
        return
    table = Table(title=f"memory: {text}")
    for col in ("#", "score", "kind", "fitness", "vs ref", "summary", "run"):
        table.add_column(col, justify="right" if col in ("#", "score", "fitness", "vs ref") else "left")
    for i, h in enumerate(hits, 1):
        e = h.entry
        fit = f"{e.fitness:.4g} {e.unit}" if e.fitness is not None else "-"
        vs = f"{e.vs_reference:.3f}x" if e.vs_reference is not None else "-"
        table.add_row(str(i), f"{h.score:.3f}", e.kind, fit, vs, e.summary, Path(e.run).name if e.run else "-")
    Console().print(table)


@memory.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """How many entries, per task and kind; the index, the embedder, the size on disk."""
    path: Path = ctx.obj["path"]
    if Memory.stored_embedder(path) is None:  # no memory yet: a state, not an error
        s = {"path": str(path), "entries": 0, "index": None, "embedder": None, "dim": None, "size_bytes": 0,
             "per_task": {}, "per_kind": {}}  # fmt: skip
        if as_json:
            click.echo(json.dumps(s, indent=2))
        else:
            click.echo(f"{path}: no memory yet, 0 entries (fill it with evo memory add RUN_DIR, or let evo run do it)")
        return
    with _open(ctx) as mem:
        s = mem.stats()
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    click.echo(f"{s['path']}: {s['entries']} entries, {s['index']} index, embedder {s['embedder']} "
               f"(dim {s['dim']}), {s['size_bytes'] / 1e6:.1f} MB on disk")
    click.echo("per task: " + (", ".join(f"{t} {n}" for t, n in s["per_task"].items()) or "-"))
    click.echo("per kind: " + (", ".join(f"{t} {n}" for t, n in s["per_kind"].items()) or "-"))


@memory.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.pass_context
def add(ctx: click.Context, run_dir: Path) -> None:
    """Remember the elites of the run in RUN_DIR."""
    try:
        entries = entries_from_run(run_dir)
    except MemoryStoreError as exc:
        raise UserError(f"{exc} (give the directory of a run made by evo run)") from None
    with _open(ctx, create=True) as mem:
        n = mem.add(entries)
    click.echo(f"added {n} entries from {run_dir} ({len(entries)} elites, {len(entries) - n} already known)")


@memory.command("export")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.pass_context
def export_(ctx: click.Context, file: Path) -> None:
    """Write every entry to FILE as JSON lines (to share with another machine)."""
    with _open(ctx) as mem:
        n = mem.export(file)
    click.echo(f"wrote {n} entries to {file}")


@memory.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.pass_context
def import_(ctx: click.Context, file: Path) -> None:
    """Add the entries of FILE (written by evo memory export); known ones are skipped."""
    if not file.is_file():
        raise UserError(f"no such file: {file} (write one with evo memory export FILE)")
    with _open(ctx, create=True) as mem:
        try:
            n = mem.import_(file)
        except MemoryStoreError as exc:
            raise UserError(str(exc)) from None
    click.echo(f"imported {n} new entries from {file}")


@memory.command()
@click.option("--keep-best-per-task", "keep", default=10, show_default=True, type=click.IntRange(min=0),
              help="improvements kept per task, task args and hardware (the best by vs_reference, then fitness);"
              " as many most recent failures are kept")
@click.pass_context
def prune(ctx: click.Context, keep: int) -> None:
    """Forget all but the best entries of each task."""
    with _open(ctx) as mem:
        n = mem.prune(keep)
        left = mem.stats()["entries"]
    click.echo(f"removed {n} entries; {left} remain")
