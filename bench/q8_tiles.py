"""The q8 GEMM kernels' register tiles at a decoder's shapes: one layer's four GEMMs of SmolLM2-135M (QKV 576 x 960,
output 576 x 576, gate-up 576 x 3072, down 1536 x 576) at decode steps of 8 to 32 rows, each tile in turn, side by
side in one run. What picks the tile a decoder runs by default (the task's ``tile_seed``).

    python bench/q8_tiles.py                        # linear_q8_vnni where the CPU has AVX512_VNNI, else linear_q8
    python bench/q8_tiles.py --task linear_q8 --tile 1,4 --tile 2,2
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import median

import numpy as np

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default=None, help="linear_q8 or linear_q8_vnni (default: what --linear q8 runs here)")
    ap.add_argument("--tile", action="append", metavar="MR,NR", help="a tile (repeat; default: a set of them)")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, "blas")
    from genome import Genome
    from runtime.decoder.kernels import linear_task, load_source, seed_source
    from runtime.task import load_task_class

    task = load_task_class(args.task or linear_task("q8"))({"threads": args.threads})
    default = (task.tile_seed["MR"], task.tile_seed["NR"])  # type: ignore[attr-defined]
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tile] if args.tile else \
        sorted({default, (1, 4), (2, 4), (4, 2), (2, 2), (4, 1)})  # fmt: skip
    rng = np.random.default_rng(0)
    packed = {s: task.slot_pack(rng.uniform(-1, 1, s).astype(np.float32)) for s in SHAPES}  # type: ignore[attr-defined]
    print(f"{task.name}: SmolLM2's four GEMMs of a layer, {args.threads} threads, median of {args.calls} calls; "
          f"the default tile is {default[0]} x {default[1]}")  # fmt: skip
    for m in args.rows:
        xs = {s: rng.standard_normal((m, s[0])).astype(np.float32) for s in SHAPES}
        ys = {s: np.empty((m, s[1]), np.float32) for s in SHAPES}
        bias = {s: np.zeros(s[1], np.float32) for s in SHAPES}
        for mr, nr in tiles:
            genome = Genome(params={**task.tile_seed, "MR": mr, "NR": nr})  # type: ignore[attr-defined]
            if task.space().violations(genome.params):
                print(f"  {m:3d} rows  tile {mr} x {nr}: outside the task's space (registers)")
                continue
            kernel = load_source(seed_source(task, genome), None, None)
            calls = [kernel.bind([m, s[1], s[0], xs[s], *packed[s], bias[s], ys[s]]) for s in SHAPES]
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                for call in calls:
                    call()
                times.append(time.perf_counter() - t0)
            t = median(times)
            ops = 2 * m * sum(k * n for k, n in SHAPES)
            print(f"  {m:3d} rows  tile {mr} x {nr}  {t * 1e3:7.3f} ms  {ops / t / 1e9:6.0f} GOP/s")


if __name__ == "__main__":
    main()
