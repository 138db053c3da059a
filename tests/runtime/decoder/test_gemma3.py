"""Gemma 3's own parts: its sliding window (a window the decoder ignored would change these logits), its chat turns
where the file has no template, the turn's end token, and the C decode attention over the window."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_models import GEMMA3_WINDOW

from runtime.decoder import DecoderOps
from runtime.decoder.ops import np_attention, sdpa

pytestmark = pytest.mark.xdist_group("decoder-tiny")


@pytest.fixture
def gemma(tiny_models):
    return tiny_models("gemma3-f32")


def _long_ids(gemma, sentences, n: int = 3 * GEMMA3_WINDOW) -> list[int]:
    ids = gemma.decoder.tokenizer.encode(" ".join(sentences[:20]))[:n]
    assert len(ids) == n
    return ids


def test_the_window_and_the_global_layer_come_from_the_file(gemma):
    cfg = gemma.decoder.model.config
    assert cfg.sliding_window == GEMMA3_WINDOW
    assert cfg.local_layers == (True,) * 5 + (False,)
    assert cfg.activation == "gelu_tanh" and cfg.embed_scale == pytest.approx(8.0)
    assert gemma.decoder.model.local_inv_freq is not None


def test_decoding_past_the_window_matches_transformers(gemma, sentences):
    """Prefill, then one token at a time, three windows long: every step's logits are transformers'."""
    import torch

    model, ids = gemma.decoder.model, _long_ids(gemma, sentences)
    cache = model.new_cache()
    got = [model.forward([ids[:5]], [cache], DecoderOps(), all_logits=True)]
    got += [model.forward([[t]], [cache], DecoderOps()) for t in ids[5:]]
    with torch.no_grad():
        ref = gemma.reference(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(np.concatenate(got) - ref).max() < 1e-4 * np.abs(ref).max()


def test_ignoring_the_window_changes_the_logits(gemma, sentences):
    """The check above can fail: with windows wider than the text, the logits past the window change."""
    from dataclasses import replace

    model, ids = gemma.decoder.model, _long_ids(gemma, sentences)
    windowed = model.forward([ids], [model.new_cache()], DecoderOps(), all_logits=True)
    original = model.config
    model.config = replace(original, sliding_window=10**6)
    try:
        full = model.forward([ids], [model.new_cache()], DecoderOps(), all_logits=True)
    finally:
        model.config = original
    assert np.abs(full[:GEMMA3_WINDOW] - windowed[:GEMMA3_WINDOW]).max() < 1e-5  # the same within the window
    assert np.abs(full[GEMMA3_WINDOW:] - windowed[GEMMA3_WINDOW:]).max() > 1e-2


def test_a_windowed_prompt_chunk_sees_only_its_window():
    """Numpy's attention with a window equals attention over each query's own window."""
    rng = np.random.default_rng(0)
    t, start, window, d = 7, 9, 4, 8
    q = rng.standard_normal((t, 4, d), dtype=np.float32)
    k, v = (rng.standard_normal((2, start + t, d), dtype=np.float32) for _ in range(2))
    got = sdpa(q, k, v, start, window)
    for i in range(t):
        p = start + i
        alone = sdpa(q[i : i + 1], k[:, p - window + 1 : p + 1], v[:, p - window + 1 : p + 1], window - 1)
        np.testing.assert_allclose(got[i], alone[0], rtol=1e-5, atol=1e-6)


def test_c_attention_slides_its_window_as_numpy_does(gemma, sentences, kernel_cache):
    """A decode step and a prompt's chunk, over caches longer than the window: C and numpy see the same keys."""
    from runtime.decoder.kernels import c_attention

    model, ids = gemma.decoder.model, _long_ids(gemma, sentences)
    caches = [model.new_cache(), model.new_cache()]
    model.forward([ids, ids[: GEMMA3_WINDOW + 3]], caches, DecoderOps())
    counts = [1, 9]  # the second sequence's last 9 positions: a chunk whose first queries' windows start apart
    q = np.random.default_rng(1).standard_normal((10, model.config.heads, model.config.head_dim), dtype=np.float32)
    lengths = [c.length for c in caches]
    attention = c_attention(cache_dir=kernel_cache)
    for window in (0, GEMMA3_WINDOW):
        want = np_attention(q, caches, 0, lengths, counts, window)
        np.testing.assert_allclose(attention(q, caches, 0, lengths, counts, window), want, rtol=1e-4, atol=1e-5)
    assert np.abs(np_attention(q, caches, 0, lengths, counts, 0) - want).max() > 1e-3


def test_a_gemma_file_without_a_template_chats_in_gemma_turns(gemma):
    tok = gemma.decoder.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour. "},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]  # fmt: skip
    text = tok.render_chat(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n"
                    "<start_of_turn>model\nBlue.<end_of_turn>\n<start_of_turn>user\nAnother?<end_of_turn>\n"
                    "<start_of_turn>model\n")  # fmt: skip
    assert tok.encode_chat(messages) == gemma.reference_tokenizer(text, add_special_tokens=False).input_ids
    end_of_turn = tok.encode("<end_of_turn>", add_bos=False)
    assert len(end_of_turn) == 1 and end_of_turn[0] in tok.end_ids and tok.eos_id in tok.end_ids


def test_byte_tokens_decode_as_bytes_so_streamed_text_never_changes(gemma):
    """"44" then an invalid byte is "44" and one U+FFFD: text already streamed stays as it was."""
    tok = gemma.decoder.tokenizer
    four, bad = tok.encode("<0x34>", add_bos=False), [t for t in range(tok.vocab_size) if tok.token(t) == "<0xCA>"]
    assert len(bad) == 1
    byte_four = [t for t in range(tok.vocab_size) if tok.token(t) == "<0x34>"]
    ids = byte_four * 2 + bad
    assert tok.decode(ids[:2]) == "44" and tok.decode(ids) == "44\ufffd"
    assert four != byte_four  # the text "<0x34>" is its characters, not the byte
    assert tok.decode([*byte_four, tok.vocab_size + 5]) == "4"  # an id past the vocabulary has no text
