"""What the factory's duel costs behind the trust boundary, and whether its verdicts hold: the same pair of engines
dueled again and again through the factory's own measurer (:class:`evo.factory.measure.Measurer`), a sandboxed
worker with each engine in a filtered host, as `evo factory` duels them.

    python bench/factory_duel.py --run-dir runs/engine_minilm            # its best against the default engine
    python bench/factory_duel.py --run-dir R --against ID --repeats 5 --rounds 3 --duration 4

Prints each duel's seconds (wall, from the request to the verdict) and its gain (the candidate's median
throughput over the incumbent's, minus one), then their median and spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from archive import Run  # noqa: E402
from evo.factory.config import FactoryConfig  # noqa: E402
from evo.factory.measure import Measurer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True, help="an engine run: its best is the candidate")
    ap.add_argument("--id", help="the candidate (default: the run's best)")
    ap.add_argument("--against", help="the incumbent, an id of the same run (default: the default engine)")
    ap.add_argument("--repeats", type=int, default=3, help="duels of the pair")
    ap.add_argument("--rounds", type=int, default=3, help="load rounds of each engine per duel (promote.rounds)")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds of each round (promote.duration_s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with Run.open(args.run_dir) as run:
        a = run.task_args
        cid = args.id or run.elite_ids(1)[0]
    load = {k: a[k] for k in ("threads", "concurrency", "lengths", "warmup_s", "texts", "p99_budget_ms") if k in a}
    promote = {"rounds": args.rounds, "duration_s": args.duration}
    config = FactoryConfig.model_validate({"model_dir": a.get("model_dir"), "load": load, "promote": promote})
    candidate = {"run_dir": str(args.run_dir.resolve()), "elite": cid}
    incumbent = {"run_dir": str(args.run_dir.resolve()), "elite": args.against} if args.against else None
    duels = []
    with tempfile.TemporaryDirectory() as tmp:
        measurer = Measurer(Path(tmp), config)
        try:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                got = measurer.duel(candidate, incumbent)
                seconds = time.perf_counter() - t0
                m = got.metrics
                gain = m["throughput"] / m["rival_throughput"] - 1 if m.get("rival_throughput") else None
                duels.append({"seconds": seconds, "status": str(got.status), "gain": gain,
                              "throughput": m.get("throughput"), "incumbent_throughput": m.get("rival_throughput"),
                              "error": got.error})  # fmt: skip
        finally:
            measurer.close()
    gains = [d["gain"] for d in duels if d["gain"] is not None]
    out = {"candidate": candidate, "incumbent": incumbent, "rounds": args.rounds, "duration_s": args.duration,
           "duels": duels, "median_seconds": statistics.median(d["seconds"] for d in duels),
           "median_gain": statistics.median(gains) if gains else None,
           "gain_range": [min(gains), max(gains)] if gains else None}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"duel of {cid[:12]} against {args.against[:12] if args.against else 'the default engine'}: "
          f"{args.rounds} rounds of {args.duration:g} s each, {args.repeats} times")
    for d in duels:
        what = f"gain {d['gain']:+.1%}" if d["gain"] is not None else f"{d['status']}: {d['error']}"
        print(f"  {d['seconds']:6.1f} s  {what}")
    if gains:
        print(f"median {out['median_seconds']:.1f} s per duel, gain {out['median_gain']:+.1%} "
              f"(from {min(gains):+.1%} to {max(gains):+.1%})")


if __name__ == "__main__":
    main()
