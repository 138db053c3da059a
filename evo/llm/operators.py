"""The single-shot LLM operators: ``llm_diff``, ``llm_rewrite`` and ``llm_params``.

Each builds one prompt from the proposal context, asks a model, and reads the answer into a child
genome; an answer that cannot be used is rejected with its reason and (if configured) retried once
with the reason shown to the model. Every call is recorded through the proposal's ``on_commit``, and
its outcome moves on (compiled, correct, improved) as the controller judges the child (``on_result``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from archive import AddStatus, Candidate, Store
from evo.llm.diff import (
    Rejected,
    apply_edits,
    apply_json_edits,
    edits_schema,
    extract_code,
    extract_json,
    parse_edits,
    splice_blocks,
)
from evo.llm.prompt import PromptBook, base_source, render_prompt
from evo.llm.session import Draft, LLMSession
from evo.operators import Operator, Proposal, ProposalContext
from genome import Genome, ParamSpace
from runtime import Status, Task

__all__ = ["LLMDiff", "LLMOperator", "LLMParams", "LLMRewrite", "outcome_of"]

_FORMATS = {name: resources.files("evo.llm").joinpath(f"prompts/{name}.txt").read_text().strip()
            for name in ("diff_format_blocks", "diff_format_json")}  # fmt: skip
"""The diff prompt's answer format: line ranges as JSON where the endpoint enforces the schema, else blocks."""


def outcome_of(status: Status | str, add_status: AddStatus | str) -> str:
    """How far a child got: improved (entered the archive), correct, compiled, or merely applied."""
    if AddStatus(add_status).added:
        return "improved"
    if status == Status.OK:
        return "correct"
    return "applied" if status in (Status.COMPILE_ERROR, Status.PENDING) else "compiled"


class LLMOperator(Operator):
    """Shared machinery; subclasses set ``name``/``kind`` and implement :meth:`read`."""

    name = "llm"
    kind = "diff"
    arity = 1
    blocking = True

    def __init__(self, session: LLMSession, book: PromptBook, *, hardware: Mapping[str, Any]) -> None:
        self.session, self.book, self.hardware = session, book, dict(hardware)

    def available(self) -> bool:
        return self.session.available()

    def parent_source(self, parent: Candidate, task: Task) -> str:
        return base_source(parent, task)

    def read(self, text: str, parent: Candidate, ctx: ProposalContext) -> Genome | Amended:
        """The child an answer describes (:class:`Amended` where it had to be changed first), or :class:`Rejected`."""
        raise NotImplementedError

    def extra_fields(self, ctx: ProposalContext) -> dict[str, str]:
        return {}

    def schema(self, ctx: ProposalContext) -> dict[str, Any] | None:
        """The JSON schema of an answer, where the answer is JSON (sent to endpoints that enforce one)."""
        return None

    def first_messages(self, ctx: ProposalContext) -> list[dict[str, Any]]:
        assert ctx.task is not None
        user = render_prompt(self.book, self.kind, task=ctx.task, hardware=self.hardware, parent=ctx.parents[0],
                             inspirations=ctx.inspirations, hints=ctx.hints, extra=self.extra_fields(ctx))
        return [{"role": "system", "content": self.book.templates["system"].strip()},
                {"role": "user", "content": user}]

    def propose(self, ctx: ProposalContext) -> Proposal:
        parent = ctx.parents[0]
        messages = self.first_messages(ctx)
        drafts: list[Draft] = []
        child: Genome | None = None
        tries = 2 if self.session.settings.retry_rejected else 1
        for attempt in range(tries):
            draft = self.session.ask(messages, ctx.rng, schema=self.schema(ctx))
            drafts.append(draft)
            if draft.answer is None:
                break
            try:
                got = self.read(draft.answer.text, parent, ctx)
                child, draft.reason = (got.genome, got.note) if isinstance(got, Amended) else (got, None)
                draft.outcome = "applied"
                break
            except Rejected as exc:
                draft.outcome, draft.reason = "rejected", str(exc)
                if attempt + 1 < tries:
                    messages = [*messages, {"role": "assistant", "content": draft.answer.text},
                                {"role": "user", "content": f"Your answer was rejected: {exc}. "
                                 "Answer again, in the format asked for."}]
        return Proposal(genome=child, on_commit=self._recorder(drafts), meta={"drafts": len(drafts)})

    def _recorder(self, drafts: list[Draft]) -> Callable[[Store, str | None], None]:
        proposal = uuid.uuid4().hex

        def on_commit(store: Store, candidate_id: str | None) -> None:
            last = drafts[-1] if drafts else None
            if last is not None and last.outcome == "applied" and candidate_id is None:
                last.outcome, last.reason = "duplicate", "the child is already stored"
            store.record_llm_calls([d.record(proposal=proposal, operator=self.name,
                                             candidate_id=candidate_id if d is last else None) for d in drafts])

        return on_commit

    def on_result(self, store: Store, candidate_id: str, status: Status | str, add_status: AddStatus | str) -> None:
        """Moves the calls behind ``candidate_id`` to how far its child got."""
        outcome = outcome_of(status, add_status)
        if outcome != "applied":
            store.advance_llm_outcome(candidate_id, outcome)

    def close(self) -> None:
        self.session.close()


class LLMDiff(LLMOperator):
    """Edits applied strictly inside the parent's evolve blocks: line ranges as JSON where the endpoint enforces a
    schema (one that names only lines the parent has), SEARCH/REPLACE blocks where it does not."""

    name, kind = "llm_diff", "diff"

    def schema(self, ctx: ProposalContext) -> dict[str, Any] | None:
        assert ctx.task is not None
        return edits_schema(self.parent_source(ctx.parents[0], ctx.task))

    def extra_fields(self, ctx: ProposalContext) -> dict[str, str]:
        json_edits = self.schema(ctx) is not None and self.session.sends_schema()
        return {"answer_format": _FORMATS["diff_format_json" if json_edits else "diff_format_blocks"]}

    def read(self, text: str, parent: Candidate, ctx: ProposalContext) -> Genome:
        assert ctx.task is not None
        source = self.parent_source(parent, ctx.task)
        if text.lstrip().startswith("{") and "<<<<<<<" not in text:
            return Genome(params=parent.params, source=apply_json_edits(source, text))
        return Genome(params=parent.params, source=apply_edits(source, parse_edits(text)))


class LLMRewrite(LLMOperator):
    """One fenced code block that replaces the parent's evolve block(s)."""

    name, kind = "llm_rewrite", "rewrite"

    def read(self, text: str, parent: Candidate, ctx: ProposalContext) -> Genome:
        assert ctx.task is not None
        source = splice_blocks(self.parent_source(parent, ctx.task), extract_code(text))
        return Genome(params=parent.params, source=source)


class LLMParams(LLMOperator):
    """One JSON object of parameter values, validated against the space and its constraints."""

    name, kind = "llm_params", "params"

    def extra_fields(self, ctx: ProposalContext) -> dict[str, str]:
        return {"space": space_text(ctx.space)}

    def schema(self, ctx: ProposalContext) -> dict[str, Any] | None:
        return ctx.space.json_schema() if ctx.space.params else None

    def read(self, text: str, parent: Candidate, ctx: ProposalContext) -> Genome | Amended:
        values = extract_json(text)
        try:
            return params_child(values, parent, ctx.space)
        except Rejected:
            if not self.session.settings.repair_params:
                raise
            amended = repaired_child(values, parent, ctx.space, ctx.rng)
            if amended is None:
                raise
            return amended


def space_text(space: ParamSpace) -> str:
    d = space.to_dict()
    lines = [f"- {name}: {json.dumps(spec, default=list)}" for name, spec in d["params"].items()]
    cons = d.get("constraints") or []
    return "\n".join(lines) + ("\nConstraints: " + "; ".join(cons) if cons else "")


@dataclass(frozen=True)
class Amended:
    """A child made from an answer that could not be used as it came; ``note`` says what was changed."""

    genome: Genome
    note: str


def repaired_child(values: dict[str, Any], parent: Candidate, space: ParamSpace,
                   rng: np.random.Generator) -> Amended | None:  # fmt: skip
    """Where ``values`` (over the parent's params) break only the space's constraints, the point with the failing
    constraints' parameters redrawn (``space.repair``) and the rest kept; None where it breaks more, or no repair
    differs from the parent."""
    point = {**parent.params, **values}
    problems = space.violations(point)
    if not problems or not all(p.startswith("constraint ") for p in problems):
        return None
    fixed = space.repair(point, rng)
    if fixed is None or fixed == parent.params:
        return None
    changed = ", ".join(f"{k} {point[k]!r} -> {fixed[k]!r}" for k in space.params if fixed[k] != point[k])
    note = f"repaired ({'; '.join(problems[:3])}): {changed}"
    return Amended(Genome(params=fixed, source=parent.source if parent.params else None), note)


def params_child(values: dict[str, Any], parent: Candidate, space: ParamSpace) -> Genome:
    """The parent's params updated by ``values``; :class:`Rejected` if the point is not in the space."""
    if not space.params:
        raise Rejected("this task has no parameters to propose")
    point = {**parent.params, **values}
    problems = space.violations(point)
    if problems:
        raise Rejected("; ".join(problems[:6]))
    if point == parent.params:
        raise Rejected("the values are the parent's own")
    # a code genome without params (a naive seed) ignores the template: its params child uses the template
    return Genome(params=point, source=parent.source if parent.params else None)
