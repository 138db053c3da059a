"""A model nothing was tuned for, through the factory, against sentence-transformers on that model.

A random-weight BERT sentence encoder of another shape than MiniLM (built here with transformers, by the
same builder the tests use: nothing is downloaded) goes through one ``evo factory`` run from an empty
memory of discoveries; then the engine it promoted meets sentence-transformers (and the other peers of
``bench/engine_vs_peers.py``) on that model, side by side, serving and in bulk.

    python bench/factory_new_model.py          # hidden 512, 8 heads, 4 layers, 2048, CLS pooling (~15 min)
    python bench/factory_new_model.py --hidden 256 --heads 4 --layers 6 --intermediate 1024 --pooling mean
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "runtime" / "engine")]

from bert_models import make_bert  # noqa: E402

from archive import FactoryDir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_new_model")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--pooling", choices=("mean", "cls"), default="cls")
    ap.add_argument("--kernel-evals", type=int, default=48)
    ap.add_argument("--engine-evals", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="side-by-side rounds of the comparison")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_bert(args.out / "model", hidden=args.hidden, heads=args.heads, layers=args.layers,
                      intermediate=args.intermediate, pooling=args.pooling)  # fmt: skip
    config = yaml.safe_load((ROOT / "configs" / "factory_minilm.yaml").read_text())
    config["model_dir"] = str(model)
    config["budget"].update(rounds=1, kernel_evals=args.kernel_evals, engine_evals=args.engine_evals)
    (args.out / "factory.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "EVOFORGE_MEMORY_DIR": tempfile.mkdtemp(prefix="evoforge-memory-")}
    factory = args.out / "factory"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "evo", "factory", str(args.out / "factory.yaml"), "--dir", str(factory)],
                   check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)  # fmt: skip
    wall = time.monotonic() - t0
    promoted = FactoryDir(factory).promotions()
    if not promoted:
        raise SystemExit(f"the factory promoted nothing: see evo factory status {factory}")
    last = promoted[-1]
    got = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_vs_peers.py"), "--run-dir", last["run_dir"],
                          "--id", last["elite"], "--rounds", str(args.rounds), "--json"],
                         check=True, cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    figures = json.loads(got.stdout)
    print(f"model: random BERT, hidden {args.hidden}, {args.heads} heads, {args.layers} layers, intermediate "
          f"{args.intermediate}, {args.pooling} pooling; factory: 1 round, {args.kernel_evals} kernel and "
          f"{args.engine_evals} engine evaluations, {wall:.0f} s, promoted {last['elite'][:12]} "
          f"({last['throughput']:.1f} sentences/s in its duel, {last['gain']:+.1%} against the default engine)")
    print(f"engine params: {' '.join(f'{k}={v}' for k, v in figures['params'].items())}")
    print("| engine | sentences/s | vs sentence-transformers | p50 ms | p99 ms | bulk sentences/s | min cosine |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in figures["rows"]:
        vs = f"{r['vs_sentence_transformers']:.2f}x" if r["vs_sentence_transformers"] else "-"
        tput, p50, p99, bulk = (f"{r[k]:.1f}" if r[k] is not None else "-"  # a bulk-only row has no serving
                                for k in ("throughput", "p50_ms", "p99_ms", "bulk"))
        print(f"| {r['name']} | {tput} | {vs} | {p50} | {p99} | {bulk} | {r['min_cosine']:.5f} |")
    for measure, v in figures["versus_strongest_peer"].items():
        print(f"{measure}: {v['ours']} is {v['ratio']:.2f}x the strongest peer at min cosine >= 0.99 ({v['peer']})")
    for name, why in figures["skipped"].items():
        print(f"not run: {name}: {why}")


if __name__ == "__main__":
    main()
