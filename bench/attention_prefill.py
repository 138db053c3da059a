"""What batch-invariant attention costs in prefill: the decoder's attention slot on the ``attention_decode`` task's
C kernel (each query's output independent of its chunk and batch) against numpy's BLAS attention (faster GEMM
shapes, rounding that moves with them), the rest of the engine the same, side by side in one run.

    python bench/attention_prefill.py                       # SmolLM2-135M-Instruct, fp32 C GEMMs, 2 threads
    python bench/attention_prefill.py --linear q8 --lengths 256 1024 2048 4096

Each prompt (random token ids) is prefilled in chunks of ``--chunk`` tokens; the best of ``--rounds`` rounds, the
two attentions alternating. Also prints whether each attention gives the same logits bit for bit when the prompt
comes in one chunk and when it comes in chunks of 7, 1 and 13 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--linear", default="fp32", help="the engine's GEMMs (a C precision mix; see evo serve --help)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from runtime.decoder.engine import ChatEngine, build, engine_threads
    from runtime.decoder.model import load_decoder
    from runtime.decoder.ops import DecoderOps
    from runtime.hardware import fingerprint

    model = load_decoder(gguf_model(args.model))
    engine = ChatEngine(linear=args.linear, slots="c", threads=args.threads)
    engine_threads(engine)
    c = build(model, engine).ops
    arms = {"c": c, "numpy": dataclasses.replace(c, attention=DecoderOps().attention)}
    print(f"{fingerprint()['cpu_model']}; {args.model}, linear {args.linear}, {args.threads} threads, "
          f"chunks of {args.chunk}")
    rng = np.random.default_rng(0)
    ids = rng.integers(100, model.config.vocab - 100, 63).tolist()
    for name, ops in arms.items():
        whole = model.forward([ids], [model.new_cache()], ops, all_logits=True)
        cache, parts, at = model.new_cache(4), [], 0
        for n in [7, 1, 13] * 3:
            parts.append(model.forward([ids[at : at + n]], [cache], ops, all_logits=True))
            at += n
        print(f"  {name:>5}: a 63-token prompt in one chunk and in chunks of 7, 1, 13: logits "
              f"{'identical' if np.array_equal(whole[:at], np.concatenate(parts)) else 'differ'} bit for bit")
    print(f"{'tokens':>7} {'c tok/s':>9} {'numpy tok/s':>12} {'c / numpy':>10}")
    for length in args.lengths:
        prompt = rng.integers(100, model.config.vocab - 100, length).tolist()
        best = dict.fromkeys(arms, 0.0)
        for _ in range(args.rounds):
            for name, ops in arms.items():
                cache = model.new_cache(length)
                start = time.perf_counter()
                for at in range(0, length, args.chunk):
                    model.forward([prompt[at : at + args.chunk]], [cache], ops)
                best[name] = max(best[name], length / (time.perf_counter() - start))
        print(f"{length:>7} {best['c']:>9.0f} {best['numpy']:>12.0f} {best['c'] / best['numpy']:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
