"""LLM operators against a real HTTP server with scripted answers: every answer ends as a recorded outcome."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from llm_testlib import (
    FAST_LOOP,
    KEY_ENV,
    NAIVE,
    NAIVE_LOOP,
    SECRET,
    FakeLLM,
    NaiveMatmul,
    Reply,
    diff_answer,
    rewrite_answer,
    user_prompt,
)

from archive import AddStatus, Candidate, Store
from evo.llm.cache import ResponseCache
from evo.llm.client import LLMClient, LLMUnavailable
from evo.llm.operators import LLMDiff, LLMParams, LLMRewrite
from evo.llm.prompt import PromptBook
from evo.llm.session import LLMSession
from evo.llm.settings import LLMSettings, ModelSettings, PromptSettings
from evo.operators import ProposalContext
from runtime import Status

TASK = NaiveMatmul({"m": 64, "n": 64, "k": 64})


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


def parent(source: str | None = NAIVE, params: dict | None = None, **kw) -> Candidate:
    return Candidate(id=kw.pop("id", "a" * 64), seq=1, parents=(), operator="seed", params=params or {},
                     source=source, status=kw.pop("status", Status.OK), fitness=kw.pop("fitness", 1.5),
                     unit="GFLOP/s", metrics={"vs_reference": 0.05}, **kw)


def session(url: str, *, timeout: float = 5.0, **kw) -> LLMSession:
    model = ModelSettings(base_url=url, model="scripted", api_key_env=KEY_ENV, timeout=timeout)
    return LLMSession(LLMSettings(models=[model], **kw), cache=ResponseCache())


def ctx(p: Candidate, seed: int = 0) -> ProposalContext:
    return ProposalContext(space=TASK.space(), rng=np.random.default_rng(seed), task=TASK, parents=[p])


def run_op(cls, url: str, p: Candidate, tmp_path, **kw):
    op = cls(session(url, **kw), PromptBook(PromptSettings()), hardware={"cpu_model": "test cpu"})
    proposal = op.propose(ctx(p))
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = Store(tmp_path / "a.db")
    cid = None
    if proposal.genome is not None:
        store.add_pending(genome=proposal.genome, parents=[p.id], operator=op.name)
        cid = proposal.genome.id
    proposal.on_commit(store, cid)
    return proposal, store.llm_calls()


def test_a_valid_diff_applies_inside_the_evolve_block(tmp_path):
    with FakeLLM([Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP))]) as fake:
        proposal, calls = run_op(LLMDiff, fake.url, parent(), tmp_path)
    assert proposal.genome is not None and FAST_LOOP in proposal.genome.source
    assert proposal.genome.source.startswith(NAIVE.split("/* EVOLVE-BLOCK-START */")[0])
    assert [c["outcome"] for c in calls] == ["applied"] and calls[0]["candidate_id"] == proposal.genome.id
    assert calls[0]["tokens_in"] > 0 and calls[0]["tokens_out"] == 50 and calls[0]["model"] == "scripted"
    assert fake.auth == [f"Bearer {SECRET}"]  # read from the named variable at call time
    prompt = user_prompt(fake.requests[0])
    for part in ("void kernel(int M", "vs_reference 0.050x", "test cpu", '{"edits": [{"from"', NAIVE_LOOP):
        assert part in prompt  # the endpoint is sent the edits' schema (structured_output auto): JSON is asked for


def _json_edits(*edits: tuple[str, str, str]) -> str:
    return json.dumps({"edits": [{"from": a, "to": b, "replace": r} for a, b, r in edits]})


def test_diffs_as_json_line_ranges_name_only_lines_the_parent_has(tmp_path):
    """The diff's schema offers as from/to only the lines of the parent's evolve block found once in its source;
    a JSON answer replaces the range it names; one naming a line that is not there, or a range backwards, is
    rejected with the reason. With structured_output off the prompt asks for SEARCH/REPLACE blocks."""
    first, last = NAIVE_LOOP.splitlines()[0], NAIVE_LOOP.splitlines()[-1]
    answers = [_json_edits((first, last, FAST_LOOP)), _json_edits(("for (;;) {", last, "x")),
               _json_edits((last, first, "x"))]  # fmt: skip
    with FakeLLM([Reply(text=a) for a in answers]) as fake:
        op = LLMDiff(session(fake.url, retry_rejected=False), PromptBook(PromptSettings()), hardware={})
        got = [op.propose(ctx(parent())) for _ in answers]
        schema = fake.requests[0]["response_format"]["json_schema"]["schema"]
    anchors = schema["properties"]["edits"]["items"]["properties"]["from"]["enum"]
    assert first.rstrip() in anchors and last.rstrip() in anchors
    inside = NAIVE.split("EVOLVE-BLOCK-START */")[1].split("/* EVOLVE-BLOCK-END")[0].splitlines()
    assert set(anchors) <= {x.rstrip() for x in inside} and all(NAIVE.count(a + "\n") == 1 for a in anchors)
    assert got[0].genome is not None and FAST_LOOP in got[0].genome.source and NAIVE_LOOP not in got[0].genome.source
    assert got[1].genome is None and got[2].genome is None
    with FakeLLM([Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP))]) as fake:
        model = ModelSettings(base_url=fake.url, model="scripted", api_key_env=KEY_ENV, structured_output="off")
        op = LLMDiff(LLMSession(LLMSettings(models=[model]), cache=ResponseCache()), PromptBook(PromptSettings()),
                     hardware={})  # fmt: skip
        assert op.propose(ctx(parent())).genome is not None
        assert "response_format" not in fake.requests[0] and "<<<<<<< SEARCH" in user_prompt(fake.requests[0])


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("I would interchange the loops.", "no SEARCH/REPLACE block"),
        ("<<<<<<< SEARCH\nfor (;;)\n>>>>>>> REPLACE\n", "without a ======= line"),
        (diff_answer("    for (int q = 0; q < M; q++)", "    ;"), "does not match"),
        (diff_answer("void kernel(int M, int N, int K, const float *A, const float *B, float *C)",
                     "void kernel2(void)"), "outside every evolve block"),
        ("\x00\x01 garbage \ufffd {{{{", "no SEARCH/REPLACE block"),
    ],
)
def test_unusable_diffs_are_rejected_with_the_reason_and_retried_once(tmp_path, answer, reason):
    with FakeLLM([Reply(text=answer)]) as fake:
        proposal, calls = run_op(LLMDiff, fake.url, parent(), tmp_path)
    assert proposal.genome is None
    assert [c["outcome"] for c in calls] == ["rejected", "rejected"]
    assert all(reason in c["reason"] for c in calls)
    retry = fake.requests[1]["messages"]
    assert retry[-2]["role"] == "assistant" and reason in retry[-1]["content"]  # the model sees its error


def test_a_rejected_diff_then_a_good_one_applies(tmp_path):
    script = [Reply(text=diff_answer("    nope", "    ;")), Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP))]
    with FakeLLM(script) as fake:
        proposal, calls = run_op(LLMDiff, fake.url, parent(), tmp_path)
    assert proposal.genome is not None
    assert [c["outcome"] for c in calls] == ["rejected", "applied"]
    assert len({c["proposal"] for c in calls}) == 1


def test_rewrite_replaces_the_evolve_block(tmp_path):
    with FakeLLM([Reply(text=rewrite_answer(FAST_LOOP))]) as fake:
        proposal, calls = run_op(LLMRewrite, fake.url, parent(), tmp_path)
    assert proposal.genome is not None and FAST_LOOP in proposal.genome.source
    assert NAIVE_LOOP not in proposal.genome.source and calls[0]["outcome"] == "applied"


def test_params_are_validated_against_the_space(tmp_path):
    point = TASK.space().sample(np.random.default_rng(1))
    bad = {**point, "MR": 999}
    script = [Reply(text="```json\n{not json}\n```"), Reply(text=json.dumps(bad)), Reply(text=json.dumps(point))]
    with FakeLLM(script) as fake:
        first, calls = run_op(LLMParams, fake.url, parent(), tmp_path)
        assert first.genome is None and "invalid JSON" in calls[0]["reason"] and "MR=999" in calls[1]["reason"]
        second, calls2 = run_op(LLMParams, fake.url, parent(), tmp_path / "b")
    assert second.genome is not None and second.genome.params == point and second.genome.source is None
    assert "## Parameters" in user_prompt(fake.requests[0]) and "Constraints:" in user_prompt(fake.requests[0])


def test_params_ask_for_the_spaces_schema_and_an_endpoint_that_refuses_it_is_asked_without(tmp_path):
    """structured_output auto: the first call carries the space's JSON schema; an endpoint that answers it 400 is
    asked again at once without it, and never with one again. `on` takes the 400 as the answer; `off` never asks."""
    point = TASK.space().sample(np.random.default_rng(2))

    def refuses_formats(body, n):
        if "response_format" not in body:
            return Reply(text=json.dumps(point))
        if n == 0:  # a 400 about something else leaves the format on
            return Reply(status=400, error="the prompt is longer than the context")
        return Reply(status=400, error="response_format is not supported")

    book = PromptBook(PromptSettings())
    with FakeLLM(refuses_formats) as fake:
        op = LLMParams(session(fake.url, retry_rejected=False), book, hardware={})
        failed = op.propose(ctx(parent()))
        first = op.propose(ctx(parent()))
        second = op.propose(ctx(parent(params=point)))
        assert failed.genome is None
        assert [("response_format" in b) for b in fake.requests] == [True, True, False, False]
        fmt = fake.requests[1]["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
        schema = fmt["json_schema"]["schema"]
        assert list(schema["properties"]) == schema["required"] == list(TASK.space().params)
        assert all(TASK.space().params[k].contains(v) for k, v in point.items())
        assert schema["properties"]["MR"]["enum"] == list(TASK.space().params["MR"].values())
        assert first.genome is not None and first.genome.params == point and second.genome is None
        for mode, sent in (("on", [True]), ("off", [False])):
            fake.requests.clear()
            model = ModelSettings(base_url=fake.url, model="scripted", api_key_env=KEY_ENV, structured_output=mode)
            op = LLMParams(LLMSession(LLMSettings(models=[model]), cache=ResponseCache()), book, hardware={})
            proposal = op.propose(ctx(parent()))
            assert [("response_format" in b) for b in fake.requests] == sent
            assert (proposal.genome is None) == (mode == "on")


def test_a_point_that_breaks_only_constraints_is_repaired_and_the_call_says_how(tmp_path):
    """The failing constraints' parameters are redrawn and the rest of the answer kept; the call is `applied` with
    what changed. A point outside a domain is rejected as before, and so is any point with repair_params off."""
    space = TASK.space()
    point = space.sample(np.random.default_rng(3))
    mr = point["MR"]
    broken = {**point, "MC": next(v for v in space.params["MC"].values() if v % mr)}
    assert space.violations(broken) == ["constraint 'MC % MR == 0' is false"]
    with FakeLLM([Reply(text=json.dumps(broken))]) as fake:
        proposal, calls = run_op(LLMParams, fake.url, parent(), tmp_path, retry_rejected=False)
        child = proposal.genome.params
        assert space.is_valid(child) and child != broken
        constrained = set().union(*(c.names for c in space.constraints))
        assert all(child[k] == broken[k] for k in space.params if k not in constrained)
        assert calls[0]["outcome"] == "applied" and calls[0]["reason"].startswith("repaired (constraint 'MC % MR")
        off, calls = run_op(LLMParams, fake.url, parent(), tmp_path / "off", retry_rejected=False,
                            repair_params=False)  # fmt: skip
        assert off.genome is None and calls[0]["outcome"] == "rejected"
    with FakeLLM([Reply(text=json.dumps({**broken, "MR": 999}))]) as fake:
        outside, calls = run_op(LLMParams, fake.url, parent(), tmp_path / "outside", retry_rejected=False)
        assert outside.genome is None and "MR=999 is outside its domain" in calls[0]["reason"]


def test_429_then_success_is_retried_within_the_deadline(tmp_path):
    script = [Reply(status=429, headers={"retry-after": "0.2"}), Reply(status=503),
              Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP))]
    with FakeLLM(script) as fake:
        proposal, calls = run_op(LLMDiff, fake.url, parent(), tmp_path)
    assert proposal.genome is not None and len(fake.requests) == 3 and calls[0]["outcome"] == "applied"


def test_a_slow_answer_past_the_deadline_is_an_error_not_a_hang(tmp_path):
    with FakeLLM([Reply(text="late", delay=3.0)]) as fake:
        t0 = time.monotonic()
        proposal, calls = run_op(LLMDiff, fake.url, parent(), tmp_path, timeout=1.0)
        took = time.monotonic() - t0
    assert proposal.genome is None and took < 2.5
    assert calls[0]["outcome"] == "error" and "deadline" in calls[0]["reason"]


def test_garbage_http_bodies_and_a_dead_endpoint_are_errors(tmp_path):
    with FakeLLM([Reply(garbage=True)]) as fake:
        proposal, calls = run_op(LLMDiff, fake.url, parent(), tmp_path)
    assert proposal.genome is None and calls[0]["outcome"] == "error" and calls[0]["reason"]
    dead = "http://127.0.0.1:9/v1"
    t0 = time.monotonic()
    proposal, calls = run_op(LLMDiff, dead, parent(), tmp_path / "d", timeout=1.0)
    assert proposal.genome is None and calls[0]["outcome"] == "error" and time.monotonic() - t0 < 3


def test_a_failing_endpoint_rests_and_is_reported_once():
    notes: list[str] = []
    client = LLMClient(ModelSettings(base_url="http://127.0.0.1:9/v1", model="m", timeout=0.3), cooldown=0.5,
                       failures_to_trip=2, note=notes.append)
    for _ in range(2):
        with pytest.raises(LLMUnavailable):
            client.chat([{"role": "user", "content": "hi"}])
    assert not client.available()
    with pytest.raises(LLMUnavailable, match="resting"):
        client.chat([{"role": "user", "content": "hi"}])
    time.sleep(0.6)
    assert client.available()  # one trial after the rest
    with pytest.raises(LLMUnavailable):
        client.chat([{"role": "user", "content": "hi"}])
    assert not client.available() and len(notes) == 1 and "failing" in notes[0]


def test_outcomes_move_forward_as_the_child_is_judged(tmp_path):
    with FakeLLM([Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP))]) as fake:
        op = LLMDiff(session(fake.url), PromptBook(PromptSettings()), hardware={})
        proposal = op.propose(ctx(parent()))
    store = Store(tmp_path / "a.db")
    store.add_pending(genome=proposal.genome, parents=["a" * 64], operator="llm_diff")
    proposal.on_commit(store, proposal.genome.id)
    op.on_result(store, proposal.genome.id, Status.OK, AddStatus.IMPROVED)
    op.on_result(store, proposal.genome.id, Status.OK, AddStatus.NOT_ADDED)  # never moves backwards
    assert store.llm_calls()[0]["outcome"] == "improved"
    stats = store.llm_stats("operator")["llm_diff"]
    assert stats["proposals"] == stats["applied"] == stats["correct"] == stats["improved"] == 1


def test_the_token_budget_stops_calls(tmp_path):
    with FakeLLM([Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP))]) as fake:
        s = session(fake.url, token_budget=10)
        op = LLMDiff(s, PromptBook(PromptSettings()), hardware={})
        assert op.available()
        op.propose(ctx(parent()))
        assert not op.available()
        proposal = op.propose(ctx(parent(), seed=1))
    assert len(fake.requests) == 1 and proposal.genome is None


def test_an_endpoint_that_refuses_tool_choice_is_offered_the_tools_without_it():
    """The agent asks for a call every turn (tool_choice required); an endpoint that answers that with 400 is asked
    again at once with the tools alone, and never with tool_choice again. A 400 about something else is a failure."""
    from evo.llm.tools import tool_specs

    def refuses_choice(body, n):
        if n == 0:
            return Reply(status=400, error="the prompt is longer than the context")
        if "tool_choice" in body:
            return Reply(status=400, error="tool_choice is not supported")
        return Reply(text="", tool_calls=[("test", {})])

    with FakeLLM(refuses_choice) as fake:
        client = LLMClient(ModelSettings(base_url=fake.url, model="scripted", api_key_env=KEY_ENV, timeout=5.0))
        with pytest.raises(LLMUnavailable, match="400"):
            client.chat([{"role": "user", "content": "go"}], tools=tool_specs(False))
        for _ in range(2):
            answer = client.chat([{"role": "user", "content": "go"}], tools=tool_specs(False))
            assert [c["name"] for c in answer.tool_calls] == ["test"]
        assert [b.get("tool_choice") for b in fake.requests] == ["required", "required", None, None]
