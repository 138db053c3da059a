"""evo commands run by their entry point inside the test process."""

from __future__ import annotations

import subprocess
from pathlib import Path


def evo_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``evo ARGS`` run by its entry point in this process (no interpreter to start): its exit code and what it
    wrote, as :func:`evo` returns them."""
    import contextlib
    import io
    import os

    from evo.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["evo", *args], code, out.getvalue(), err.getvalue())
