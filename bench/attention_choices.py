"""The ``attention_decode`` template's choices, side by side in one run: the kernel alone at a decode step and at a
step with prompt chunks, then the chat engine around it under a generative load.

    python bench/attention_choices.py                            # SmolLM2-135M's heads, f16 cache, 2 threads
    python bench/attention_choices.py --cache fp32 --skip-engine

Kernel: 8 sequences over up to ``--length`` cached positions (SmolLM2-135M's 9 query and 3 KV heads of 64), one new
query each (decode), then with a chunk of ``--chunk`` queries in every other sequence (a step that prefills beside
the decoding requests); each point's median over ``--repeats`` calls, the points interleaved, each against the
template's seed (the engine's built-in kernel). Every point is checked against the task's reference first.
Engine: the hand-built engine (q8 GEMMs, f16 cache, 24-token steps, the LM head's top list) on the seed, then on each
point, serving 8 prompts of 32 to 512 tokens to 96 tokens each through its own scheduler; medians of ``--rounds``
rounds, the engines alternating. Both are our own built-in kernels, timed in this process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script

SEED = {"VEC": 8, "KBLOCK": 32, "QTILE": 4, "SCORES": "DOT", "EXP": "LIBM", "VALUES": "AXPY"}
POINTS = [
    {**SEED, "VALUES": "ROWS"},
    {**SEED, "VALUES": "ROWS", "SCORES": "KEYS"},
    {**SEED, "VALUES": "ROWS", "SCORES": "KEYS", "EXP": "POLY"},
    {**SEED, "VALUES": "ROWS", "SCORES": "KEYS", "EXP": "POLY", "KBLOCK": 64, "QTILE": 8},
    {**SEED, "VALUES": "ROWS", "SCORES": "KEYS", "EXP": "POLY", "VEC": 16, "KBLOCK": 128, "QTILE": 8},
]


def label(point: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items() if SEED.get(k) != v) or "seed"


def kernel_table(cache: str, length: int, chunk: int, threads: int, repeats: int) -> None:
    from genome import Genome
    from runtime.decoder.kernels import load_source, seed_source
    from runtime.tasks.attention_decode import AttentionDecode

    for queries in (1, chunk):
        task = AttentionDecode({"batch": 8, "heads": 9, "kv_heads": 3, "head_dim": 64, "length": length,
                                "cache": cache, "threads": threads, "queries": queries})  # fmt: skip
        case = task.full_case()
        inputs = task.inputs(case, np.random.default_rng(0))
        shapes = task.outputs(case)
        want = {k: np.empty(shape, dtype) for k, (shape, dtype) in shapes.items()}
        task.reference(case, inputs, want)
        calls = []
        for point in (SEED, *POINTS):
            got = {k: np.empty(shape, dtype) for k, (shape, dtype) in shapes.items()}
            kernel = load_source(seed_source(task, Genome(params=point)), None, None)
            calls.append((kernel, got, kernel.bind(task.kernel_args(case, {**inputs, **got}))))  # alive: bound
            calls[-1][2]()
            rtol, atol = task.tolerance(case)
            if not np.allclose(got["out"], want["out"], rtol=rtol, atol=atol):
                sys.exit(f"{label(point)}: wrong at {case}")
        seconds: list[list[float]] = [[] for _ in calls]
        for _ in range(repeats):
            for i, (_, _, run) in enumerate(calls):
                start = time.perf_counter()
                run()
                seconds[i].append(time.perf_counter() - start)
        base = statistics.median(seconds[0])
        step = "decode step" if queries == 1 else f"chunks of {queries} beside decode"
        print(f"\nkernel, {step}: 8 sequences, {cache} cache, up to {length} positions, {threads} threads")
        for point, s in zip((SEED, *POINTS), seconds, strict=True):
            m = statistics.median(s)
            print(f"  {m * 1e3:8.3f} ms  {task.work(case) / m:6.2f} GB/s  {base / m:5.2f}x  {label(point)}")


def engine_table(threads: int, rounds: int) -> None:
    from genome import Genome
    from runtime.decoder.chat_load import draw_prompts
    from runtime.decoder.engine import ChatEngine, build, engine_threads, warm_up
    from runtime.decoder.engine_task import corpus
    from runtime.decoder.kernels import seed_source
    from runtime.decoder.model import load_decoder
    from runtime.decoder.profile import profile_decoder
    from runtime.decoder.scheduler import SchedulerConfig
    from runtime.tasks.attention_decode import AttentionDecode

    model = load_decoder(gguf_model("smollm2"))
    hand = {"linear": "q8", "kv_dtype": "f16", "step_tokens": 24, "head": "topk", "threads": threads}
    engines = []
    for i, point in enumerate((SEED, *POINTS)):
        source = seed_source(AttentionDecode({"threads": threads, "cache": "f16"}), Genome(params=point))
        source = dataclasses.replace(source, id=f"point{i:07d}")
        engine = ChatEngine(**hand, kernels={"attention": source.id})
        engine_threads(engine)
        decoder = build(model, engine, kernels={"attention": source})
        warm_up(decoder)
        engines.append((engine, decoder))
    ids = model.tokenizer.encode(corpus(), add_bos=False)
    texts = draw_prompts(model.tokenizer, ids, 8, 32, 512, random.Random(0))
    prompts = [engines[0][1].encode_prompt([{"role": "user", "content": t}]) for t in texts]
    seconds: list[list[float]] = [[] for _ in engines]
    share: list[float] = [0.0] * len(engines)
    for _ in range(rounds):
        for i, (engine, decoder) in enumerate(engines):
            got = profile_decoder(decoder, prompts, 96, engine.scheduler(SchedulerConfig()))
            seconds[i].append(got.total_s)
            share[i] = got.shares().get("attention", 0.0)
    base = statistics.median(seconds[0])
    print(f"\nengine: {ChatEngine(**hand).describe()}; 8 prompts of 32-512 tokens, 96 tokens each")
    for point, s, part in zip((SEED, *POINTS), seconds, share, strict=True):
        m = statistics.median(s)
        print(f"  {m:6.2f} s  {8 * 96 / m:6.1f} tok/s  {base / m:5.3f}x  attention {part:5.1%}  {label(point)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", choices=("fp32", "f16"), default="f16")
    ap.add_argument("--length", type=int, default=640, help="cached positions of the longest sequence")
    ap.add_argument("--chunk", type=int, default=16, help="queries of a prompt's chunk")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the kernels' team, read when the first one loads

    from runtime.hardware import fingerprint

    print(fingerprint()["cpu_model"])
    kernel_table(args.cache, args.length, args.chunk, args.threads, args.repeats)
    if not args.skip_engine:
        engine_table(args.threads, args.rounds)


if __name__ == "__main__":
    main()
