"""Source-level helpers: evolve blocks and how parameters reach C source."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["EVOLVE_END", "EVOLVE_START", "evolve_blocks", "render_defines", "render_source"]

EVOLVE_START = "EVOLVE-BLOCK-START"
EVOLVE_END = "EVOLVE-BLOCK-END"
_IDENT = re.compile(r"[^A-Za-z0-9_]")


def evolve_blocks(source: str) -> list[tuple[int, int]]:
    """Line ranges ``(first, last)`` (0-based, exclusive of the marker lines) of each evolve block.

    Raises ``ValueError`` on unbalanced or nested markers.
    """
    blocks: list[tuple[int, int]] = []
    start: int | None = None
    for i, line in enumerate(source.splitlines()):
        if EVOLVE_START in line:
            if start is not None:
                raise ValueError(f"line {i + 1}: nested {EVOLVE_START}")
            start = i + 1
        elif EVOLVE_END in line:
            if start is None:
                raise ValueError(f"line {i + 1}: {EVOLVE_END} without a start")
            blocks.append((start, i))
            start = None
    if start is not None:
        raise ValueError(f"{EVOLVE_START} at line {start} is never closed")
    return blocks


def _c_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_defines(params: Mapping[str, Any]) -> str:
    """``#define NAME value`` per parameter; a string value also defines ``NAME_<VALUE> 1``.

    The second form lets C code branch on a choice with ``#if``: ``#if LOOP_ORDER_IKJ``.
    """
    lines = []
    for name, value in sorted(params.items()):
        lines.append(f"#define {name} {_c_value(value)}")
        if isinstance(value, str):
            lines.append(f"#define {name}_{_IDENT.sub('_', value).upper()} 1")
    return "\n".join(lines) + "\n"


def render_source(params: Mapping[str, Any], source: str) -> str:
    """The compilable source: parameter ``#define``s followed by the (template or evolved) source."""
    return render_defines(params) + "#line 1\n" + source
