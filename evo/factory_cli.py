"""``evo factory CONFIG``: the engine factory (:mod:`evo.factory`); ``evo factory status DIR``: what it did."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from evo.errors import UserError

__all__ = ["factory"]


class _RunByDefault(click.Group):
    """``evo factory CONFIG`` runs a factory; ``evo factory status DIR`` reports on one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_RunByDefault)
def factory() -> None:
    """The engine factory: rounds of profile, plan, kernel searches, engine search and promotion.

    evo factory CONFIG [--dir DIR] [--resume]  runs (or continues) a factory;
    evo factory status DIR                     says which search delivered which gain, when.
    """


@factory.command("run")
@click.argument("config_path", metavar="CONFIG", type=click.Path(path_type=Path))
@click.option("--dir", "path", type=click.Path(path_type=Path), help="factory directory [default: factories/<name>]")
@click.option("--resume", is_flag=True, help="continue the factory in --dir from where it stopped")
@click.option("--rounds", type=click.IntRange(min=1), help="rounds in all (more than it was started with)")
def run(config_path: Path, path: Path | None, resume: bool, rounds: int | None) -> None:
    """Run the factory described by CONFIG (a YAML file)."""
    from evo.factory import Factory, load_factory_config
    from evo.unfiltered import warn_if_unfiltered

    config = load_factory_config(config_path)
    warn_if_unfiltered()
    path = path or Path("factories") / (config.name or config_path.stem)
    if resume:
        fac = Factory.open(path, rounds=rounds, note=lambda m: click.echo(m, err=True))
    else:
        if rounds is not None:
            config = config.model_copy(update={"budget": config.budget.model_copy(update={"rounds": rounds})})
        fac = Factory.create(config, path, note=lambda m: click.echo(m, err=True))
    try:
        fac.run()
    except KeyboardInterrupt:
        click.echo(f"interrupted: every finished step is stored; continue with evo factory {config_path} "
                   f"--dir {path} --resume", err=True)  # fmt: skip
        sys.exit(130)
    except RuntimeError as exc:
        raise UserError(f"{exc} (continue with --resume once it is fixed)") from None
    click.echo(f"done: evo factory status {path}; serve it with evo serve --follow {path}", err=True)


def _status(path: Path) -> dict[str, Any]:
    from archive import FactoryDir

    files = FactoryDir(path)
    if not files.exists():
        raise UserError(f"no factory in {path} (expected {files.config_file})")
    return {"dir": str(path), "events": files.events(), "promotions": files.promotions()}


@factory.command()
@click.argument("path", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def status(path: Path, as_json: bool) -> None:
    """Which search delivered which gain, when: every decision, search and promotion of the factory in DIR."""
    got = _status(path)
    if as_json:
        click.echo(json.dumps(got, indent=2, default=str))
        return
    console = Console()
    start = got["events"][0]["at"] if got["events"] else 0.0
    table = Table(title=f"factory {path}")
    for col in ("t (s)", "round", "event", "what", "why"):
        table.add_column(col)
    for e in got["events"]:
        what = e.get("task") or e.get("slot") or (e.get("engine") or {}).get("elite", "")[:12] or ""
        why = str(e.get("why", ""))
        if e["event"] == "searched":
            what = f"{e.get('task')}: {e.get('evaluations')} evals, best {e.get('after', e.get('best'))}"
            offers = [o for o in e.get("offered") or [] if isinstance(o, dict)]
            if offers:  # an engine search: the kernels it was offered as they landed
                why = "offered " + ", ".join(f"{o.get('slot')} {str(o.get('id'))[:8]} after {o.get('evaluations')} "
                                             "evals" for o in offers)  # fmt: skip
        table.add_row(f"{e['at'] - start:.0f}", str(e.get("round", "")), e["event"], str(what), why)
    console.print(table)
    if not got["promotions"]:
        console.print("no engine promoted yet")
    for p in got["promotions"]:
        gain = p.get("gain")
        against = "the incumbent failed its duel" if gain is None else f"{gain:+.1%} against the incumbent"
        console.print(f"round {p['round']}: promoted {p['elite'][:12]} of {p['run_dir']}: {p['throughput']:.1f} "
                      f"{p.get('unit', 'sentences/s')} ({against}), p99 {p['p99_ms']:.1f} ms")
