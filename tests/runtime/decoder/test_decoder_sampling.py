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
