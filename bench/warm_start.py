"""Warm start from the memory of discoveries: how many evaluations a related search needs, with and without it.

    python bench/warm_start.py                       # matmul: n=1024 first, then n=768 cold vs warm
    python bench/warm_start.py --evals 120 --base 1024 --related 768

1. a search on the base setting records its improvements in a fresh memory;
2. a search on the related setting without memory (cold);
3. the same search with that memory (warm: its best past discoveries seed the population).
Prints the evaluations each related run needs to reach 95% of the best the cold one reaches (quality
measured as vs_reference, the ratio to numpy timed side by side, which machine load does not move).
Target: the warm run needs <= 30% of the cold run's evaluations.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from archive import run_db  # noqa: E402


def config(n: int, evals: int, seed: int, memory: dict, initial_random: int | None) -> dict:
    base = yaml.safe_load((ROOT / "configs" / "matmul_cpu.yaml").read_text())
    base["task"]["args"].update(m=n, n=n, k=n)
    base["budget"] = {"max_evals": evals}
    base["search"]["seed"] = seed
    if initial_random is not None:
        base["search"]["initial_random"] = initial_random
    base["memory"] = memory
    return base


def run(tmp: Path, name: str, cfg: dict) -> tuple[Path, float]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(tmp / name)], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    return tmp / name, time.monotonic() - t0


def trajectory(run_dir: Path) -> list[tuple[int, float, str]]:
    """(evaluation number, vs_reference or 0, operator) in evaluation order."""
    con = sqlite3.connect(run_db(run_dir))
    rows = con.execute("SELECT eval_seq, status, json_extract(metrics, '$.vs_reference'), operator FROM candidates "
                       "WHERE eval_seq IS NOT NULL ORDER BY eval_seq").fetchall()
    con.close()
    return [(i + 1, (vs or 0.0) if st == "ok" else 0.0, op) for i, (_, st, vs, op) in enumerate(rows)]


def evals_to_reach(traj: list[tuple[int, float, str]], level: float) -> int | None:
    return next((n for n, vs, _ in traj if vs >= level), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=int, default=1024, help="matmul size of the first search")
    ap.add_argument("--related", type=int, default=768, help="matmul size of the related searches")
    ap.add_argument("--evals", type=int, default=120, help="budget of each search")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seed-k", type=int, default=None, help="memory seeds per run (default: the memory's seed_k)")
    ap.add_argument("--initial-random", type=int, default=None,
                    help="random samples in each initial population (default: the config's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="evoforge-warm-") as t:
        tmp = Path(t)
        memory = {"enabled": True, "path": str(tmp / "memory")}
        if args.seed_k is not None:
            memory["seed_k"] = args.seed_k
        _, base_s = run(tmp, "base", config(args.base, args.evals, args.seed, memory, args.initial_random))
        related = (args.related, args.evals, args.seed + 1)
        cold_dir, cold_s = run(tmp, "cold", config(*related, {"enabled": False}, args.initial_random))
        warm_dir, warm_s = run(tmp, "warm", config(*related, memory, args.initial_random))
        cold, warm = trajectory(cold_dir), trajectory(warm_dir)
        best_cold = max(vs for _, vs, _ in cold)
        level = 0.95 * best_cold
        n_cold, n_warm = evals_to_reach(cold, level), evals_to_reach(warm, level)
        out = {
            "base": args.base, "related": args.related, "evals_per_run": args.evals,
            "initial_random": args.initial_random, "seed_k": args.seed_k,
            "seconds": {"base": base_s, "cold": cold_s, "warm": warm_s},
            "best_vs_reference": {"cold": best_cold, "warm": max(vs for _, vs, _ in warm)},
            "level": level, "evals_to_level": {"cold": n_cold, "warm": n_warm},
            "warm_over_cold": (n_warm / n_cold) if n_cold and n_warm else None,
            "memory_seeds_in_warm_run": sum(op == "memory" for _, _, op in warm),
        }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"matmul n={args.base} searched first ({args.evals} evals, {base_s:.0f} s), its improvements remembered")
    print(f"related setting n={args.related}, {args.evals} evals each, same seed:")
    print(f"  cold: best {best_cold:.3f}x numpy; reaches 95% of it ({level:.3f}x) after {n_cold} evals")
    print(f"  warm: best {out['best_vs_reference']['warm']:.3f}x numpy; reaches {level:.3f}x after {n_warm} evals "
          f"({out['memory_seeds_in_warm_run']} seeds from memory)")
    if out["warm_over_cold"] is not None:
        print(f"  warm needs {out['warm_over_cold']:.0%} of the cold run's evaluations (target <= 30%)")


if __name__ == "__main__":
    main()
