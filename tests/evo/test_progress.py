"""The live report of `evo run` where its output is not a terminal (a log, CI): a line every so often."""

from __future__ import annotations

import io

from rich.console import Console

from evo.progress import RichReporter
from runtime import EvalResult, Status


def test_a_run_logged_to_a_file_prints_a_line_every_so_often():
    out = io.StringIO()
    reporter = RichReporter(unit="GFLOP/s", console=Console(file=out, force_terminal=False, width=200),
                            log_every_s=0)  # fmt: skip
    reporter.start(total=5, done=0, workers=1)
    qd = {"coverage": 0.25, "qd_score": 1.0, "best": 2.0, "mean": 1.0, "filled": 1}
    reporter.update(result=EvalResult(status=Status.OK, fitness=2.0), add_status=None, best=2.0, qd=qd)
    reporter.update(result=EvalResult(status=Status.WRONG), add_status=None, best=2.0, qd=qd)
    lines = [line for line in out.getvalue().splitlines() if "evaluated" in line]
    assert len(lines) == 2 and "1/5 evaluated" in lines[0] and "2/5 evaluated" in lines[1]
    assert "best 2.00 GFLOP/s" in lines[1] and "coverage 25%" in lines[1] and "wrong:1" in lines[1]
    quiet = io.StringIO()
    slow = RichReporter(unit="GFLOP/s", console=Console(file=quiet, force_terminal=False), log_every_s=3600)
    slow.start(total=5, done=0, workers=1)
    for _ in range(3):
        slow.update(result=EvalResult(status=Status.OK, fitness=2.0), add_status=None, best=2.0, qd=qd)
    assert sum("evaluated" in line for line in quiet.getvalue().splitlines()) == 1  # the first, then an hour on
