"""The agentic operator: a multi-turn tool-calling loop that proposes, compiles, tests, benchmarks and
repairs a kernel until it commits one, or a step, time or token budget runs out.

The agent works on a draft, the parent's source at first: ``edit`` replaces a range of its lines (named by lines
it has, found once, inside an evolve block; offered to an endpoint that enforces schemas as the only lines it
may name), and ``compile``, ``test``, ``benchmark`` and ``commit`` run the draft unless given a whole source
(which then becomes the draft). A small model that cannot write a whole kernel can still change one.

Every model turn is a recorded (and cached) call; the committed child enters the archive like any
other candidate, and the transcript is stored with the last call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from archive import Candidate
from evo.llm.diff import Rejected, anchor_lines, apply_json_edits, check_outside
from evo.llm.operators import LLMOperator
from evo.llm.prompt import PromptBook, render_prompt
from evo.llm.session import Draft, LLMSession
from evo.llm.tools import SandboxTools, parse_arguments, tool_specs
from evo.operators import Proposal, ProposalContext
from genome import Genome

__all__ = ["Agentic", "bound_messages"]

_CUT = "(cut to bound the prompt)"


class Agentic(LLMOperator):
    name, kind = "agentic", "agentic"

    def __init__(self, session: LLMSession, book: PromptBook, *, hardware: Mapping[str, Any],
                 tools: SandboxTools) -> None:
        super().__init__(session, book, hardware=hardware)
        self.tools = tools
        self.specs = tool_specs(tools.memory is not None)  # what a turn offers, its edit lines the draft's

    def propose(self, ctx: ProposalContext) -> Proposal:
        assert ctx.task is not None
        limits = self.session.settings.agentic
        parent = ctx.parents[0]
        memory_line = "- search_memory(query): past discoveries of earlier runs.\n" if self.tools.memory else ""
        user = render_prompt(self.book, "agentic", task=ctx.task, hardware=self.hardware, parent=parent,
                             inspirations=ctx.inspirations, hints=ctx.hints,
                             extra={"memory_tool": memory_line, "max_steps": str(limits.max_steps)})
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.book.templates["system"].strip()},
                                          {"role": "user", "content": user}]
        drafts: list[Draft] = []
        child: Genome | None = None
        work = {"draft": self.parent_source(parent, ctx.task)}  # this proposal's own (proposals run in threads)
        t0, tokens, end = time.monotonic(), 0, f"no commit within {limits.max_steps} steps"
        for _ in range(limits.max_steps):
            if time.monotonic() - t0 > limits.max_seconds:
                end = f"time budget of {limits.max_seconds:g} s spent"
                break
            if tokens >= limits.max_tokens:
                end = f"token budget of {limits.max_tokens} spent"
                break
            specs = tool_specs(self.tools.memory is not None, anchor_lines(work["draft"]) or None)
            draft = self.session.ask(bound_messages(messages, self.book.max_chars), ctx.rng, tools=specs)
            drafts.append(draft)
            if draft.answer is None:
                end = draft.reason or "no answer"
                break
            answer = draft.answer
            tokens += answer.tokens_in + answer.tokens_out
            draft.outcome = "step"
            messages.append(_assistant(answer.text, answer.tool_calls))
            if not answer.tool_calls:
                messages.append({"role": "user", "content": "Use the tools; finish with commit(source, summary)."})
                continue
            for call in answer.tool_calls:
                result, committed = self._run_tool(call, parent, ctx, work)
                messages.append({"role": "tool", "tool_call_id": call.get("id") or "", "content": result})
                if committed is not None and child is None:
                    child = committed
            if child is not None:
                break
        if drafts:
            last = drafts[-1]
            if child is not None:
                last.outcome = "applied"
            elif last.answer is not None:
                last.outcome, last.reason = "rejected", end
            else:
                last.reason = end
            last.transcript = messages
        return Proposal(genome=child, on_commit=self._recorder(drafts), meta={"steps": len(drafts)})

    def _run_tool(self, call: dict[str, Any], parent: Candidate, ctx: ProposalContext,
                  work: dict[str, str]) -> tuple[str, Genome | None]:  # fmt: skip
        """The tool's answer for the model, and the child when this was an accepted commit (``work["draft"]``:
        the source the agent works on, moved by ``edit`` and by a whole source given)."""
        assert ctx.task is not None
        name = call.get("name", "")
        try:
            args = parse_arguments(call.get("arguments", "{}"))
        except ValueError as exc:
            return f"error: the arguments are not a JSON object ({exc})", None
        if name == "show_candidate":
            return self.tools.show_candidate(str(args.get("id", ""))), None
        if name == "search_memory" and self.tools.memory is not None:
            return self.tools.search_memory(str(args.get("query", ""))), None
        if name == "edit":
            try:
                work["draft"] = apply_json_edits(work["draft"], json.dumps({"edits": [args]}))
            except Rejected as exc:
                return f"rejected: {exc}", None
            return "edited; the draft's lines now read:\n" + _around(work["draft"], str(args.get("replace", ""))), None
        if name not in ("compile", "test", "benchmark", "commit"):
            return f"error: unknown tool {name!r} (use {', '.join(s['function']['name'] for s in self.specs)})", None
        source = args.get("source", work["draft"])
        if not isinstance(source, str) or not source.strip():
            return "error: give the whole kernel source as 'source', or leave it out to use your draft", None
        try:
            check_outside(self.parent_source(parent, ctx.task), source)
        except Rejected as exc:
            return f"rejected: {exc}", None
        work["draft"] = source
        genome = Genome(params=parent.params, source=source)
        if name == "commit":
            if genome == parent.genome:
                return "rejected: the source is the parent's own; change something first", None
            return "committed: the candidate enters the archive", genome
        return getattr(self.tools, name)(genome), None

    def close(self) -> None:
        super().close()
        self.tools.close()


def _around(source: str, replaced: str, context: int = 3) -> str:
    """The lines an edit wrote, with ``context`` lines either side (the whole source where they are not found)."""
    lines, new = source.splitlines(), replaced.splitlines()
    if not new:
        return source
    at = next((i for i in range(len(lines) - len(new) + 1) if lines[i : i + len(new)] == new), None)
    if at is None:
        return source
    return "\n".join(lines[max(0, at - context) : at + len(new) + context])


def _assistant(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = [{"id": c.get("id") or "", "type": "function",
                              "function": {"name": c.get("name", ""), "arguments": c.get("arguments", "{}")}}
                             for c in calls]
    return msg


def _size(messages: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(m)) for m in messages)


def bound_messages(messages: list[dict[str, Any]], max_chars: int) -> list[dict[str, Any]]:
    """A copy within ``max_chars``: the oldest tool outputs, then the oldest tool-call sources, are cut first.

    The first two messages (system, task) and the last two are kept whole.
    """
    out = [dict(m) for m in messages]
    for m in out[2:-2]:
        if _size(out) <= max_chars:
            break
        if m.get("role") == "tool" and m.get("content") != _CUT:
            m["content"] = _CUT
    for m in out[2:-2]:
        if _size(out) <= max_chars:
            break
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps({"source": _CUT})}}
                               for c in m["tool_calls"]]
    return out
