"""Memory of discoveries at scale: insert rate, top-10 query latency (flat vs HNSW), index size on disk.

    python bench/memory_scale.py --n 1000000

Builds N synthetic entries (10 tasks, random args and params, so every summary differs) and adds them
through ``Memory.add`` (batched: hash embedding, SQLite rows with their vectors, index, index file),
with the deterministic ``hash`` embedder (dim 384) so no model is timed. Then times ``Memory.search``
(embedding the query, searching, reading the hits' rows) with the exact index, rebuilds the index as
HNSW from the stored vectors, and times it again; recall@10 of HNSW is measured against the exact
answers. Target (DESIGN.md): top-10 query < 10 ms at 1M entries. One thread. Prints human lines, then
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from archive.memory import Memory, MemoryEntry, MemorySettings  # noqa: E402
from genome import Genome  # noqa: E402

TASKS = ["matmul", "softmax", "rmsnorm", "layernorm", "conv2d", "gelu", "attention", "transpose", "reduce", "scan"]
HW = [{"id": f"hw{i}", "cpu_model": m} for i, m in enumerate(["Intel Xeon 8480", "AMD EPYC 9654", "Graviton3"])]


def entries(n: int, seed: int = 0) -> Iterator[MemoryEntry]:
    rng = np.random.default_rng(seed)
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        size = int(rng.choice([256, 512, 768, 1024, 2048, 4096]))
        params = {"MR": int(rng.integers(1, 17)), "NR": int(16 * rng.integers(1, 5)),
                  "MC": int(8 * rng.integers(4, 64)), "KC": int(32 * rng.integers(2, 16)),
                  "UNROLL": int(2 ** rng.integers(0, 4)), "i": i}
        vs = float(rng.uniform(0.05, 2.5))
        yield MemoryEntry(task=task, task_args={"n": size, "threads": int(rng.integers(1, 5))},
                          genome=Genome(params=params), hardware=HW[i % len(HW)], fitness=vs * 100, unit="GFLOP/s",
                          vs_reference=vs, run=f"runs/r{i % 97}")


def time_queries(mem: Memory, queries: list[str], k: int = 10) -> tuple[list[float], list[set[str]]]:
    lat, answers = [], []
    for q in queries:
        t = time.perf_counter()
        hits = mem.search(q, k=k)
        lat.append(time.perf_counter() - t)
        answers.append({h.entry.id for h in hits})
    return lat, answers


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, p))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="entries")
    ap.add_argument("--queries", type=int, default=200, help="timed queries per index")
    ap.add_argument("--dir", type=Path, default=None, help="memory directory (default: a temporary one)")
    args = ap.parse_args()
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="memory-scale-")
    path = args.dir or Path(tmp.name)  # type: ignore[union-attr]
    out: dict[str, object] = {"n": args.n}

    flat = MemorySettings(embedder="hash", index="flat")
    t = time.perf_counter()
    with Memory(path, settings=flat) as mem:
        added = mem.add(entries(args.n))
    out["insert_s"] = time.perf_counter() - t
    out["insert_per_s"] = added / out["insert_s"]  # type: ignore[operator]
    print(f"inserted {added} entries in {out['insert_s']:.1f} s ({out['insert_per_s']:.0f}/s, embedding included)")

    rng = np.random.default_rng(1)
    queries = [f"{TASKS[int(rng.integers(10))]} n={int(rng.choice([512, 1024, 2048]))} MR={int(rng.integers(1, 17))}"
               " fast register tiling" for _ in range(args.queries)]
    with Memory(path, settings=flat) as mem:
        mem.search("warm up")
        lat_flat, exact = time_queries(mem, queries)
        out["db_bytes"] = (path / Memory.DB).stat().st_size
        out["flat_index_bytes"] = (path / Memory.INDEX).stat().st_size
    print(f"flat: top-10 median {pct(lat_flat, 50):.2f} ms, p99 {pct(lat_flat, 99):.2f} ms; "
          f"index file {out['flat_index_bytes'] / 1e6:.0f} MB, sqlite {out['db_bytes'] / 1e6:.0f} MB")

    hnsw = MemorySettings(embedder="hash", index="hnsw")
    t = time.perf_counter()
    with Memory(path, settings=hnsw) as mem:
        mem.search("warm up")  # builds the HNSW index from the stored vectors
        out["hnsw_build_s"] = time.perf_counter() - t
        mem._keeper.save()  # a reader does not save; persist it to measure its size
        out["hnsw_index_bytes"] = (path / Memory.INDEX).stat().st_size
        lat_hnsw, approx = time_queries(mem, queries)
    recall = statistics.mean(len(a & e) / max(len(e), 1) for a, e in zip(approx, exact, strict=True))
    print(f"hnsw: built in {out['hnsw_build_s']:.1f} s; top-10 median {pct(lat_hnsw, 50):.2f} ms, "
          f"p99 {pct(lat_hnsw, 99):.2f} ms, recall@10 {recall:.3f}; index file {out['hnsw_index_bytes'] / 1e6:.0f} MB")
    out.update(flat_median_ms=pct(lat_flat, 50), flat_p99_ms=pct(lat_flat, 99), hnsw_median_ms=pct(lat_hnsw, 50),
               hnsw_p99_ms=pct(lat_hnsw, 99), hnsw_recall_at_10=recall)
    print(json.dumps(out))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
