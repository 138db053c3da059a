"""The decoder against transformers, both reading the same GGUF file: logits, tokens, chat prompts, greedy text."""

from __future__ import annotations

import re

import numpy as np
import pytest

from runtime.decoder import ChatTemplateError, DecoderOps

# the tiny decoders are built once per worker: their tests share one
pytestmark = pytest.mark.xdist_group("decoder-tiny")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "  leading spaces, trailing ones  ",
    "café naïve — déjà vu; 日本語 ✓",
    "<|im_start|>user\nHello there<|im_end|>\n",
    "line one\n\nline three\ttab",
]


def _reference_logits(tiny, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return tiny.reference(torch.tensor([ids])).logits[0].numpy()


def test_logits_match_transformers(tiny, sentences):
    """Every position's logits of a 60-token text agree with transformers' to fp32 rounding."""
    ids = tiny.decoder.tokenizer.encode(" ".join(sentences[:6]))[:60]
    ours = tiny.decoder.model.forward([ids], [tiny.decoder.model.new_cache()], DecoderOps(), all_logits=True)
    ref = _reference_logits(tiny, ids)
    assert ours.shape == ref.shape == (len(ids), tiny.decoder.model.config.vocab)
    assert np.abs(ours - ref).max() < 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(tiny, text):
    """Token ids (special tokens matched whole, BOS where the file asks for it) and the decoded text."""
    tok = tiny.decoder.tokenizer
    ids = tok.encode(text)
    assert ids == tiny.reference_tokenizer(text).input_ids
    assert tok.decode(ids, skip_special=False) == tiny.reference_tokenizer.decode(ids)


def test_chat_prompt_matches_transformers(tiny):
    """The file's ChatML template as transformers renders it (Gemma's file has none: tests/.../test_gemma3.py)."""
    if tiny.decoder.model.config.architecture == "gemma3":
        pytest.skip("the tiny Gemma 3 file carries no chat template; test_gemma3 checks the built-in one")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]  # fmt: skip
    tok, ref = tiny.decoder.tokenizer, tiny.reference_tokenizer
    text = tok.render_chat(messages)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert tok.encode_chat(messages) == list(expected["input_ids"])
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("Another?<|im_end|>\n")


def test_chat_template_raise_exception_is_one_line_error(llama):
    with pytest.raises(ChatTemplateError, match="unknown role tool") as info:
        llama.decoder.tokenizer.render_chat([{"role": "tool", "content": "42"}])
    assert "\n" not in str(info.value)


def test_greedy_text_matches_transformers_generate(tiny, sentences):
    """Greedy continuations of three prompts are transformers' ``generate(do_sample=False)`` token for token."""
    import torch

    for prompt in (sentences[0], sentences[4], " ".join(sentences[2:5])):
        done = tiny.decoder.generate(prompt, max_tokens=24)
        ids = tiny.decoder.tokenizer.encode(prompt)
        with torch.no_grad():
            out = tiny.reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          do_sample=False, max_new_tokens=24, pad_token_id=0)  # fmt: skip
        ref = out[0, len(ids) :].tolist()
        eos = tiny.decoder.tokenizer.eos_id
        if eos in ref:  # transformers keeps the end token; the completion leaves it out
            ref = ref[: ref.index(eos)]
            assert done.finish_reason == "stop"
        else:
            assert done.finish_reason == "length"
        assert done.token_ids == ref
        assert done.prompt_tokens == len(ids)
        assert done.text == _reference_text(tiny, ref)


def _reference_text(tiny, ids: list[int]) -> str:
    """transformers' text of ``ids``; for a SentencePiece vocabulary, its tokens' bytes joined and then read as
    UTF-8, as llama.cpp reads them (transformers' byte fallback makes a whole run of byte tokens U+FFFD where one
    byte of it is invalid, so streamed text could change after it was sent)."""
    ref = tiny.reference_tokenizer
    if tiny.decoder.model.config.architecture != "gemma3":
        return ref.decode(ids, skip_special_tokens=True)
    ids = [i for i in ids if i not in ref.all_special_ids]
    pieces = [bytes([int(t[3:5], 16)]) if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else t.replace("\u2581", " ").encode()
              for t in ref.convert_ids_to_tokens(ids)]  # fmt: skip
    return b"".join(pieces).decode("utf-8", errors="replace")
