"""The `evo` process itself: nothing of its memory is readable by the candidate processes it starts."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_evo_makes_itself_undumpable_before_any_command_runs(tmp_path):
    """Candidate processes may run as the same user; a dumpable process's memory (an API key) would be
    theirs to read through /proc/PID/mem. PR_GET_DUMPABLE (3) must read 0 once a command started."""
    code = (
        "import atexit, ctypes\n"
        "atexit.register(lambda: print('dumpable', ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)))\n"
        "from evo.cli import main\n"
        f"main(['archive', 'stats', {str(tmp_path / 'no-run')!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no run in" in out.stderr, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "dumpable 0"
