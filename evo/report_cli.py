"""``evo report`` and ``evo dashboard``: see a run (the ``report`` and ``dashboard`` extras; see :mod:`evo.report`)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from evo.errors import UserError

__all__ = ["dashboard", "report"]


def _need(extra: str, names: tuple[str, ...]) -> None:
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise UserError(f"this command needs the {extra} extra ({missing[0]} is missing): "
                        f"pip install -c constraints.txt -e '.[{extra}]'")  # fmt: skip


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="the HTML file [default: RUN_DIR/report.html]")
@click.option("--png", "png_dir", type=click.Path(path_type=Path), help="also write each figure as a PNG here")
def report(run_dir: Path, output: Path | None, png_dir: Path | None) -> None:
    """Write one self-contained HTML report of RUN_DIR: the archive map, progress, operators and models,
    the lineage of the best, engine runs, measurement quality. Opens offline (figures embedded). On a factory
    directory (evo factory --dir): its searches on a timeline, the served engine's sentences/s, every round's
    profile, searches and duel, and every decision."""
    _need("report", ("matplotlib",))
    from archive import StoreError
    from evo.report import write_report

    out = output or run_dir / "report.html"
    try:
        titles = write_report(run_dir, out, png_dir)
    except StoreError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        where = exc.filename or out
        flag = "--png" if png_dir is not None and str(where).startswith(str(png_dir)) else "-o"
        raise UserError(f"cannot write {where}: {exc.strerror} (choose another path with {flag})") from None
    click.echo(f"wrote {out}: {', '.join(titles)}" + (f"; figures in {png_dir}" if png_dir else ""))


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind (loopback by default)")
@click.option("--port", default=8700, show_default=True, type=click.IntRange(0, 65535), help="port to listen on")
@click.option("--key-env", metavar="NAME", help="environment variable holding the key a browser logs in with "
              "(and an API client sends as a bearer token)")
def dashboard(run_dir: Path, host: str, port: int, key_env: str | None) -> None:
    """Serve RUN_DIR's report live: the page follows the run (or the factory) as it writes (read-only; the run
    is never locked or slowed). With --key-env, a browser logs in once on /login."""
    _need("dashboard", ("matplotlib", "starlette", "uvicorn"))
    from archive import StoreError
    from evo.report.dashboard import serve

    key = None
    if key_env:
        key = os.environ.get(key_env)
        if not key:
            raise UserError(f"--key-env {key_env}: the environment variable {key_env} is not set or empty")
    elif host not in ("127.0.0.1", "localhost", "::1"):
        raise UserError(f"--host {host} would show the run to the network without a key: pass --key-env NAME")
    try:
        serve(run_dir, host=host, port=port, key=key)
    except StoreError as exc:
        raise UserError(str(exc)) from None
