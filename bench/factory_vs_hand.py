"""The engine factory against the hand-run flow, on the same machine under the same load.

The hand-run flow is the README's six commands: five kernel searches (gelu, layernorm, softmax,
linear_bf16, linear_int8) in order, then the engine search offered their runs. The factory gets the
same budget in all (the kernel evaluations summed, the engine search's), one round or more. Both are
timed; then their engines meet side by side, as the factory's duels do (held-out similarity, then
alternating load rounds under the timing lock), and the bench prints sentences/s and p99 of each.

    python bench/factory_vs_hand.py                        # both flows, then the duel (~25 min on 2 cores)
    python bench/factory_vs_hand.py --hand-dir runs --hand-s 1043   # the hand-run flow's runs exist already
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from archive import FactoryDir  # noqa: E402
from evo.factory.config import FactoryConfig  # noqa: E402
from evo.factory.measure import Measurer  # noqa: E402

HAND = (("gelu_minilm", 12), ("layernorm_minilm", 12), ("softmax_cpu", 40), ("linear_bf16_minilm", 24),
        ("linear_int8_minilm", 24))  # fmt: skip
ENGINE_EVALS = 40


def _evo(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "evo", *args], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def hand_run(out: Path, env: dict[str, str]) -> float:
    """The six commands, as the README gives them (the engine config's kernel runs are runs/<name>)."""
    t0 = time.monotonic()
    for name, evals in HAND:
        _evo("run", f"configs/{name}.yaml", "--run-dir", str(out / name), "--max-evals", str(evals), env=env)
    engine = yaml.safe_load((ROOT / "configs" / "engine_minilm.yaml").read_text())
    for runs in engine["task"]["args"]["kernels"].values():
        for kr in runs if isinstance(runs, list) else [runs]:
            kr["run_dir"] = str(out / Path(kr["run_dir"]).name)
    config = out / "engine_minilm.yaml"
    config.write_text(yaml.safe_dump(engine))
    _evo("run", str(config), "--run-dir", str(out / "engine_minilm"), "--max-evals", str(ENGINE_EVALS), env=env)
    return time.monotonic() - t0


def factory_run(out: Path, rounds: int, env: dict[str, str]) -> float:
    config = yaml.safe_load((ROOT / "configs" / "factory_minilm.yaml").read_text())
    engine = yaml.safe_load((ROOT / "configs" / "engine_minilm.yaml").read_text())["task"]["args"]
    config["load"]["p99_budget_ms"] = engine["p99_budget_ms"]  # the hand-run engine search's load
    config["budget"].update(rounds=rounds, kernel_evals=sum(e for _, e in HAND) // rounds,
                            engine_evals=ENGINE_EVALS // rounds)  # fmt: skip
    path = out / "factory.yaml"
    path.write_text(yaml.safe_dump(config))
    t0 = time.monotonic()
    _evo("factory", str(path), "--dir", str(out / "factory"), env=env)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_factory")
    ap.add_argument("--hand-dir", type=Path, help="a directory holding the hand-run flow's runs (skip running it)")
    ap.add_argument("--hand-s", type=float, help="with --hand-dir: the seconds the hand-run flow took")
    ap.add_argument("--rounds", type=int, default=2, help="factory rounds (the same budget in all)")
    ap.add_argument("--duel-rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds of each load round of the duel")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as memory:  # both start from an empty memory of discoveries
        if args.hand_dir is None:
            hand = args.out / "hand"
            hand.mkdir(exist_ok=True)
            hand_s = hand_run(hand, {**env, "EVOFORGE_MEMORY_DIR": os.path.join(memory, "hand")})
        else:
            hand, hand_s = args.hand_dir, args.hand_s
        fac_s = factory_run(args.out, args.rounds, {**env, "EVOFORGE_MEMORY_DIR": os.path.join(memory, "factory")})
    from archive import Run

    with Run.open(hand / "engine_minilm") as run:
        hand_elite = run.elite_ids(1)[0]
    factory = FactoryDir(args.out / "factory")
    promoted = factory.promotions()
    factory_engine = ({"run_dir": promoted[-1]["run_dir"], "elite": promoted[-1]["elite"]} if promoted
                      else None)  # fmt: skip
    factory_cfg = FactoryConfig.model_validate(factory.read_config())
    promote = factory_cfg.promote.model_copy(update={"held_out_texts": 64, "rounds": args.duel_rounds,
                                                     "duration_s": args.duration})  # fmt: skip
    # the factory's own duel: a sandboxed worker, each engine in a filtered host, the clock in the worker
    measurer = Measurer(args.out / "duel", factory_cfg.model_copy(update={"promote": promote, "seed": 0}))
    try:
        got = measurer.duel(factory_engine, {"run_dir": str(hand / "engine_minilm"), "elite": hand_elite})
    finally:
        measurer.close()
    if got.status != "ok" or got.metrics.get("rival_failed"):
        raise SystemExit(f"the duel had no verdict: {got.status}: {got.error or got.metrics.get('rival_failed')}")
    m = got.metrics
    f = {k: m[k] for k in ("throughput", "p99_ms", "similarity", "rounds")}
    h = {k: m[f"rival_{k}"] for k in ("throughput", "p99_ms", "similarity", "rounds")}
    out = {"hand_s": hand_s, "factory_s": fac_s, "factory_rounds": args.rounds, "promotions": len(promoted),
           "factory": {**f, "engine": factory_engine}, "hand": {**h, "engine": hand_elite}}  # fmt: skip
    (args.out / "result.json").write_text(json.dumps(out, indent=2))
    print(f"hand-run flow: {hand_s:.0f} s, six commands; factory: {fac_s:.0f} s, one command, {args.rounds} rounds, "
          f"{len(promoted)} promotion(s)")
    print("| flow | sentences/s | p99 ms | min cosine (held-out) | rounds |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in (("factory", f), ("hand-run", h)):
        print(f"| {name} | {r['throughput']:.1f} | {r['p99_ms']:.1f} | {r['similarity']:.5f} | "
              f"{', '.join(format(x['throughput'], '.1f') for x in r['rounds'])} |")
    print(f"factory / hand-run: {f['throughput'] / h['throughput']:.2f}x throughput, "
          f"{fac_s / hand_s:.2f}x wall time")


if __name__ == "__main__":
    main()
