"""The decoder's own behaviour: the KV cache, sequences batched at different positions, the context length,
and that it never imports torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from runtime.decoder import ContextFull, DecoderOps, SamplingParams

# the tiny decoders are built once per worker: their tests share one
pytestmark = pytest.mark.xdist_group("decoder-tiny")


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.abs(a - b).max() < 1e-4 * np.abs(b).max())


def test_prefill_then_decode_equals_full_recompute(llama, sentences):
    """Logits of a 5-token prefill followed by single-token steps (through a cache that starts too small and
    grows) equal those of one pass over the whole sequence."""
    model, ops = llama.decoder.model, DecoderOps()
    ids = llama.decoder.tokenizer.encode(" ".join(sentences[:3]))[:40]
    full = model.forward([ids], [model.new_cache()], ops, all_logits=True)
    cache = model.new_cache(capacity=4)
    steps = [model.forward([ids[:5]], [cache], ops, all_logits=True)]
    steps += [model.forward([[t]], [cache], ops) for t in ids[5:]]
    assert cache.length == len(ids) and cache.capacity >= len(ids)
    assert _close(np.concatenate(steps), full)


def test_batched_forward_at_different_positions_equals_each_alone(llama, sentences):
    """One pass over three sequences (one fresh, two with 7 and 19 tokens cached; 1, 6 and 11 new tokens)
    gives each sequence the logits it gets alone."""
    model, ops = llama.decoder.model, DecoderOps()
    seqs = [llama.decoder.tokenizer.encode(s) for s in (sentences[0], sentences[2], sentences[3])]
    cached, new = [0, 7, 19], [1, 6, 11]
    alone, caches = [], []
    for ids, c, n in zip(seqs, cached, new, strict=True):
        cache = model.new_cache()
        if c:
            model.forward([ids[:c]], [cache], ops)
        caches.append(cache)
        solo = model.new_cache()
        alone.append(model.forward([ids[: c + n]], [solo], ops, all_logits=True)[c:])
    together = model.forward([ids[c : c + n] for ids, c, n in zip(seqs, cached, new, strict=True)], caches, ops,
                             all_logits=True)  # fmt: skip
    assert _close(together, np.concatenate(alone))
    assert [c.length for c in caches] == [c + n for c, n in zip(cached, new, strict=True)]


def test_batch_generation_gives_each_sequence_its_tokens_alone(llama, sentences):
    """Prompts of different lengths, greedy and seeded sampling mixed, generated together and alone."""
    dec = llama.decoder
    prompts = [sentences[0], " ".join(sentences[2:6]), [{"role": "user", "content": sentences[4]}]]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.2, top_k=20, seed=4, ignore_eos=True)]  # fmt: skip
    together = dec.generate_batch(prompts, params)
    assert together == [dec.generate(p, q) for p, q in zip(prompts, params, strict=True)]
    assert len({len(dec.encode_prompt(p)) for p in prompts}) == 3
    assert [c.finish_reason for c in together] == ["length"] * 3
    assert [len(c.token_ids) for c in together] == [12, 20, 16]


def test_context_length_bounds_the_prompt_and_the_generation(llama):
    dec = llama.decoder
    context = dec.model.config.context
    assert dec.tokenizer.encode(" the" * 3, add_bos=False) == [dec.tokenizer.encode(" the", add_bos=False)[0]] * 3
    with pytest.raises(ContextFull, match=f"context of {context}"):
        dec.generate(" the" * (context - 1))  # with the BOS this tiny model adds, exactly the context
    done = dec.generate(" the" * (context - 6), max_tokens=50)
    assert done.prompt_tokens == context - 5
    assert done.finish_reason == "length" and len(done.token_ids) == 5


def test_forward_rejects_token_ids_outside_the_vocabulary(llama):
    model = llama.decoder.model
    with pytest.raises(ValueError, match="token ids must lie in"):
        model.forward([[model.config.vocab]], [model.new_cache()], DecoderOps())


def test_runs_without_torch(llama):
    """Loading and generating import neither torch nor transformers (a fresh interpreter)."""
    code = ("import sys; from runtime.decoder import Decoder; "
            f"print(Decoder.load({str(llama.path)!r}).generate('The fox', max_tokens=3).token_ids); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    ids, loaded = out.stdout.strip().splitlines()
    assert loaded == "[]"
    assert ids == str(llama.decoder.generate("The fox", max_tokens=3).token_ids)
