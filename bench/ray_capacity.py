"""Controller capacity on Ray: the evaluations per second the driver sustains as slots grow.

Evaluations are simulated (each is a fixed sleep in an asynchronous actor holding many slots, so that
neither cores nor memory are the limit), over a Ray cluster of ``--nodes`` nodes started on this machine,
one actor per node. The driver is the real one: :class:`runtime.executors.RayPool` submitting and
collecting, and every result recorded in a real run store (SQLite) as a search records it.

    python bench/ray_capacity.py --slots 8 64 256 1024 --sleep 1.0 --seconds 15

Target: >= 200 evaluations/s at 1024 slots.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from archive import Store, run_db  # noqa: E402
from genome import Genome  # noqa: E402
from runtime import EvalRequest, EvalSettings, TaskSpec  # noqa: E402
from runtime.result import EvalResult, Status  # noqa: E402


class SleepEvaluator:
    """A node whose every evaluation takes ``SLEEP`` seconds and nothing else."""

    SLEEP = 1.0

    def __init__(self, workers: int, cc: str = "cc") -> None:
        self.workers = workers

    def describe(self) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "host": "sim", "workers": self.workers,
                "hardware": {"cpu_model": "simulated"}, "speed": {}, "compiler_missing": None, "environment": []}

    async def evaluate(self, request: EvalRequest, modules: dict) -> EvalResult:
        await asyncio.sleep(self.SLEEP)
        return EvalResult(status=Status.OK, fitness=1.0, unit="GFLOP/s", metrics={"vs_reference": 1.0})

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=1.0, help="seconds per simulated evaluation")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per slot count")
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    from runtime.executors import RayPool

    SleepEvaluator.SLEEP = args.sleep
    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    settings = EvalSettings()
    task = TaskSpec(name="matmul", args={"m": 64, "n": 64, "k": 64})
    print(f"{args.nodes} Ray nodes on this machine ({os.cpu_count()} cores), {args.sleep:g} s per evaluation")
    print(f"{'slots':>6} {'evals/s':>9} {'ideal':>7} {'of ideal':>9} {'store ms/result':>16}")
    for slots in args.slots:
        per_node = max(1, slots // args.nodes)
        with tempfile.TemporaryDirectory() as tmp, RayPool(cluster.address, workers_per_node=per_node,
                                                           say=lambda line: None, evaluator=SleepEvaluator) as pool:
            store = Store(run_db(tmp))
            n, done, store_s = 0, 0, 0.0
            t_end = None
            t0 = time.monotonic()
            while True:
                while pool.in_flight < pool.slots:
                    g = Genome(params={"i": n})
                    store.add_pending(genome=g, operator="random")
                    pool.submit(EvalRequest(key=g.id, genome=g, task=task, settings=settings, cache_dir=tmp))
                    n += 1
                got = pool.next_result(5.0)
                if got is None:
                    continue
                s0 = time.perf_counter()
                store.record_result(got[0].key, got[1])
                store_s += time.perf_counter() - s0
                now = time.monotonic()
                if now - t0 >= args.sleep * 2 and t_end is None:  # past the ramp: start counting
                    t_end, start_done = now + args.seconds, done
                    t_start = now
                done += 1
                if t_end is not None and now >= t_end:
                    break
            rate = (done - start_done) / (time.monotonic() - t_start)
            ideal = pool.slots / args.sleep
            print(f"{pool.slots:>6} {rate:>9.1f} {ideal:>7.0f} {rate / ideal:>9.0%} {store_s / done * 1e3:>16.2f}",
                  flush=True)
            store.close()
    cluster.shutdown()


if __name__ == "__main__":
    main()
