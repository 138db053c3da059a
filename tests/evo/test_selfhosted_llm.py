"""A short real `evo run` of configs/matmul_cpu_selfhosted.yaml whose language-model operators call a real
`evo serve --gguf` of SmolLM2-135M-Instruct: whatever the tiny model answers, every call it answered is
recorded in `llm_calls` with a known outcome and its tokens, and `evo archive stats` shows the funnel."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from archive import OUTCOME_RANK, Run

pytest.importorskip("openai")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "serving"))  # serve_helpers, shared with the serving tests
from gguf_models import smollm2_file  # noqa: E402
from serve_helpers import Server, start_server, stop  # noqa: E402

KNOWN = {*OUTCOME_RANK, "rejected", "error", "duplicate", "step"}
OPERATORS = ("llm_params", "llm_diff")
# Short prompts, so that a call reads ~100 tokens and writes at most 16: seconds, not minutes, on two cores.
TEMPLATES = {
    "system": "You tune C matrix-multiply kernels. Answer in exactly the format asked for.\n",
    "params": "Parameters of a blocked matmul kernel: MR (an int from 3 to 16), UNROLL (1, 2, 4 or 8), "
              'LOOP_ORDER ("JPI" or "PJI").\nAnswer with one JSON object of new values, like {{"MR": 8}}.\n',
    "diff": "The kernel's inner loop is:\n    for (int k = 0; k < K; k++) sum += A[(long)i * K + k] * "
            "B[(long)k * N + j];\nUnroll it. Answer with one edit block:\n<<<<<<< SEARCH\nthe line\n=======\n"
            "its replacement\n>>>>>>> REPLACE\n",
}  # fmt: skip


def short_config(tmp_path: Path, url: str) -> dict:
    """The shipped config, cut to a small matmul and two sequential model calls (seed 3 draws llm_diff, then
    llm_params): the token budget is spent by the second (each costs 75-150 tokens), then mutation fills the
    last evaluations, so no call is in flight when the run ends."""
    cfg = yaml.safe_load((ROOT / "configs" / "matmul_cpu_selfhosted.yaml").read_text())
    (model,) = cfg["llm"]["models"]
    assert model["base_url"] == "http://127.0.0.1:8000/v1"
    for kind, text in TEMPLATES.items():
        (tmp_path / f"{kind}.txt").write_text(text)
    cfg["task"]["args"] = {"m": 64, "n": 64, "k": 64, "threads": 1}
    cfg["evaluation"]["timing"] = {"warmup": 1, "min_repeats": 3, "max_repeats": 5, "max_seconds": 0.05}
    cfg["search"].update(seed=3, workers=1, initial_random=0, selection={"scheme": "uniform"}, confirm={"repeats": 0},
                         operators={"weights": dict.fromkeys(OPERATORS, 1.0)})  # fmt: skip
    cfg["budget"] = {"max_evals": 4, "max_time": 120}
    cfg["memory"] = {"enabled": False}
    model.update(base_url=url + "/v1", temperature=0.0, max_tokens=16, timeout=60, max_concurrency=1)
    cfg["llm"].update(token_budget=150, retry_rejected=False,
                      prompts={kind: f"{kind}.txt" for kind in TEMPLATES})  # fmt: skip
    return cfg


def chat_answers(srv: Server) -> int:
    """Chat completions the server answered whole (status 200), from its /metrics."""
    status, text, _ = srv.call("GET", "/metrics")
    assert status == 200
    found = re.search(r'evoforge_requests_total\{[^}]*route="/v1/chat/completions"[^}]*status="200"[^}]*\} (\S+)',
                      text)  # fmt: skip
    return int(float(found.group(1))) if found else 0


def test_a_run_records_every_call_a_served_smollm2_answered(tmp_path: Path) -> None:
    t0 = time.monotonic()
    srv = start_server(None, "--gguf", str(smollm2_file()))
    try:
        served = srv.call("GET", "/v1/models")[1]["data"][0]["id"]
        cfg = short_config(tmp_path, srv.url)
        assert cfg["llm"]["models"][0]["model"] == served  # the shipped config names the model evo serve serves
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
        t_run = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "evo", "run", "run.yaml", "--run-dir", "run"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=180)  # fmt: skip
        t_run = time.monotonic() - t_run
        answered_by_server = chat_answers(srv)
    finally:
        stop(srv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]

    with Run.open(tmp_path / "run") as rd:
        calls = rd.store.llm_calls()
    assert calls, "no model call was recorded"
    answered = [c for c in calls if c["tokens_in"] > 0]
    assert answered, f"the model answered no call: {[(c['outcome'], c['reason']) for c in calls]}"
    assert len(answered) == answered_by_server  # every answer the server gave is a row
    for c in calls:
        assert c["operator"] in OPERATORS and c["outcome"] in KNOWN, c
        assert not c["cached"] and c["model"] == served
        if c["outcome"] in ("rejected", "error"):
            assert c["reason"], c  # a call that led nowhere says why
        if c["outcome"] != "error":  # the model answered it: tokens read and written
            assert c["tokens_in"] > 0 and c["tokens_out"] > 0, c

    stats = subprocess.run([sys.executable, "-m", "evo", "archive", "stats", "run", "--json"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert stats.returncode == 0, stats.stderr
    detail = json.loads(stats.stdout)["by_operator_detail"]
    proposals = Counter(c["operator"] for c in calls)  # one call per proposal: no retries
    for op, n in proposals.items():
        row = detail[op]
        assert row["proposals"] == n
        assert row["proposals"] >= row["applied"] >= row["compiled"] >= row["correct"] >= row["improved"]
        assert row["applied"] == sum(c["operator"] == op and c["outcome"] in OUTCOME_RANK for c in calls)
        assert row["tokens"] == sum(c["tokens_in"] + c["tokens_out"] for c in calls if c["operator"] == op)
    table = subprocess.run([sys.executable, "-m", "evo", "archive", "stats", "run"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "per operator" in table.stdout and all(op in table.stdout for op in proposals)
    print(
        f"{time.monotonic() - t0:.1f} s in all, evo run {t_run:.1f} s; outcomes "
        f"{Counter((c['operator'], c['outcome']) for c in calls)}; reasons {[c['reason'] for c in calls]}"
    )


# The parent by its id alone: its source, named again by the edit tool's lines, would make the first turn read
# ~5,300 tokens (over a minute of prefill on two cores, past the call's timeout on a loaded machine).
AGENT = ("Tools: compile(source), test(source), benchmark(source), show_candidate(id), commit(source, summary). "
         "Your first call: show_candidate with id {parent_id}. Then commit. At most {max_steps} turns.\n")  # fmt: skip


def test_the_agentic_loop_runs_on_a_served_smollm2_with_enforced_tool_calls(tmp_path: Path) -> None:
    """The agentic operator against `evo serve --gguf` of SmolLM2: its every turn asks for a tool call
    (tool_choice required), the server holds the model to one of the offered tools with arguments of its schema, and
    the loop runs what it called and feeds the results back. Every turn is recorded, the transcript stored."""
    srv = start_server(None, "--gguf", str(smollm2_file()))
    try:
        cfg = short_config(tmp_path, srv.url)
        (tmp_path / "agentic.txt").write_text(AGENT)
        cfg["search"]["operators"] = {"weights": {"agentic": 1.0}}
        cfg["budget"] = {"max_evals": 3, "max_time": 240}  # the two seeds, then one agentic proposal
        cfg["llm"]["models"][0].update(max_tokens=160, timeout=120)
        # the budget ends the run's model calls within the first proposal's turns (~600-1000 tokens each), so no
        # call is in flight when the run ends
        cfg["llm"].update(token_budget=2000, agentic={"max_steps": 3, "max_seconds": 200, "max_tokens": 20000})
        cfg["llm"]["prompts"] = {"system": "system.txt", "agentic": "agentic.txt"}
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
        proc = subprocess.run([sys.executable, "-m", "evo", "run", "run.yaml", "--run-dir", "run"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        answered_by_server = chat_answers(srv)
    finally:
        stop(srv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Run.open(tmp_path / "run") as rd:
        calls = rd.store.llm_calls(operator="agentic")
    answered = [c for c in calls if c["tokens_out"] > 0]
    assert answered and len(answered) == answered_by_server, [(c["outcome"], c["reason"]) for c in calls]
    assert all(c["outcome"] in KNOWN for c in calls)
    # a proposal whose first call failed (a timeout, the token budget) stores a transcript of no turns: check the
    # longest one
    transcripts = [json.loads(c["transcript"]) for c in calls if c["transcript"]]
    transcript = max(transcripts, key=len)
    turns = [m for m in transcript if m["role"] == "assistant"]
    # every answer is a call, or a call cut at max_tokens: the server held the model to the format
    assert all(m.get("tool_calls") or m["content"].replace(" ", "").startswith('{"name":"') for m in turns), turns
    made = [t["function"] for m in turns for t in m.get("tool_calls") or ()]
    results = [m["content"] for m in transcript if m["role"] == "tool"]
    assert made and len(results) == len(made), transcript
    names = {"edit", "compile", "test", "benchmark", "show_candidate", "commit"}  # the tools offered
    assert all(f["name"] in names and isinstance(json.loads(f["arguments"]), dict) for f in made), made
    print(f"calls {[(f['name'], f['arguments'][:60]) for f in made]}; results {[r[:80] for r in results]}")
