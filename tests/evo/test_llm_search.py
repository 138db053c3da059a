"""Real searches (compiler, sandboxed workers, SQLite) whose LLM operators talk to a scripted HTTP server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from llm_testlib import (
    FAST_LOOP,
    KEY_ENV,
    NAIVE_LOOP,
    SECRET,
    FakeLLM,
    NaiveMatmul,
    Reply,
    diff_answer,
    llm_config,
    rewrite_answer,
    user_prompt,
)

from archive import Run
from evo.config import parse_config
from evo.progress import SilentReporter
from evo.rundir import create_run, frozen_config, open_run
from evo.search import Search

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]  # it measures time
HERE = Path(__file__).parent


class Notes(SilentReporter):
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)


def run(tmp_path: Path, cfg: dict, *, resume: bool = False, name: str = "run") -> tuple[Search, Notes]:
    config = parse_config(cfg, source="test")
    path = tmp_path / name
    rd = open_run(path, writable=True) if resume else create_run(path, config)
    reporter = Notes()
    search = Search(config, rd, reporter=reporter)
    search.run()
    return search, reporter


def test_a_diff_turns_the_naive_seed_into_an_improvement_end_to_end(tmp_path):
    with FakeLLM([Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP))]) as fake:
        cfg = llm_config(fake.url, weights={"llm_diff": 1.0}, max_evals=2, n=96)
        (tmp_path / "llm.yaml").write_text(yaml.safe_dump(cfg))
        env = {**os.environ, KEY_ENV: SECRET, "PYTHONPATH": str(HERE)}
        proc = subprocess.run([sys.executable, "-m", "evo", "run", "llm.yaml", "--run-dir", "run"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert fake.auth and set(fake.auth) == {f"Bearer {SECRET}"}
    rd = Run.open(tmp_path / "run")
    (child,) = rd.store.by_operator("llm_diff")
    (seed,) = rd.store.by_operator("seed")
    assert child.status == "ok" and FAST_LOOP in child.source  # the kernel saw no API key in its environment
    assert list(child.parents) == [seed.id] and child.fitness > seed.fitness
    calls = rd.store.llm_calls()
    assert calls[0]["outcome"] == "improved" and calls[0]["candidate_id"] == child.id

    stats = subprocess.run([sys.executable, "-m", "evo", "archive", "stats", "run", "--json"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
    s = json.loads(stats.stdout)
    op = s["by_operator_detail"]["llm_diff"]
    assert op["proposals"] == op["applied"] == op["compiled"] == op["correct"] == op["improved"] == 1
    assert op["tokens"] > 0 and s["llm"]["by_model"]["scripted"]["improved"] == 1
    text = subprocess.run([sys.executable, "-m", "evo", "archive", "stats", "run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert "llm_diff" in text and "scripted" in text

    rd.close()
    for f in (tmp_path / "run").rglob("*"):  # the store, the stored config, the logs, the cache
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def _by_kind(point: dict) -> callable:
    """Answers each operator's prompt in its own format; the agent calls tools, then commits."""

    def script(body: dict, n: int) -> Reply:
        prompt = user_prompt(body)
        if body.get("tools"):
            source = re.search(r"Source:\n```c\n(.*?)\n```", prompt, re.S).group(1).replace(NAIVE_LOOP, FAST_LOOP)
            step = sum(m["role"] == "assistant" for m in body["messages"])
            tool = ["compile", "test", "show_candidate", "benchmark", "commit"][min(step, 4)]
            args = {"id": "zz"} if tool == "show_candidate" else {"source": source}
            if tool == "commit":
                args["summary"] = "i-k-j loop order"
            return Reply(text="", tool_calls=[(tool, args)])
        if "## Parameters" in prompt:
            return Reply(text=f"```json\n{json.dumps(point)}\n```")
        return Reply(text=rewrite_answer(FAST_LOOP))

    return script


@pytest.mark.parametrize("op", ["llm_rewrite", "llm_params", "agentic"])
def test_a_rewrite_a_params_proposal_and_an_agentic_loop_each_land(tmp_path, op):
    point = NaiveMatmul().space().sample(np.random.default_rng(7))
    with FakeLLM(_by_kind(point)) as fake:
        search, _ = run(tmp_path, llm_config(fake.url, weights={op: 1.0}, max_evals=2))
    store = search.store
    (seed,) = store.by_operator("seed")
    child = next(c for c in store.by_operator(op) if c.status != "pending")
    assert child.status == "ok" and list(child.parents) == [seed.id], child
    if op == "llm_params":
        assert child.params == point and child.source is None
    if op == "llm_rewrite":
        assert FAST_LOOP in child.source
    if op != "agentic":
        return
    agent = store.llm_calls(operator="agentic")
    assert [c["outcome"] for c in agent[:4]] == ["step"] * 4 and agent[4]["outcome"] in ("correct", "improved")
    assert agent[4]["candidate_id"] == child.id and FAST_LOOP in child.source
    transcript = json.loads(agent[4]["transcript"])
    answers = [m["content"] for m in transcript if m["role"] == "tool"]
    assert answers[0] == "compiled without errors" and answers[1].startswith("correct"), answers
    assert "no candidate" in answers[2] and answers[3].startswith("ok: fitness") and answers[4].startswith("committed")
    assert all(t["function"]["name"] != "search_memory" for t in fake.requests[-1]["tools"])  # no memory here


def test_an_agent_that_edits_its_draft_commits_the_draft(tmp_path):
    """The agent changes the parent by one line-range edit (offered as the draft's own lines), tests the draft
    without giving a source, and commits it: the child is the edited parent. An edit naming a line the draft does
    not have is rejected with the reason, and the draft stays as it was."""
    first, last = NAIVE_LOOP.splitlines()[0], NAIVE_LOOP.splitlines()[-1]
    turns = [("edit", {"from": "for (;;) {", "to": last, "replace": "x"}),
             ("edit", {"from": first, "to": last, "replace": FAST_LOOP}), ("test", {}),
             ("commit", {"summary": "i-k-j loop order"})]  # fmt: skip

    def script(body: dict, n: int) -> Reply:
        if not body.get("tools"):
            return Reply(text="no")
        step = sum(m["role"] == "assistant" for m in body["messages"])
        return Reply(text="", tool_calls=[turns[min(step, 3)]])

    with FakeLLM(script) as fake:
        search, _ = run(tmp_path, llm_config(fake.url, weights={"agentic": 1.0}, max_evals=2))
    child = next(c for c in search.store.by_operator("agentic") if c.status != "pending")
    assert child.status == "ok" and FAST_LOOP in child.source and NAIVE_LOOP not in child.source
    agent = search.store.llm_calls(operator="agentic")
    transcript = json.loads(agent[-1]["transcript"])
    answers = [m["content"] for m in transcript if m["role"] == "tool"]
    assert answers[0].startswith("rejected:") and "is not a line" in answers[0]
    assert answers[1].startswith("edited;") and FAST_LOOP.splitlines()[2] in answers[1]
    assert answers[2].startswith("correct") and answers[3].startswith("committed")
    edit = next(t for t in fake.requests[0]["tools"] if t["function"]["name"] == "edit")
    anchors = edit["function"]["parameters"]["properties"]["from"]["enum"]
    assert first.rstrip() in anchors and last.rstrip() in anchors  # the draft's own lines, for a server to enforce
    later = next(t for t in fake.requests[2]["tools"] if t["function"]["name"] == "edit")
    assert FAST_LOOP.splitlines()[2].rstrip() in later["function"]["parameters"]["properties"]["from"]["enum"]


def test_failures_of_every_kind_are_recorded_and_the_search_carries_on(tmp_path):
    script = [Reply(garbage=True), Reply(status=429), Reply(text=diff_answer(NAIVE_LOOP, FAST_LOOP)),
              Reply(text="no blocks at all"), Reply(text=diff_answer("    nothing like this", "")),
              Reply(text="late", delay=3), Reply(status=500), Reply(status=500), Reply(text="garbage again")]
    with FakeLLM(lambda body, n: script[n % len(script)]) as fake:
        cfg = llm_config(fake.url, weights={"llm_diff": 1.0, "mutate": 1.0}, max_evals=8, timeout=1.5,
                         cooldown=0.5)
        cfg["search"]["initial_random"] = 2
        search, _ = run(tmp_path, cfg)
    assert search.store.count() - search.store.count("pending") >= 8
    outcomes = {c["outcome"] for c in search.store.llm_calls()}
    assert outcomes & {"error", "rejected"} and len(fake.requests) >= 3
    assert all(c["reason"] for c in search.store.llm_calls() if c["outcome"] in ("error", "rejected"))


def test_a_dead_endpoint_never_stops_the_run_and_is_reported_once(tmp_path):
    cfg = llm_config("http://127.0.0.1:9/v1", weights={"llm_diff": 1.0}, max_evals=6, timeout=0.5, cooldown=60)
    cfg["search"]["initial_random"] = 2
    search, reporter = run(tmp_path, cfg)
    assert search.store.count() - search.store.count("pending") == 6
    assert search.store.counts_by_operator().get("mutate", 0) >= 1  # classical mutation carried the run
    down = [n for n in reporter.notes if "failing" in n]
    assert len(down) == 1 and "classical operators carry on" in down[0]
    assert {c["outcome"] for c in search.store.llm_calls()} == {"error"}


def test_a_resumed_run_replays_answers_instead_of_paying_again(tmp_path):
    def wrong(body: dict, n: int) -> Reply:  # distinct wrong kernels: the naive seed stays the only elite
        return Reply(text=diff_answer("            float sum = 0.0f;", f"            float sum = {n + 1}.0f;"))

    with FakeLLM(wrong) as fake:
        cfg = llm_config(fake.url, weights={"llm_diff": 1.0}, max_evals=2)
        cfg["search"]["confirm"] = {"repeats": 0}  # stop with the model's answers still in flight
        first, _ = run(tmp_path, cfg)
        paid_first = len(fake.requests)
        rd = open_run(tmp_path / "run", writable=True)  # as evo run --resume does: the stored config, a larger budget
        frozen = frozen_config(rd)
        Search(frozen.model_copy(update={"budget": frozen.budget.model_copy(update={"max_evals": 4})}), rd).run()
    calls = Run.open(tmp_path / "run").store.llm_calls()
    paid = [c for c in calls if not c["cached"]]
    assert len(fake.requests) == len(paid) and paid_first >= 1
    assert len({(c["prompt_hash"], c["slot"]) for c in paid}) == len(paid)  # no answer paid for twice
    replayed = [c for c in calls if c["cached"]]
    assert replayed and replayed[0]["outcome"] == "duplicate"  # the resumed run re-asked, the cache answered


def test_without_llm_the_run_says_so_once_and_adaptive_choice_learns(tmp_path):
    cfg = {"task": {"name": "matmul", "args": {"m": 48, "n": 48, "k": 48}},
           "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 5, "min_repeats": 3}, "check_trials": 1},
           "search": {"workers": 1, "initial_random": 3, "operators": {"adaptive": True}},
           "budget": {"max_evals": 10}, "archive": {"descriptors": ["register_tile_area"], "bins": 4},
           "memory": {"enabled": False}}
    search, reporter = run(tmp_path, cfg)
    assert sum("classical operators only" in n for n in reporter.notes) == 1
    bandit = search.proposer.bandit
    assert bandit is not None and sum(bandit.wins.values()) + sum(bandit.losses.values()) > 0
