"""Structured output: JSON schemas compiled over a real tokenizer and enforced while sampling; schemas a request
could use to take the server's memory or time are refused, once, without harm to the caller's process."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from gguf_models import smollm2_file, write_random_gguf

from runtime.decoder import Decoder, SamplingParams
from runtime.decoder.grammar import GrammarError, json_schema_grammar

pytest.importorskip("outlines_core")
pytestmark = pytest.mark.xdist_group("decoder-tiny")

POINT = {"type": "object", "additionalProperties": False, "required": ["order", "unroll", "pack"],
         "properties": {"order": {"enum": ["JPI", "PJI"]}, "unroll": {"enum": [1, 2, 4, 8]},
                        "pack": {"type": "boolean"}}}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, vocabulary) -> Decoder:
    return Decoder.load(write_random_gguf(tmp_path_factory.mktemp("grammar") / "tiny.gguf", vocabulary))


def test_every_sampled_answer_of_a_random_model_is_json_of_the_schema(tiny: Decoder) -> None:
    grammar = json_schema_grammar(tiny.tokenizer, POINT)
    assert json_schema_grammar(tiny.tokenizer, POINT) is grammar  # compiled once
    prompts = ["the quick brown fox", "jumps over", "a lazy dog " * 5]
    for seed in range(6):
        for done in tiny.generate_batch(prompts, SamplingParams(max_tokens=80, temperature=1.5, seed=seed,
                                                                grammar=grammar)):  # fmt: skip
            answer = json.loads(done.text)
            assert list(answer) == ["order", "unroll", "pack"] and done.finish_reason == "stop"
            assert answer["order"] in ("JPI", "PJI") and answer["unroll"] in (1, 2, 4, 8)
            assert isinstance(answer["pack"], bool)


def test_the_mask_leaves_only_what_may_come_next(tiny: Decoder) -> None:
    state = json_schema_grammar(tiny.tokenizer, POINT).start()
    logits = np.zeros(tiny.model.config.vocab, np.float32)
    state.mask(logits)
    allowed = np.flatnonzero(np.isfinite(logits))
    assert allowed.size and all(tiny.tokenizer.token_bytes(int(i)).startswith(b"{") for i in allowed)
    assert not set(allowed.tolist()) & (tiny.tokenizer.special | tiny.tokenizer.end_ids)


def test_smollm2_answers_a_matmul_point_held_to_its_space() -> None:
    from runtime.tasks.matmul import Matmul

    decoder = Decoder.load(smollm2_file())
    space = Matmul({"m": 64, "n": 64, "k": 64}).space()
    grammar = json_schema_grammar(decoder.tokenizer, space.json_schema())
    messages = [{"role": "user", "content": "Give new values for the matmul kernel's parameters as JSON."}]
    done = decoder.generate(messages, SamplingParams(max_tokens=120, grammar=grammar))
    point = json.loads(done.text)
    assert list(point) == list(space.params) and all(space.params[k].contains(v) for k, v in point.items())


@pytest.mark.parametrize(("schema", "says"), [
    ({"$ref": "#/nowhere"}, "cannot be enforced"),
    ({"$ref": "#"}, "cannot be enforced"),
    ({"type": "string", "minLength": 10**8}, "minLength is 100000000"),
    ({"type": "array", "items": {"type": "array", "maxItems": 10**5}}, "maxItems is 100000"),
    ({"enum": ["x" * 20000]}, "characters"),
])  # fmt: skip
def test_schemas_that_cannot_be_enforced_say_why(tiny: Decoder, schema, says) -> None:
    with pytest.raises(GrammarError, match=says):
        json_schema_grammar(tiny.tokenizer, schema)


def test_a_schema_that_compiles_too_long_is_refused_once_and_the_caller_lives_on(tiny: Decoder, monkeypatch) -> None:
    """Its compile is a process of its own, killed at the limit; asked again, the refusal is remembered."""
    from runtime.decoder import grammar as module

    monkeypatch.setattr(module, "COMPILE_TIMEOUT_S", 1.0)
    heavy = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4000} for i in range(6)}}
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within"):
        json_schema_grammar(tiny.tokenizer, heavy)
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within"):
        json_schema_grammar(tiny.tokenizer, heavy)
    assert time.monotonic() - t0 < 0.5
    assert json.loads(tiny.generate("fox", SamplingParams(max_tokens=80, grammar=json_schema_grammar(
        tiny.tokenizer, POINT))).text)["order"] in ("JPI", "PJI")  # fmt: skip


def test_a_grammar_refuses_ignore_eos() -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, grammar=object())  # type: ignore[arg-type]


