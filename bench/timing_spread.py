"""How far apart the sandboxed timings of one kernel land when it is timed again: the figures a search ranks by.

    python bench/timing_spread.py                  # attention_decode_f16 at the SmolLM2 factory's shapes, 8 each
    python bench/timing_spread.py --repeats 16

Two points of the attention template (the engine's built-in kernel, and a faster one), each evaluated ``--repeats``
times through the sandboxed pool exactly as a search evaluates a candidate (checked, then timed against the
reference), then the faster one in as many duels against the built-in one. Prints each evaluation's figure and its
timing's own uncertainty, the spread (largest over smallest) of each, and of the duels' ratios. A search that
ranks two points by one evaluation each can only tell apart what differs by more than this spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from genome import Genome  # noqa: E402
from runtime import EvalRequest, EvalSettings, LocalPool, Status, TaskSpec  # noqa: E402

ARGS = {"batch": 8, "cache": "f16", "head_dim": 64, "heads": 9, "kv_heads": 3, "length": 640, "queries": 8,
        "threads": 2, "window": 0}  # fmt: skip
BUILT_IN = {"VEC": 8, "KBLOCK": 32, "QTILE": 4, "SCORES": "DOT", "EXP": "LIBM", "VALUES": "AXPY"}
FASTER = {**BUILT_IN, "SCORES": "KEYS", "EXP": "POLY", "VALUES": "ROWS"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=8)
    opts = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="timing-spread-")
    settings = EvalSettings.model_validate({"sandbox": {"timeout": 120}})
    spec = TaskSpec(name="attention_decode_f16", args=ARGS)

    with LocalPool(workers=1) as pool:

        def evaluate(params: dict, **stages: object) -> dict:
            pool.submit(EvalRequest(key="k", genome=Genome(params=params), task=spec, settings=settings,
                                    cache_dir=cache, **stages))  # fmt: skip
            got = pool.next_result()
            assert got is not None
            result = got[1]
            if result.status is not Status.OK:
                sys.exit(f"error: {result.status.value}: {result.error}")
            return {"fitness": result.fitness, **result.metrics}

        def spread(values: list[float]) -> str:
            return f"spread {max(values) / min(values):.2f}x, median {statistics.median(values):.2f}"

        for name, params in (("built-in", BUILT_IN), ("faster", FASTER)):
            runs = [evaluate(params) for _ in range(opts.repeats)]
            figures = [r["fitness"] for r in runs]
            print(f"{name:9} GB/s  {' '.join(f'{f:5.2f}' for f in figures)}   {spread(figures)}")
            uncertainty = [r.get("rel_uncertainty") or float("nan") for r in runs]
            print(f"{'':9} unc.  {' '.join(f'{u:5.3f}' for u in uncertainty)}", flush=True)
        ratios = [evaluate(FASTER, stages="duel", rival=Genome(params=BUILT_IN))["duel_ratio"]
                  for _ in range(opts.repeats)]  # fmt: skip
        print(f"duels     ratio {' '.join(f'{r:5.2f}' for r in ratios)}   {spread(ratios)}")


if __name__ == "__main__":
    main()
