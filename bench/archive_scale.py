"""Archive store at scale: insert rate and best-k latency with N synthetic candidates.

    python bench/archive_scale.py --n 1000000

Inserts N candidates through the Store API (the first ``--single`` one ``add_pending`` call each,
the rest with ``add_pending_many`` in batches), records a result for every one (one transaction per
``record_result``, as a run does), then times ``best(10)`` (median of 100 queries). Only the Store
calls are timed: genomes and results are built outside. Targets
(DESIGN.md): insert >= 5k/s, best-k < 10 ms at 1M rows. Prints human lines, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from archive import Store, run_db  # noqa: E402
from genome import Genome  # noqa: E402
from runtime.result import EvalResult, Status  # noqa: E402

OPERATORS = ("random", "mutate", "crossover", "llm_diff")
FAILURES = (Status.WRONG, Status.COMPILE_ERROR, Status.TIMEOUT)
HARDWARE = {"cpu": "synthetic", "cores": 2, "flags": ["avx2", "fma"]}


def _genome(i: int) -> Genome:
    return Genome(params={"i": i, "MC": 8 << (i % 6), "NR": 4 << (i % 3), "unroll": i % 5})


def _result(rng: np.random.Generator) -> tuple[EvalResult, dict[str, float]]:
    if rng.random() < 0.7:
        fitness = float(rng.lognormal(3.0, 0.5))
        result = EvalResult(
            status=Status.OK, fitness=fitness, unit="GFLOP/s",
            metrics={"vs_reference": fitness / 20.0, "median_s": 1e-3},
            timings={"compile": 0.2, "check": 0.01, "time": 0.3, "total": 0.51}, hardware=HARDWARE,
        )  # fmt: skip
        return result, {"intensity": float(rng.random()), "footprint": float(rng.random())}
    status = FAILURES[int(rng.integers(len(FAILURES)))]
    return EvalResult(status=status, error=f"synthetic {status}", timings={"total": 0.1}, hardware=HARDWARE), {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="candidates to insert")
    ap.add_argument("--batch", type=int, default=1000, help="rows per add_pending_many call")
    ap.add_argument("--single", type=int, default=10_000, help="candidates inserted one add_pending call each")
    ap.add_argument("--dir", type=Path, default=None, help="where to write archive.db (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(args, run_db(args.dir or Path(tmp)))


def run(args: argparse.Namespace, path: Path) -> None:
    if path.exists():
        raise SystemExit(f"{path} exists; give an empty --dir")
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    n, single = args.n, min(args.single, args.n)
    ids: list[str] = []

    def entry(i: int) -> tuple[Genome, list[str], str]:
        g = _genome(i)
        parents = [ids[int(rng.random() * len(ids))] for _ in range(1 + (i % 3 == 0))] if ids else []
        ids.append(g.id)
        return g, parents, OPERATORS[i % len(OPERATORS)]

    # Only the Store calls are timed; genomes and results are built (and their ids hashed) outside.
    with Store(path) as store:
        t_single = t_bulk = t_record = 0.0
        for i in range(single):
            g, parents, op = entry(i)
            t0 = time.perf_counter()
            store.add_pending(genome=g, parents=parents, operator=op)
            t_single += time.perf_counter() - t0
        for start in range(single, n, args.batch):
            batch = [entry(i) for i in range(start, min(start + args.batch, n))]
            for g, _, _ in batch:
                _ = g.id  # hash outside the timed call
            t0 = time.perf_counter()
            store.add_pending_many(batch)
            t_bulk += time.perf_counter() - t0
        for start in range(0, n, args.batch):
            chunk = [(cid, *_result(rng)) for cid in ids[start : start + args.batch]]
            t0 = time.perf_counter()
            for cid, result, descriptors in chunk:
                store.record_result(cid, result, descriptors=descriptors)
            t_record += time.perf_counter() - t0

        lat = []
        for _ in range(100):
            q0 = time.perf_counter()
            best = store.best(10)
            lat.append(time.perf_counter() - q0)
        prefix_lat = []
        for cid in ids[:: max(1, n // 100)][:100]:
            q0 = time.perf_counter()
            store.get(cid[:10])
            prefix_lat.append(time.perf_counter() - q0)
        assert len(best) == 10 and all(a.fitness >= b.fitness for a, b in pairwise(best))  # type: ignore[operator]
        count = store.count()
    size = path.stat().st_size  # closing the last connection checkpointed the WAL into the file
    out = {
        "n": n,
        "count": count,
        "add_pending_rows_per_s": single / t_single if single else None,
        "add_pending_many_rows_per_s": (n - single) / t_bulk if n > single else None,
        "record_result_per_s": n / t_record,
        "insert_and_record_per_s": n / (t_single + t_bulk + t_record),
        "best10_median_ms": 1e3 * statistics.median(lat),
        "best10_max_ms": 1e3 * max(lat),
        "get_prefix_median_ms": 1e3 * statistics.median(prefix_lat),
        "db_bytes": size,
        "db_bytes_per_row": size / n,
    }

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}/s"

    print(f"archive store, {n:,} candidates ({count:,} stored)")
    print(f"  add_pending (commit per call)      {rate(out['add_pending_rows_per_s'])}")
    print(f"  add_pending_many (batch {args.batch})      {rate(out['add_pending_many_rows_per_s'])}")
    print(f"  record_result (commit per call)    {rate(out['record_result_per_s'])}")
    print(f"  insert + record, overall           {rate(out['insert_and_record_per_s'])}   (target >= 5,000/s)")
    print(f"  best(10): median {out['best10_median_ms']:.3f} ms, max {out['best10_max_ms']:.3f} ms   (target < 10 ms)")
    print(f"  get(10-char prefix): median {out['get_prefix_median_ms']:.3f} ms")
    print(f"  db size {size / 2**20:,.1f} MiB ({out['db_bytes_per_row']:.0f} B/row)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
