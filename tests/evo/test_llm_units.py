"""Diff parsing and applying, splicing, prompt bounding, the bandit, and the llm: config section."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llm_testlib import NAIVE, NaiveMatmul

from archive import Candidate
from evo.bandit import OperatorBandit
from evo.config import parse_config
from evo.errors import UserError
from evo.llm.agentic import bound_messages
from evo.llm.diff import (
    Edit,
    Rejected,
    anchor_lines,
    apply_edits,
    apply_json_edits,
    check_outside,
    edits_schema,
    extract_json,
    parse_edits,
    splice_blocks,
)
from evo.llm.prompt import PromptBook, render_prompt
from evo.llm.settings import PromptSettings
from runtime import Status

SRC = "int f(int x) {\n  /* EVOLVE-BLOCK-START */\n  int y = x;\n  y += 1;\n  /* EVOLVE-BLOCK-END */\n  return y;\n}\n"
line = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30).filter(
    lambda s: "EVOLVE" not in s and "<<<<<" not in s and "=====" not in s and ">>>>>" not in s)


def test_an_edit_inside_the_block_applies_and_the_rest_is_kept():
    out = apply_edits(SRC, parse_edits("<<<<<<< SEARCH\n  y += 1;\n=======\n  y += 2;\n>>>>>>> REPLACE"))
    assert out == SRC.replace("y += 1", "y += 2")


TWICE = ("int f(int x) {\n  int y = x;\n  /* EVOLVE-BLOCK-START */\n  int y = x;\n  y += 1;\n\n  y *= 2;\n"
         "  /* EVOLVE-BLOCK-END */\n  return y;\n}\n")  # fmt: skip


def _edits(*edits: tuple[str, str, str]) -> str:
    return json.dumps({"edits": [{"from": a, "to": b, "replace": r} for a, b, r in edits]})


def test_json_edits_name_lines_found_once_inside_a_block():
    """Anchors: non-blank lines inside a block found once in the source (not a copy of a line outside it, nor the
    markers). Ranges name the parent's lines, so edits apply together: a repeat or a no-op is left out, an overlap
    is rejected; every other unusable answer is rejected with the reason."""
    assert anchor_lines(TWICE) == ["  y += 1;", "  y *= 2;"]
    assert edits_schema(TWICE)["properties"]["edits"]["items"]["properties"]["to"]["enum"] == anchor_lines(TWICE)
    assert edits_schema("int f() { return 0; }\n") is None  # no evolve block: nothing to name
    whole = _edits(("  y += 1;", "  y *= 2;", "  y = 2 * y + 2;"))
    assert apply_json_edits(TWICE, whole) == TWICE.replace("  y += 1;\n\n  y *= 2;", "  y = 2 * y + 2;")
    both = _edits(("  y += 1;", "  y += 1;", "  y += 3;"), ("  y *= 2;", "  y *= 2;", "  y *= 4;"),
                  ("  y += 1;", "  y += 1;", "  y += 5;"), ("  y *= 2;", "  y *= 2;", "  y *= 2;"))
    assert apply_json_edits(TWICE, both) == TWICE.replace("y += 1", "y += 3").replace("y *= 2", "y *= 4")
    for answer, reason in [(_edits(("  int y = x;", "  y += 1;", "")), "found 2"),
                           (_edits(("  y *= 2;", "  y += 1;", "")), "comes before"),
                           (_edits(("y", "  y += 1;", "")), "is not a line"),
                           (_edits(("  y += 1;", "  y *= 2;", "a"), ("  y *= 2;", "  y *= 2;", "b")), "overlap"),
                           (_edits(("  y += 1;", "  y += 1;", "  y += 1;")), "change nothing"),
                           (_edits(("  y += 1;", "  y += 1;", "/* EVOLVE-BLOCK-END */")), "markers"),
                           ('{"edits": []}', "must be"), ('{"edits": [{"from": 3}]}', "each a string"),
                           ('{"edits": [', "invalid JSON")]:  # fmt: skip
        with pytest.raises(Rejected, match=reason):
            apply_json_edits(TWICE, answer)


@pytest.mark.parametrize(("edit", "reason"), [
    (Edit(["  return y;"], ["  return 0;"]), "outside every evolve block"),
    (Edit(["  y += 7;"], [""]), "does not match"),
    (Edit([""], ["x"]), "empty SEARCH"),
    (Edit(["  y += 1;"], ["  /* EVOLVE-BLOCK-END */"]), "markers"),
    (Edit(["  y += 1;"], ["  y += 1;"]), "change nothing"),
])
def test_edits_that_cannot_apply_say_why(edit, reason):
    with pytest.raises(Rejected, match=reason):
        apply_edits(SRC, [edit])


def test_an_ambiguous_search_is_rejected():
    src = SRC.replace("  y += 1;\n", "  y += 1;\n  y += 1;\n")
    with pytest.raises(Rejected, match="2 places"):
        apply_edits(src, [Edit(["  y += 1;"], ["  y += 3;"])])


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_parsing_any_text_either_gives_edits_or_rejects(text):
    try:
        edits = parse_edits(text)
    except Rejected as exc:
        assert str(exc)
    else:
        assert edits and all(isinstance(e.search, list) for e in edits)


@settings(max_examples=100, deadline=None)
@given(st.lists(line, min_size=1, max_size=6), st.data())
def test_a_diff_of_block_lines_applies_exactly_there(body, data):
    body = [f"  v{i} = {s!r};" for i, s in enumerate(body)]  # distinct lines
    src = "head();\n/* EVOLVE-BLOCK-START */\n" + "\n".join(body) + "\n/* EVOLVE-BLOCK-END */\ntail();\n"
    i = data.draw(st.integers(0, len(body) - 1))
    j = data.draw(st.integers(i + 1, len(body)))
    new = data.draw(st.lists(line, max_size=3))
    answer = "\n".join(["chatter", "<<<<<<< SEARCH", *body[i:j], "=======", *new, ">>>>>>> REPLACE"])
    try:
        out = apply_edits(src, parse_edits(answer))
    except Rejected as exc:
        assert "change nothing" in str(exc) or "markers" in str(exc)
        return
    lines = out.splitlines()
    assert lines[:2] == ["head();", "/* EVOLVE-BLOCK-START */"] and lines[-2:] == ["/* EVOLVE-BLOCK-END */", "tail();"]
    assert lines[2:-2] == body[:i] + new + body[j:]


@settings(max_examples=60, deadline=None)
@given(line, line)
def test_edits_outside_blocks_are_always_rejected(a, b):
    src = f"pre({a!r});\n/* EVOLVE-BLOCK-START */\ninside();\n/* EVOLVE-BLOCK-END */\n"
    with pytest.raises(Rejected, match="outside"):
        apply_edits(src, [Edit([f"pre({a!r});"], [f"pre({b!r}); x();"])])


def test_splice_and_check_outside():
    code = "```c\n  /* EVOLVE-BLOCK-START */\n  int y = 2 * x;\n  /* EVOLVE-BLOCK-END */\n```"
    out = splice_blocks(SRC, code)
    assert "int y = 2 * x;" in out and "y += 1" not in out and out.endswith("return y;\n}\n")
    assert splice_blocks(SRC, "  int y = -x;") .count("int y = -x;") == 1  # no markers: the one block's body
    assert check_outside(SRC, out) == out
    with pytest.raises(Rejected, match="outside every evolve block"):
        check_outside(SRC, out.replace("return y;", "return 0;"))
    with pytest.raises(Rejected, match="evolve block"):
        splice_blocks("int f(void) { return 0; }\n", code)


def test_extract_json_forms():
    assert extract_json('Sure:\n```json\n{"MR": 6}\n```') == {"MR": 6}
    assert extract_json('use {"MR": 4, "NR": 32} please') == {"MR": 4, "NR": 32}
    for bad, why in (("[1, 2]", "no JSON object"), ("{MR: 6}", "invalid JSON"), ("nothing", "no JSON")):
        with pytest.raises(Rejected, match=why):
            extract_json(bad)


def cand(i: int, fitness: float, source: str | None = NAIVE) -> Candidate:
    return Candidate(id=str(i) * 64, seq=i, parents=(), operator="seed", params={}, source=source,
                     status=Status.OK, fitness=fitness, unit="GFLOP/s", metrics={"vs_reference": 0.1})


class Hit:
    def __init__(self, summary: str, score: float) -> None:
        self.entry = type("E", (), {"summary": summary})()
        self.score = score


def test_prompts_are_bounded_by_cutting_hints_then_inspirations_never_a_source():
    task = NaiveMatmul({"m": 64, "n": 64, "k": 64})
    parent = cand(1, 2.0, NAIVE + "\n/* " + "x" * 3000 + " */\n")
    insp = [cand(i, float(i)) for i in range(2, 6)]
    hints = [Hit(f"hint {i} " + "y" * 400, 0.5) for i in range(4)]
    full = render_prompt(PromptBook(PromptSettings()), "diff", task=task, hardware={}, parent=parent,
                         inspirations=insp, hints=hints)
    book = PromptBook(PromptSettings(max_chars=len(full) - 1500))
    cut = render_prompt(book, "diff", task=task, hardware={}, parent=parent, inspirations=insp, hints=hints)
    assert len(cut) <= book.max_chars and "hint 0" not in cut and parent.source in cut
    assert "Inspiration 555555555555" in cut  # the fittest inspiration is kept longest
    tiny = PromptBook(PromptSettings(max_chars=2000))
    small = render_prompt(tiny, "diff", task=task, hardware={}, parent=parent, inspirations=insp, hints=hints)
    assert parent.source in small and "## Inspiration" not in small and "4 more inspirations left out" in small


def test_a_template_may_name_the_parent_by_id_alone():
    parent = cand(7, 2.0)
    book = PromptBook(PromptSettings())
    book.templates["agentic"] = "Parent {parent_id}; {unknown} is left as written."
    text = render_prompt(book, "agentic", task=NaiveMatmul({"m": 8, "n": 8, "k": 8}), hardware={}, parent=parent)
    assert text == f"Parent {parent.id}; {{unknown}} is left as written." and parent.source not in text


def test_agent_history_is_cut_oldest_first():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for i in range(6):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": str(i), "type": "function", "function": {"name": "test", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": str(i), "content": f"out{i} " + "z" * 1000}]
    cut = bound_messages(msgs, 4000)
    contents = [m["content"] for m in cut if m["role"] == "tool"]
    assert contents[0].startswith("(cut") and contents[-1].startswith("out5") and msgs[3]["content"].startswith("out0")


def test_the_bandit_prefers_the_operator_that_improves():
    bandit = OperatorBandit(["a", "b"])
    for _ in range(40):
        bandit.update("a", True)
        bandit.update("b", False)
    rng = np.random.default_rng(0)
    picks = [bandit.choose(["a", "b"], rng) for _ in range(200)]
    assert picks.count("a") > 180 and bandit.shares()["a"] > bandit.shares()["b"]
    assert bandit.choose(["b"], rng) == "b"


BASE = {"task": {"name": "matmul", "args": {"m": 32, "n": 32, "k": 32}},
        "archive": {"descriptors": ["source_lines"]}}


def test_llm_weights_without_an_llm_section_are_a_one_line_error():
    data = {**BASE, "search": {"operators": {"weights": {"mutate": 1, "llm_diff": 1}}}}
    with pytest.raises(UserError, match="llm_diff need an llm: section") as e:
        parse_config(data, source="job.yaml")
    assert "\n" not in str(e.value)
    data["llm"] = {"models": [{"base_url": "http://127.0.0.1:8000/v1", "model": "m", "api_key": "sk-x"}]}
    with pytest.raises(UserError, match="llm.models.0.api_key: unknown key"):
        parse_config(data, source="job.yaml")
    data["llm"]["models"][0].pop("api_key")
    config = parse_config({**data, "search": {"operators": {"weights": {"llm_diff": 1}, "adaptive": True}}}, source="x")
    assert config.llm.models[0].api_key_env is None and config.search.operators.adaptive


def test_search_memory_is_offered_only_with_a_memory(tmp_path):
    from evo.llm.tools import SandboxTools, tool_specs

    names = lambda specs: [s["function"]["name"] for s in specs]  # noqa: E731
    assert "search_memory" not in names(tool_specs(False)) and names(tool_specs(True))[-2:] == ["search_memory",
                                                                                                   "commit"]
    tools = SandboxTools(task=NaiveMatmul(), make_request=None, run_dir=tmp_path, log_dir=tmp_path,
                         memory=lambda q: [Hit(f"packed 6x32 tile for {q}", 0.9)])
    assert "packed 6x32 tile for matmul" in tools.search_memory("matmul")


def test_the_agents_tool_requests_carry_what_the_search_was_offered_since_it_started(tmp_path):
    """An offer replaces the search's config (:meth:`Search._new_offers`); the agent's compile/test/benchmark
    requests are built from the config as it is at each call, not as it was when the operator was made."""
    from llm_testlib import llm_config

    from evo.rundir import create_run
    from evo.search import Search
    from genome import Genome

    config = parse_config(llm_config("http://127.0.0.1:9/v1", weights={"agentic": 1}), source="test")
    search = Search(config, create_run(tmp_path / "run", config))
    tools = search.proposer.operators["agentic"].tools
    assert tools.make_request(Genome(params={}, source=NAIVE), "k0", "check").task.args["m"] == 64
    grown = config.task.model_copy(update={"args": {**config.task.args, "m": 32}})
    search.config = config.model_copy(update={"task": grown})  # as an offer grows the task's args
    request = tools.make_request(Genome(params={}, source=NAIVE), "k1", "check")
    assert request.task.args["m"] == 32 and request.stages == "check"
    search.stored_run.close()
