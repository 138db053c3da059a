"""The decoder in fp32 against transformers in fp32, both reading the same GGUF file: the correctness reference.

    python bench/decoder_vs_transformers.py                    # SmolLM2-135M-Instruct
    python bench/decoder_vs_transformers.py --model gemma3     # Gemma 3 270M
    python bench/decoder_vs_transformers.py --model m.gguf --texts 40 --greedy 64

Teacher-forced on held-out texts (``tests/data/sentences.txt``, then the README's paragraphs), both score every
position (:mod:`runtime.decoder.fidelity`): top-1 agreement, mean and largest KL divergence, and the largest
logit difference over the largest logit. Then greedy continuations of chat prompts, token for token, and whether
the two tokenizers give the same ids for every text. An fp32 engine should agree to fp32 rounding: top-1 1.0, KL
near 1e-9, identical continuations.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from _models import gguf_model  # beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHATS = ["What is the capital of France?", "Write one sentence about the sea.", "List three prime numbers."]


def held_out_texts(count: int) -> list[str]:
    lines = [s for s in (ROOT / "tests" / "data" / "sentences.txt").read_text().splitlines() if s.strip()]
    paragraphs = [p.strip() for p in (ROOT / "README.md").read_text().split("\n\n") if len(p.strip()) > 200]
    return (lines + paragraphs)[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--texts", type=int, default=60, help="held-out texts to score (default 60)")
    ap.add_argument("--greedy", type=int, default=32, help="tokens of each greedy continuation (default 32)")
    args = ap.parse_args()
    path = gguf_model(args.model)

    import torch
    import transformers

    from runtime.decoder import Decoder, DecoderOps
    from runtime.decoder.fidelity import fidelity, forced_logits

    torch.set_num_threads(max(1, torch.get_num_threads()))
    started = time.perf_counter()
    ours = Decoder.load(path)
    print(f"ours: loaded {path.name} in {time.perf_counter() - started:.1f} s: {ours.model.config.architecture}, "
          f"{ours.model.config.layers} layers, vocab {ours.model.config.vocab}", flush=True)  # fmt: skip
    started = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"transformers {transformers.__version__}: loaded in {time.perf_counter() - started:.1f} s", flush=True)

    def reference_logits(ids):
        with torch.no_grad():
            return reference(torch.tensor([list(ids)])).logits[0].float().numpy()

    texts = held_out_texts(args.texts)
    same_ids = sum(ours.tokenizer.encode(t) == tokenizer(t).input_ids for t in texts)
    print(f"tokenizer: the same ids for {same_ids} of {len(texts)} texts")
    model, mine = ours.model, forced_logits(ours.model, DecoderOps())
    worst = max(float(np.abs(mine(ids) - (r := reference_logits(ids))).max() / np.abs(r).max())
                for ids in (model.tokenizer.encode(t) for t in texts[:10]))  # fmt: skip
    score = fidelity(model, reference_logits, mine, texts)
    print(f"teacher-forced, ours fp32 against transformers fp32: {score}; largest logit difference "
          f"{worst:.2e} of the largest logit (first 10 texts)")  # fmt: skip
    identical = 0
    for chat in CHATS:
        messages = [{"role": "user", "content": chat}]
        done = ours.generate(messages, max_tokens=args.greedy, ignore_eos=True)
        ids = ours.tokenizer.encode_chat(messages)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=args.greedy, min_new_tokens=args.greedy,
                                     pad_token_id=0)  # fmt: skip
        ref = out[0, len(ids) :].tolist()
        identical += done.token_ids == ref
        print(f"  {chat!r}: {'identical' if done.token_ids == ref else 'DIFFERENT'}: {done.text[:70]!r}")
    print(f"greedy: {identical} of {len(CHATS)} continuations of {args.greedy} tokens identical")


if __name__ == "__main__":
    main()
