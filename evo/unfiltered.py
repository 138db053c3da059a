"""The warning every command that runs candidate code gives on a machine without the system-call filter."""

from __future__ import annotations

import click

__all__ = ["warn_if_unfiltered"]


def warn_if_unfiltered() -> None:
    """Says loudly, once, when candidate code would run without the system-call filter on this machine."""
    from runtime.sandbox import filters

    if not filters.filter_available():
        click.secho(f"WARNING: {filters.UNFILTERED}", err=True, fg="red", bold=True)
