"""``evo serve``: host a run's engine elite over HTTP (the ``serve`` extra; see :mod:`serving`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from evo.errors import UserError

__all__ = ["serve"]


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path), required=False)
@click.option("--follow", "follow", metavar="FACTORY_DIR", type=click.Path(path_type=Path),
              help="serve what the factory in FACTORY_DIR promotes, swapping to each new promotion (no RUN_DIR)")
@click.option("--elite", default="best", show_default=True,
              help="engine elite id (or unique prefix), 'best', or 'default' (the default engine configuration)")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind (loopback by default)")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="port to listen on")
@click.option("--api-key-env", metavar="NAME", help="environment variable holding the API key (bearer token); "
              "required for /admin, and then for /v1 too")
@click.option("--max-in-flight", default=256, show_default=True, type=click.IntRange(min=1),
              help="embeddings requests served at once; more get 429")
@click.option("--drain-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="seconds to finish in-flight requests after SIGTERM")
@click.option("--warmup", default=8, show_default=True, type=click.IntRange(min=1),
              help="texts run through an engine before it serves (at start-up and on a switch)")
@click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="seconds a request's body may take to arrive; a slower one gets 408 and its connection closed")
def serve(run_dir: Path | None, follow: Path | None, elite: str, host: str, port: int, api_key_env: str | None,
          max_in_flight: int, drain_timeout: float, warmup: int, body_timeout: float) -> None:
    """Serve RUN_DIR's engine elite: OpenAI-compatible /v1/embeddings, archive queries, kernel invocation,
    /health, /ready, /metrics. A run that is not an engine run (or has no ok engine candidate) is served
    with the default engine configuration, and says so. SIGTERM drains in-flight requests, then exits 0.
    With --follow FACTORY_DIR, serves the factory's latest promotion and swaps to each new one."""
    try:
        from serving import Limits, ServeError
        from serving import serve as run_server
    except ImportError as exc:
        raise UserError(f"evo serve needs the serve extra ({exc.name} is missing): "
                        "pip install -c constraints.txt -e '.[serve,engine]'") from None
    if (run_dir is None) == (follow is None):
        raise UserError("give either RUN_DIR or --follow FACTORY_DIR (see evo serve --help)")
    from evo.unfiltered import warn_if_unfiltered

    warn_if_unfiltered()
    try:
        code = run_server(run_dir, follow=follow, elite=elite, host=host, port=port, api_key_env=api_key_env,
                          limits=Limits(max_in_flight=max_in_flight, body_timeout_s=body_timeout),
                          drain_timeout=drain_timeout,
                          warmup=warmup)
    except ServeError as exc:
        raise UserError(str(exc)) from None
    sys.exit(code)
