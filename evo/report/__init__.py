"""See a run: ``evo report`` (one self-contained HTML file) and ``evo dashboard`` (the same, live).

Needs matplotlib (``pip install -e '.[report]'``); the dashboard also needs the serving stack
(``'.[dashboard]'``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_report"]


def write_report(run_dir: Path, output: Path, png_dir: Path | None = None) -> list[str]:
    """Writes the report of the run in ``run_dir`` to ``output`` (and each figure to ``png_dir``); returns the
    section titles."""
    from archive import RunView
    from evo.report.page import build, document

    with RunView(run_dir) as view:
        report = build(view)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(document(report))
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, data in report.figures.items():
            (png_dir / f"{name}.png").write_bytes(data)
    return [s.title for s in report.sections]
