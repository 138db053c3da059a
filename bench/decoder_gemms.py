"""The decoder's GEMMs on numpy's BLAS against the linear slot's fp32 C kernel (the default where the CPU runs it),
the rest of the engine the same (C attention and RMSNorm), side by side in one run: a decode step of 8 sequences at
200 cached positions, and the prefill of one 512-token prompt. Each engine gets its own thread policy, as a server
gives it (``engine_threads``: BLAS's pool for numpy, OpenMP's team for the kernels).

    python bench/decoder_gemms.py                    # SmolLM2-135M-Instruct, 2 threads
    python bench/decoder_gemms.py --model gemma3 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the engines alternating")
    ap.add_argument("--seconds", type=float, default=3.0, help="decode steps timed per round, seconds")
    args = ap.parse_args()

    from runtime.decoder.engine import ChatEngine, build, engine_threads
    from runtime.decoder.model import load_decoder
    from runtime.hardware import fingerprint

    model = load_decoder(gguf_model(args.model))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab
    engines = {name: ChatEngine(linear=name, slots="c", threads=args.threads) for name in ("numpy", "fp32")}
    built = {}
    step: dict[str, list[float]] = {name: [] for name in engines}
    prefill: dict[str, list[float]] = {name: [] for name in engines}
    print(f"{fingerprint()['cpu_model']}; {model.path.name}, {args.threads} threads")
    for _ in range(args.rounds):
        for name, engine in engines.items():
            engine_threads(engine)
            ops = built.setdefault(name, build(model, engine).ops)
            caches = [model.new_cache(256) for _ in range(8)]
            model.forward([rng.integers(100, vocab - 100, 200).tolist() for _ in range(8)], caches, ops)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < args.seconds:
                model.forward([[int(rng.integers(100, vocab - 100))] for _ in range(8)], caches, ops)
                n += 1
                for c in caches:  # the same positions every step
                    c.length -= 1
            step[name].append((time.perf_counter() - start) / n)
            cache = model.new_cache(512)
            t0 = time.perf_counter()
            model.forward([rng.integers(100, vocab - 100, 512).tolist()], [cache], ops)
            prefill[name].append(512 / (time.perf_counter() - t0))
    for name in engines:
        s, p = median(step[name]), median(prefill[name])
        print(f"  {name:>6}: decode step {s * 1e3:6.1f} ms ({8 / s:6.1f} tok/s), prefill {p:6.0f} tok/s")
    speed = median(step["numpy"]) / median(step["fp32"])
    print(f"  fp32 C / numpy: decode {speed:.2f}x, prefill {median(prefill['fp32']) / median(prefill['numpy']):.2f}x")


if __name__ == "__main__":
    main()
