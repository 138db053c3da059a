"""Prompts: templates from files (built-in or the config's), filled with the task, the machine, the parent
and its full result, inspirations and memory hits, then bounded in size.

Bounding cuts whole sections, most expendable first: memory hits, then inspirations (the least fit
first); a source is never cut in the middle. Long error texts are shortened (head and tail kept) before
anything else, since compiler output can run to pages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from archive import Candidate
from evo.errors import UserError
from evo.llm.settings import PromptSettings
from runtime import KernelTask, Task

__all__ = ["PromptBook", "base_source", "candidate_section", "render_prompt", "shorten"]

KINDS = ("system", "diff", "rewrite", "params", "agentic")
_ERROR_CHARS = 1500


class PromptBook:
    """The templates of a run: the built-in ones, each replaceable by a file named in the config."""

    def __init__(self, settings: PromptSettings) -> None:
        self.max_chars = settings.max_chars
        self.templates: dict[str, str] = {}
        for kind in KINDS:
            path: Path | None = getattr(settings, kind)
            if path is None:
                self.templates[kind] = resources.files("evo.llm").joinpath(f"prompts/{kind}.txt").read_text()
            elif not Path(path).is_file():
                raise UserError(f"llm.prompts.{kind}: no such file {path} (give a template file, or remove the key)")
            else:
                self.templates[kind] = Path(path).read_text()
            try:
                self.templates[kind].format_map(_Fields({}))
            except (ValueError, IndexError, AttributeError) as exc:
                raise UserError(f"llm.prompts.{kind}: not a valid template ({exc}); "
                                "write a literal brace as {{ or }}") from None


def shorten(text: str, limit: int = _ERROR_CHARS) -> str:
    """``text`` within ``limit`` characters, keeping its head and tail (where compilers put the point)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


def task_section(task: Task) -> str:
    head = f"## Task: {task.name}\n{task.description or task.name}\nSignature (keep it): `{task.signature}`\n"
    if not isinstance(task, KernelTask):
        return head + f"Fitness is {task.unit}, higher is better; vs_reference is over the default configuration's."
    return head + (
        f"Timed case: {json.dumps(task.full_case())}. Fitness is {task.unit}, higher is better; vs_reference is "
        f"the reference implementation's time over the kernel's, timed side by side (> 1: faster than it).\n"
        "Parameters reach the source as `#define NAME value` lines before it (a string value also defines "
        "NAME_<VALUE> 1)."
    )


def base_source(c: Candidate, task: Task) -> str:
    """The source a candidate's code is edited from: its own, else its task's template (a kernel task), else
    its rendering (e.g. an engine configuration)."""
    if c.source is not None:
        return c.source
    return task.template() if isinstance(task, KernelTask) else task.render(c.genome)


def hardware_section(fingerprint: Mapping[str, Any]) -> str:
    if not fingerprint:
        return "## Machine\n(unknown)"
    flags = " ".join(fingerprint.get("cpu_flags", []))
    return (
        f"## Machine\nCPU: {fingerprint.get('cpu_model', '?')} ({fingerprint.get('machine', '?')}), "
        f"{fingerprint.get('cores_allowed', '?')} cores usable; vector extensions: {flags or 'none known'}\n"
        f"Compiler: {fingerprint.get('compiler', '?')}"
    )


def result_line(c: Candidate) -> str:
    parts = [f"status {c.status}"]
    if c.fitness is not None:
        parts.append(f"fitness {c.fitness:.3f} {c.unit}")
    vs = c.metrics.get("vs_reference")
    if vs is not None:
        parts.append(f"vs_reference {vs:.3f}x")
    return ", ".join(parts)


def candidate_section(c: Candidate, task: Task, *, title: str, with_source: bool = True) -> str:
    """A candidate with its full result: status, fitness, vs_reference, errors, params and source."""
    lines = [f"## {title} {c.id[:12]} (from {c.operator})", f"Result: {result_line(c)}"]
    if c.error:
        lines.append(f"Error:\n```\n{shorten(c.error)}\n```")
    if c.params:
        lines.append(f"Params: {json.dumps(c.params)}")
    if with_source:
        lines.append(f"Source:\n```c\n{base_source(c, task)}\n```")
    return "\n".join(lines)


def render_prompt(
    book: PromptBook,
    kind: str,
    *,
    task: Task,
    hardware: Mapping[str, Any],
    parent: Candidate,
    inspirations: Sequence[Candidate] = (),
    hints: Sequence[Any] = (),
    extra: Mapping[str, str] | None = None,
) -> str:
    """The user message for ``kind``, cut to ``book.max_chars`` by dropping hints, then inspirations."""
    insp = sorted(inspirations, key=lambda c: c.fitness or 0.0, reverse=True)
    insp_sections = [candidate_section(c, task, title="Inspiration", with_source=c.source is not None)
                     for c in insp]
    hint_lines = [_hint_line(h) for h in sorted(hints, key=lambda h: getattr(h, "score", 0.0), reverse=True)]
    fields = {"task": task_section(task), "hardware": hardware_section(hardware),
              "parent": candidate_section(parent, task, title="Parent"), "parent_id": parent.id, "unit": task.unit,
              **(extra or {})}

    def fill(n_insp: int, n_hints: int) -> str:
        ins = "".join(s + "\n\n" for s in insp_sections[:n_insp])
        if n_insp < len(insp_sections):
            ins += f"({len(insp_sections) - n_insp} more inspirations left out to bound the prompt)\n\n"
        hs = ("## Past discoveries (memory)\n" + "\n".join(hint_lines[:n_hints]) + "\n\n") if n_hints else ""
        return book.templates[kind].format_map(_Fields(fields, inspirations=ins, hints=hs))

    n_insp, n_hints = len(insp_sections), len(hint_lines)
    text = fill(n_insp, n_hints)
    while len(text) > book.max_chars and (n_hints or n_insp):
        if n_hints:
            n_hints -= 1
        else:
            n_insp -= 1
        text = fill(n_insp, n_hints)
    return text


def _hint_line(hit: Any) -> str:
    entry = getattr(hit, "entry", hit)
    score = getattr(hit, "score", None)
    summary = getattr(entry, "summary", None) or str(entry)
    return f"- {summary}" + (f" (similarity {score:.2f})" if isinstance(score, float) else "")


class _Fields(dict):
    """Template fields; an unknown ``{name}`` in a user's template is left as written."""

    def __init__(self, base: Mapping[str, str], **more: str) -> None:
        super().__init__(base, **more)

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"
