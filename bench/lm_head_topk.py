"""The LM head alone at a decode step: full logits on the linear slot's kernels (fp32, q8) against the top list
(``lm_head_topk``: q8, each row's 64 likeliest tokens and log-sum-exp, no logits written) on its AVX2 and VNNI
seeds, side by side in one run; then what the sampler spends on each row of a step that asks for 20
log-probabilities a token (greedy, end tokens dropped): from the full logits, and from the top list.

    python bench/lm_head_topk.py --model gemma3 --threads 2      # Gemma 3 270M's 262,144 x 640 head
    python bench/lm_head_topk.py --model smollm2 --rows 8 16

Each contestant runs ``--calls`` calls on the same rows (``--rows`` of them: a decode step's sequences), in turn,
each round; the median of every call of every round is reported, with its ratio to the fp32 head's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import timeit
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script


def sampler_seconds(logits: np.ndarray, listed: Any, ends: frozenset[int], repeat: int) -> dict[str, float]:
    """The median seconds the sampler spends on every row of ``logits`` (greedy, end tokens dropped, 20
    log-probabilities), from the full logits and from their top list ``listed``."""
    from runtime.decoder.sampling import SamplingParams, sample, sample_top, token_logprobs, top_logprobs

    params, rng = SamplingParams(logprobs=20, ignore_eos=True), np.random.default_rng(0)

    def full() -> None:
        for row in logits:
            token_logprobs(row, sample(row.copy(), params, rng, ends), 20)

    def top() -> None:
        for i in range(len(logits)):
            ids, values, lse = listed.row(i)
            top_logprobs(ids, values, lse, sample_top(ids, values, params, rng, ends), 20)

    return {"full logits": median(timeit.repeat(full, number=1, repeat=repeat)),
            "top list": median(timeit.repeat(top, number=1, repeat=repeat))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads of the kernels")
    ap.add_argument("--rows", type=int, nargs="+", default=[8], help="rows a call runs (decode steps' sequences)")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, "blas")
    from runtime.decoder import load_decoder
    from runtime.decoder.kernels import TOP, c_lm_head_topk, decoder_ops, seed_source
    from runtime.decoder.ops import top_of
    from runtime.hardware import cpu_flags
    from runtime.task import load_task_class

    model = load_decoder(gguf_model(args.model))
    head = model.lm_head
    runs = {"full, fp32 kernel": decoder_ops(model, "fp32", threads=args.threads).lm_head,
            "full, q8 kernel": decoder_ops(model, "q8", threads=args.threads).lm_head}  # fmt: skip
    for name in ("lm_head_topk", "lm_head_topk_vnni"):
        task = load_task_class(name)({"threads": args.threads})
        if task.slot.missing(cpu_flags()):  # type: ignore[attr-defined]
            print(f"  {name}: skipped (this CPU has no {', '.join(task.slot.missing(cpu_flags()))})")  # type: ignore[attr-defined]
            continue
        topk = c_lm_head_topk(head, source=seed_source(task), threads=args.threads)
        runs[f"top list, {name} seed"] = lambda x, w, f=topk: f(x, w, TOP)
    rng = np.random.default_rng(0)
    print(f"{model.path.name}: head {head.shape[0]} x {head.shape[1]}, {args.threads} threads, median of "
          f"{args.rounds} x {args.calls} calls")  # fmt: skip
    for m in args.rows:
        x = rng.standard_normal((m, head.shape[1])).astype(np.float32)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                fn(x, head)
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    fn(x, head)
                    times[name].append(time.perf_counter() - t0)
        base = median(times["full, fp32 kernel"])
        for name, t in times.items():
            print(f"  {m:3d} rows  {name:32s} {median(t) * 1e3:7.2f} ms   {base / median(t):5.2f}x the fp32 head")
        full = runs["full, fp32 kernel"](x, head)
        spent = sampler_seconds(full, top_of(full, TOP), model.tokenizer.end_ids, args.rounds * args.calls)
        print(f"  {m:3d} rows  the sampler with 20 log-probabilities: {spent['full logits'] * 1e3:.2f} ms from the "
              f"full logits, {spent['top list'] * 1e3:.2f} ms from the top list")


if __name__ == "__main__":
    main()
