"""Processes that open the same new database at the same moment all get it (no "database is locked")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]
FILES = 60

OPENER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from archive import Store
    from archive.memory._db import connect
    where = sys.argv[1]
    for i in range({files}):
        while not os.path.exists(f"{{where}}/go{{i}}"):
            pass
        Store(f"{{where}}/archive{{i}}.db").close()
        connect(f"{{where}}/memory{{i}}.db").close()
    print("opened all")
""")


def test_processes_opening_a_new_store_together_all_get_it(tmp_path):
    script = OPENER.format(root=str(ROOT), files=FILES)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(1.0)  # each is importing and then spinning on the first go file
    for i in range(FILES):
        (tmp_path / f"go{i}").touch()  # all four open file i together
        time.sleep(0.02)
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "opened all" in out, err
