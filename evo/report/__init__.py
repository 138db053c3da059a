"""See a run: ``evo report`` (one self-contained HTML file) and ``evo dashboard`` (the same, live); on a
factory directory, the factory (:mod:`evo.report.factory`).

Needs matplotlib (``pip install -e '.[report]'``); the dashboard also needs the serving stack
(``'.[dashboard]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evo.report.page import Report

__all__ = ["build_report", "report_marker", "write_report"]


def build_report(path: Path) -> Report:
    """The report of the run in ``path``, or of the factory when ``path`` holds one."""
    from archive import FactoryDir, Run
    from evo.report import factory, page

    if FactoryDir(path).exists():
        return factory.build(path)
    with Run.open(path) as view:
        return page.build(view)


def report_marker(path: Path) -> tuple[int, int, int]:
    """Changes whenever the run (or the factory) in ``path`` records something."""
    from archive import FactoryDir, Run
    from evo.report import factory

    if FactoryDir(path).exists():
        return factory.marker(path)
    with Run.open(path) as view:
        return view.marker()


def write_report(run_dir: Path, output: Path, png_dir: Path | None = None) -> list[str]:
    """Writes the report of the run (or the factory) in ``run_dir`` to ``output`` (and each figure to ``png_dir``);
    returns the section titles."""
    from evo.report.page import document

    report = build_report(run_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(document(report))
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, data in report.figures.items():
            (png_dir / f"{name}.png").write_bytes(data)
    return [s.title for s in report.sections]
