"""Sampling: each of its steps on known logits, seeds, stop strings and the finish reasons."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.decoder import SamplingParams, sample

# the tiny decoders are built once per worker: their tests share one
pytestmark = pytest.mark.xdist_group("decoder-tiny")

LOGITS = np.log(np.array([0.05, 0.5, 0.15, 0.3], np.float32))  # probabilities 0.5, 0.3, 0.15, 0.05: ids 1, 3, 2, 0


def _draws(params: SamplingParams, n: int = 10000, logits: np.ndarray = LOGITS) -> np.ndarray:
    rng = params.rng()
    return np.bincount([sample(logits, params, rng) for _ in range(n)], minlength=len(logits)) / n


def test_greedy_is_the_argmax():
    assert sample(LOGITS, SamplingParams(), np.random.default_rng(0)) == 1
    assert sample(LOGITS, SamplingParams(temperature=5.0, top_k=1, seed=0), np.random.default_rng(0)) == 1


def test_temperature_one_draws_from_the_softmax():
    freq = _draws(SamplingParams(temperature=1.0, seed=0))
    assert np.abs(freq - np.exp(LOGITS)).max() < 0.015


def test_temperature_sharpens_and_flattens():
    assert _draws(SamplingParams(temperature=0.25, seed=0))[1] > 0.85  # 0.5^4 / sum(p^4) = 0.86
    assert np.abs(_draws(SamplingParams(temperature=100.0, seed=0)) - 0.25).max() < 0.02


def test_top_k_keeps_the_k_likeliest():
    freq = _draws(SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert freq[0] == freq[2] == 0
    assert abs(freq[1] - 0.5 / 0.8) < 0.015


def test_top_p_keeps_the_smallest_head_reaching_p():
    freq = _draws(SamplingParams(temperature=1.0, top_p=0.7, seed=2))  # 0.5 + 0.3 reach 0.7
    assert freq[0] == freq[2] == 0 and abs(freq[3] - 0.3 / 0.8) < 0.015
    assert _draws(SamplingParams(temperature=1.0, top_p=0.4, seed=2))[1] == 1.0  # the likeliest alone reaches it


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1), ("top_p", 0.0),
     ("top_p", 1.5), ("stop", ("",))],
)  # fmt: skip
def test_invalid_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=field if field != "stop" else "empty stop string"):
        SamplingParams(**{field: value})


def test_seed_repeats_a_generation_and_another_seed_does_not(llama):
    dec = llama.decoder
    params = dict(max_tokens=32, temperature=1.0)
    first = dec.generate("The quick brown", seed=7, **params)
    assert dec.generate("The quick brown", seed=7, **params) == first
    assert dec.generate("The quick brown", seed=8, **params).token_ids != first.token_ids


def test_stop_string_ends_the_text_before_it(llama):
    dec = llama.decoder
    full = dec.generate("What is the", max_tokens=40)
    assert full.finish_reason == "length" and len(full.token_ids) == 40
    stop = full.text[len(full.text) // 2 :][:3]
    done = dec.generate("What is the", max_tokens=40, stop=[stop, "\x00never"])
    assert done.finish_reason == "stop"
    assert done.text == full.text[: full.text.index(stop)]
    assert done.token_ids == full.token_ids[: len(done.token_ids)] and len(done.token_ids) < 40


def test_ignore_eos_never_samples_an_end_token(llama):
    """The model's greedy fifth token made an end token: a generation stops there, unless it ignores ends; then
    it runs to max_tokens and samples that token nowhere (alone and through the scheduler)."""
    import copy
    import dataclasses

    from runtime.decoder import Decoder, Scheduler

    full = llama.decoder.generate("What is the", max_tokens=40)
    end = full.token_ids[4]
    tokenizer = copy.copy(llama.decoder.tokenizer)
    tokenizer.end_ids = frozenset({*tokenizer.end_ids, end})
    dec = Decoder(dataclasses.replace(llama.decoder.model, tokenizer=tokenizer), ops=llama.decoder.ops)
    ended = dec.generate("What is the", max_tokens=40)
    assert ended.finish_reason == "stop" and ended.token_ids == full.token_ids[:4]
    ignoring = dec.generate("What is the", max_tokens=40, ignore_eos=True)
    assert ignoring.finish_reason == "length" and len(ignoring.token_ids) == 40 and end not in ignoring.token_ids
    assert ignoring.token_ids[:4] == full.token_ids[:4]
    with Scheduler(dec) as scheduler:
        ids = dec.encode_prompt("What is the")
        assert scheduler.submit(ids, SamplingParams(max_tokens=40)).result().token_ids == ended.token_ids
        served = scheduler.submit(ids, SamplingParams(max_tokens=40, ignore_eos=True)).result()
    assert served.token_ids == ignoring.token_ids and served.finish_reason == "length"


TOP_CASES = {
    "greedy": SamplingParams(),
    "greedy without end tokens": SamplingParams(ignore_eos=True),
    "top-k": SamplingParams(temperature=0.9, top_k=20, seed=1),
    "top-k and top-p": SamplingParams(temperature=1.3, top_k=40, top_p=0.7, seed=2),
    "top-k without end tokens": SamplingParams(temperature=1.0, top_k=10, ignore_eos=True, seed=3),
    "greedy with logprobs": SamplingParams(logprobs=20),
}


@pytest.mark.parametrize("case", list(TOP_CASES))
def test_the_top_list_chooses_what_the_full_logits_do(case: str) -> None:
    """Where :func:`top_suffices` holds, a row's 64 likeliest tokens and its log-sum-exp give the very token and
    log-probabilities the full logits do, draw after draw of one seeded generator (equal logits included)."""
    from runtime.decoder.ops import top_of
    from runtime.decoder.sampling import sample_top, token_logprobs, top_logprobs, top_suffices

    params, ends = TOP_CASES[case], frozenset({3, 7})
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((40, 500)).astype(np.float32) * 3
    logits[:, 7] = logits.max(axis=1) + 1  # an end token is the likeliest
    logits[:, 11] = logits[:, 12] = np.sort(logits, axis=1)[:, -5]  # two equal logits inside every top list
    listed = top_of(logits, 64)
    assert top_suffices(params, 64, ends)
    full_rng, top_rng = np.random.default_rng(9), np.random.default_rng(9)
    for i, row in enumerate(logits):
        ids, values, lse = listed.row(i)
        token = sample(row.copy(), params, full_rng, ends)
        assert sample_top(ids, values, params, top_rng, ends) == token
        if params.logprobs:
            (lp, best), (tlp, tbest) = token_logprobs(row, token, 20), top_logprobs(ids, values, lse, token, 20)
            assert abs(lp - tlp) < 1e-5 and [t for t, _ in best] == [t for t, _ in tbest]
            assert np.allclose([p for _, p in best], [p for _, p in tbest], atol=1e-5)


def test_the_top_list_suffices_only_where_it_decides_the_token() -> None:
    from runtime.decoder.grammar import Grammar
    from runtime.decoder.sampling import top_suffices

    ends = frozenset({1, 2})
    assert top_suffices(SamplingParams(logprobs=20), 64, ends)
    assert not top_suffices(SamplingParams(logprobs=20), 16, ends)  # more log-probabilities than it keeps
    assert not top_suffices(SamplingParams(temperature=0.7), 64)  # every token may be drawn
    assert not top_suffices(SamplingParams(temperature=0.7, top_p=0.9), 64)
    assert not top_suffices(SamplingParams(temperature=0.7, top_k=63, ignore_eos=True), 64, ends)  # no room for ends
    assert top_suffices(SamplingParams(temperature=0.7, top_k=62, ignore_eos=True), 64, ends)
    grammar = Grammar.__new__(Grammar)  # any grammar: its mask may rule out every listed token
    assert not top_suffices(SamplingParams(grammar=grammar), 64)
