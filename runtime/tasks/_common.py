"""Helpers shared by the built-in tasks: their C sources and the host's SIMD width."""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

__all__ = ["load_c_source", "vector_width"]


@functools.cache
def load_c_source(name: str) -> str:
    """The text of ``runtime/tasks/c/<name>`` (package data)."""
    return resources.files("runtime.tasks").joinpath("c", name).read_text(encoding="utf-8")


@functools.cache
def vector_width(cpuinfo: Path = Path("/proc/cpuinfo")) -> int:
    """fp32 lanes of the widest vector unit of this CPU (16 with AVX-512F, 8 with AVX, else 4).

    Tile shapes in the spaces are whole vectors of this width, so spaces fit the host the search runs
    on; the C templates read the width from the compiler (``__AVX512F__``), so any point stays correct.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return 4
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    if "avx512f" in flags:
        return 16
    return 8 if "avx" in flags else 4
