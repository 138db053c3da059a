"""Where a chat engine's time goes under generative load (:mod:`runtime.decoder.profile`): every slot (each weight
GEMM by matrix, attention, RMSNorm, RoPE, the activation, the LM head), the forward pass's own rest, and sampling
with the scheduler, for ``--streams`` requests of prompts drawn between ``--prompt-tokens`` served at once.

    python bench/decoder_profile.py                                  # SmolLM2-135M, the default engine
    python bench/decoder_profile.py --model gemma3 --linear q8 --kv-dtype f16 --step-tokens 32
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--linear", default=None, help="the GEMMs (numpy or a C precision mix; default: the engine's)")
    ap.add_argument("--kv-dtype", choices=("fp32", "f16"), default="fp32")
    ap.add_argument("--step-tokens", type=int, default=64)
    ap.add_argument("--head", choices=("full", "topk"), default="full", help="the LM head: full logits or the top list")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8, help="requests served together")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[32, 512], metavar=("LOW", "HIGH"))
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request writes")
    args = ap.parse_args()

    from runtime.decoder.chat_load import draw_prompts
    from runtime.decoder.engine import ChatEngine, build, engine_threads
    from runtime.decoder.engine_task import corpus
    from runtime.decoder.model import load_decoder
    from runtime.decoder.profile import profile_decoder
    from runtime.decoder.scheduler import SchedulerConfig
    from runtime.hardware import fingerprint

    model = load_decoder(gguf_model(args.model))
    chosen = {} if args.linear is None else {"linear": args.linear}
    engine = ChatEngine(**chosen, kv_dtype=args.kv_dtype, step_tokens=args.step_tokens, head=args.head,
                        threads=args.threads)  # fmt: skip
    engine_threads(engine)
    decoder = build(model, engine)
    ids = model.tokenizer.encode(corpus(), add_bos=False)
    texts = draw_prompts(model.tokenizer, ids, args.streams, *args.prompt_tokens, random.Random(0))
    prompts = [decoder.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    config = engine.scheduler(SchedulerConfig())
    profile_decoder(decoder, prompts[:1], 4, config)  # first calls: lazy binding, packed weights
    got = profile_decoder(decoder, prompts, args.max_tokens, config)
    print(f"{fingerprint()['cpu_model']}; {model.path.name}; {engine.describe()}")
    print(f"{got.requests} requests, {got.prompt_tokens} prompt tokens, {got.output_tokens} written in {got.steps} "
          f"steps, {got.total_s:.2f} s ({got.output_tokens / got.total_s:.1f} tok/s)")
    for part, seconds, share in got.table():
        print(f"  {part:<24} {seconds:8.3f} s {share:7.1%}")


if __name__ == "__main__":
    main()
