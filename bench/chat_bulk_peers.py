"""The peers that have no OpenAI server here, each through its own batching: the same chat requests (prompts of
32-512 tokens, 128 output tokens each, greedy) submitted at once, the aggregate output tokens/s, side by side in
one run.

    python bench/chat_bulk_peers.py --ov-python /tmp/ovg/bin/python     # with a venv that has openvino-genai

- **ours**: the engine's scheduler in process (continuous batching, ``--engine``'s settings, as ``evo serve --gguf``
  takes them), every request submitted at once.
- **transformers** (the fp32 floor): the GGUF file loaded by transformers as an fp32 model, ``generate`` over
  batches of ``--batch`` left-padded requests, torch on ``--threads`` threads.
- **OpenVINO GenAI** (where ``--ov-python`` names an interpreter that has ``openvino_genai``; a package whose
  openvino pin would fight the peers extra's is kept in its own venv): its ``LLMPipeline`` on the GGUF file with a
  scheduler config (its continuous batching), ``generate`` over every request at once, in that interpreter.

llama.cpp's own server is the peer of ``bench/chat_vs_llama_server.py``; OpenVINO's server (OVMS) is not on PyPI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script

OV_SCRIPT = r"""
import json, sys, time
import openvino_genai as ov_genai
path, threads, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = json.load(sys.stdin)
sc = ov_genai.SchedulerConfig()
sc.max_num_seqs = len(prompts)
sc.cache_size = 2
pipe = ov_genai.LLMPipeline(path, "CPU", scheduler_config=sc, INFERENCE_NUM_THREADS=threads)
cfg = ov_genai.GenerationConfig()
cfg.max_new_tokens = cfg.min_new_tokens = max_tokens
pipe.generate(prompts[:1], cfg)  # warm up (its chat template is applied to each prompt, as for ours)
t0 = time.perf_counter()
out = pipe.generate(prompts, cfg)
elapsed = time.perf_counter() - t0
tok = pipe.get_tokenizer()
written = sum(len(tok.encode(t).input_ids.data[0]) for t in out.texts)
print(json.dumps({"seconds": elapsed, "texts": len(out.texts), "written_tokens_reencoded": written}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch", type=int, default=8, help="transformers' batch")
    ap.add_argument("--engine", default='{"linear": "q8", "kv_dtype": "f16", "step_tokens": 24, "head": "topk"}',
                    help="our engine's settings (JSON)")
    ap.add_argument("--ov-python", default=None, help="an interpreter with openvino_genai (skipped without one)")
    ap.add_argument("--no-transformers", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from runtime.decoder.chat_load import draw_prompts
    from runtime.decoder.engine import ChatEngine, build, engine_threads
    from runtime.decoder.engine_task import corpus
    from runtime.decoder.model import load_decoder
    from runtime.decoder.sampling import SamplingParams
    from runtime.decoder.scheduler import Scheduler, SchedulerConfig

    path = gguf_model(args.model)
    model = load_decoder(path)
    texts = draw_prompts(model.tokenizer, model.tokenizer.encode(corpus(), add_bos=False), args.requests,
                         *args.prompt_tokens, random.Random(0))  # fmt: skip
    results: dict[str, float] = {}

    engine = ChatEngine(**json.loads(args.engine), threads=args.threads)
    engine_threads(engine)
    decoder = build(model, engine)
    prompts = [decoder.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with Scheduler(decoder, engine.scheduler(SchedulerConfig())) as scheduler:
        scheduler.submit(prompts[0][:32], SamplingParams(max_tokens=4)).result()  # warm up
        t0 = time.perf_counter()
        gens = [scheduler.submit(p, params) for p in prompts]
        written = sum(len(g.result().token_ids) for g in gens)
        results[f"ours ({engine.describe()})"] = written / (time.perf_counter() - t0)
    print(f"  ours: {written} tokens, {results[next(iter(results))]:.1f} tok/s", flush=True)
    del decoder

    if not args.no_transformers:
        import torch
        import transformers

        torch.set_num_threads(args.threads)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               torch_dtype=torch.float32)  # fmt: skip
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]  # fmt: skip
        with torch.inference_mode():
            hf.generate(**tok(chats[:1], return_tensors="pt"), max_new_tokens=4, do_sample=False)  # warm up
            t0, written = time.perf_counter(), 0
            for i in range(0, len(chats), args.batch):
                batch = tok(chats[i : i + args.batch], return_tensors="pt", padding=True)
                out = hf.generate(**batch, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                  do_sample=False, pad_token_id=tok.pad_token_id)  # fmt: skip
                written += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
        results[f"transformers fp32 (batches of {args.batch})"] = written / (time.perf_counter() - t0)
        print(f"  transformers: {written} tokens", flush=True)
        del hf

    if args.ov_python:
        done = subprocess.run([args.ov_python, "-c", OV_SCRIPT, str(path), str(args.threads), str(args.max_tokens)],
                              input=json.dumps(texts), capture_output=True, text=True, timeout=3600)  # fmt: skip
        if done.returncode:
            print(f"  OpenVINO GenAI failed: {done.stderr[-1500:]}")
        else:
            got = json.loads(done.stdout.strip().splitlines()[-1])
            results["OpenVINO GenAI (continuous batching)"] = args.requests * args.max_tokens / got["seconds"]
            print(f"  OpenVINO GenAI: {got}", flush=True)

    print(f"{path.name}: {args.requests} requests at once, prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} "
          f"tokens, {args.max_tokens} written each, {args.threads} threads")  # fmt: skip
    ours = next(iter(results.values()))
    for name, tps in results.items():
        print(f"  {name:70s} {tps:7.1f} tok/s   ours x{ours / tps:.2f}")


if __name__ == "__main__":
    main()
