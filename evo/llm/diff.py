"""Reading model answers into sources: SEARCH/REPLACE diffs, line-range edits as JSON, whole evolve blocks, JSON
objects.

Every edit lands strictly inside an evolve block (``EVOLVE-BLOCK-START`` ... ``EVOLVE-BLOCK-END``); an
answer that cannot be applied raises :class:`Rejected` with a reason short enough to show the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from genome import EVOLVE_END, EVOLVE_START, evolve_blocks

__all__ = ["Edit", "Rejected", "anchor_lines", "apply_edits", "apply_json_edits", "check_outside", "edits_schema",
           "extract_code", "extract_json", "parse_edits", "splice_blocks"]

_SEARCH = re.compile(r"^\s*<{5,}\s*SEARCH\s*$")
_SEP = re.compile(r"^\s*={5,}\s*$")
_REPLACE = re.compile(r"^\s*>{5,}\s*REPLACE\s*$")
_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


class Rejected(ValueError):
    """An answer that could not become a child; ``str()`` is the reason (recorded, and shown on retry)."""


@dataclass(frozen=True)
class Edit:
    search: list[str]
    replace: list[str]


def parse_edits(text: str) -> list[Edit]:
    """The SEARCH/REPLACE blocks of an answer, in order; text around them is ignored."""
    edits: list[Edit] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not _SEARCH.match(lines[i]):
            i += 1
            continue
        n = len(edits) + 1
        sep = next((j for j in range(i + 1, len(lines)) if _SEP.match(lines[j]) or _SEARCH.match(lines[j])
                    or _REPLACE.match(lines[j])), None)
        if sep is None or not _SEP.match(lines[sep]):
            raise Rejected(f"edit block {n}: SEARCH without a ======= line after it")
        end = next((j for j in range(sep + 1, len(lines)) if _REPLACE.match(lines[j]) or _SEARCH.match(lines[j])
                    or _SEP.match(lines[j])), None)
        if end is None or not _REPLACE.match(lines[end]):
            raise Rejected(f"edit block {n}: no >>>>>>> REPLACE line closing it")
        edits.append(Edit(search=lines[i + 1 : sep], replace=lines[sep + 1 : end]))
        i = end + 1
    if not edits:
        raise Rejected("no SEARCH/REPLACE block found (answer with <<<<<<< SEARCH / ======= / >>>>>>> REPLACE)")
    return edits


MAX_EDITS = 4
"""Edits a JSON answer may hold."""


def anchor_lines(source: str) -> list[str]:
    """The lines of ``source`` an edit may name as its first or last: non-blank, inside an evolve block, and
    found once in the whole source (a copy names one place), in order."""
    lines = [line.rstrip() for line in source.splitlines()]
    seen: dict[str, int] = {}
    for line in lines:
        seen[line] = seen.get(line, 0) + 1
    try:
        blocks = evolve_blocks(source)
    except ValueError:
        return []
    inside = [lines[i] for a, b in blocks for i in range(a, b)]
    return [x for x in inside if x.strip() and seen[x] == 1 and EVOLVE_START not in x and EVOLVE_END not in x]


def edits_schema(source: str, *, max_chars: int = 12000) -> dict[str, Any] | None:
    """The JSON schema of line-range edits to ``source``: ``{"edits": [{"from", "to", "replace"}]}``, ``from`` and
    ``to`` each one of its :func:`anchor_lines` (so an endpoint that enforces the schema can only name lines that
    exist, exactly once), ``replace`` any text. ``None`` where no line can be named, or the lines would make a
    schema over ``max_chars``."""
    anchors = anchor_lines(source)
    if not anchors:
        return None
    line = {"enum": anchors}
    schema = {"type": "object", "additionalProperties": False, "required": ["edits"], "properties": {
        "edits": {"type": "array", "minItems": 1, "maxItems": MAX_EDITS, "items": {
            "type": "object", "additionalProperties": False, "required": ["from", "to", "replace"],
            "properties": {"from": line, "to": line, "replace": {"type": "string"}}}}}}  # fmt: skip
    return schema if len(json.dumps(schema)) <= max_chars else None


def apply_json_edits(source: str, text: str) -> str:
    """``source`` with the edits of a JSON answer ``{"edits": [{"from": LINE, "to": LINE, "replace": TEXT}]}``: each
    replaces the parent's lines from ``from`` through ``to`` (both included, each found once, within one evolve
    block) by ``replace``'s lines. Every range names the parent's own lines, so the edits apply together: one that
    repeats an earlier edit's range is left out, one that overlaps another's is rejected, and one that changes
    nothing is left out (all of them changing nothing is rejected)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Rejected(f"invalid JSON: {exc}") from None
    items = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(items, list) or not items:
        raise Rejected('the JSON must be {"edits": [{"from": ..., "to": ..., "replace": ...}, ...]}')
    lines = source.splitlines()
    bare = [line.rstrip() for line in lines]
    try:
        blocks = evolve_blocks(source)
    except ValueError as exc:
        raise Rejected(f"unbalanced evolve-block markers: {exc}") from None
    ranges: dict[tuple[int, int], list[str]] = {}
    for n, item in enumerate(items[:MAX_EDITS], 1):
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("from", "to", "replace")):
            raise Rejected(f"edit {n}: give from, to and replace, each a string")
        where = []
        for key in ("from", "to"):
            hits = [i for i, x in enumerate(bare) if x == item[key].rstrip()]
            if len(hits) != 1:
                found = "is not a line of" if not hits else f"is found {len(hits)} times in"
                raise Rejected(f"edit {n}: {key} {item[key].strip()[:80]!r} {found} the parent; copy one line exactly")
            where.append(hits[0])
        first, last = where
        if last < first:
            raise Rejected(f"edit {n}: to (line {last + 1}) comes before from (line {first + 1})")
        if not any(a <= first and last < b for a, b in blocks):
            raise Rejected(f"edit {n}: lines {first + 1}-{last + 1} are not inside one evolve block")
        new = item["replace"].splitlines()
        if any(EVOLVE_START in r or EVOLVE_END in r for r in new):
            raise Rejected(f"edit {n}: evolve-block markers may not be edited")
        if (first, last) in ranges or [x.rstrip() for x in new] == bare[first : last + 1]:
            continue  # a repeat, or no change
        clash = next(((a, b) for a, b in ranges if a <= last and first <= b), None)
        if clash is not None:
            raise Rejected(f"edit {n}: lines {first + 1}-{last + 1} overlap another edit's lines "
                           f"{clash[0] + 1}-{clash[1] + 1}")
        ranges[(first, last)] = new
    if not ranges:
        raise Rejected("the edits change nothing")
    for (first, last), new in sorted(ranges.items(), reverse=True):
        lines[first : last + 1] = new
    return "\n".join(lines) + ("\n" if source.endswith("\n") else "")


def _find(lines: list[str], search: list[str]) -> list[int]:
    want = [s.rstrip() for s in search]
    n = len(want)
    return [i for i in range(len(lines) - n + 1) if [x.rstrip() for x in lines[i : i + n]] == want]


def apply_edits(source: str, edits: list[Edit]) -> str:
    """``source`` with each edit applied in turn, each matching exactly once inside one evolve block."""
    lines = source.splitlines()
    for n, e in enumerate(edits, 1):
        if not any(s.strip() for s in e.search):
            raise Rejected(f"edit block {n}: empty SEARCH (copy the lines to replace from the parent)")
        if any(EVOLVE_START in r or EVOLVE_END in r for r in e.replace + e.search):
            raise Rejected(f"edit block {n}: evolve-block markers may not be edited")
        blocks = evolve_blocks("\n".join(lines))
        if not blocks:
            raise Rejected("the parent has no evolve block: nothing may be edited")
        hits = _find(lines, e.search)
        if not hits:
            raise Rejected(f"edit block {n}: SEARCH does not match the parent's source (first line: "
                           f"{e.search[0].strip()[:80]!r}); copy the lines exactly")
        inside = [i for i in hits if any(a <= i and i + len(e.search) <= b for a, b in blocks)]
        if not inside:
            raise Rejected(f"edit block {n}: SEARCH matches line {hits[0] + 1}, outside every evolve block; "
                           "only code between EVOLVE-BLOCK-START and EVOLVE-BLOCK-END may change")
        if len(inside) > 1:
            raise Rejected(f"edit block {n}: SEARCH matches {len(inside)} places; include more lines to pick one")
        i = inside[0]
        lines[i : i + len(e.search)] = e.replace
    out = "\n".join(lines) + ("\n" if source.endswith("\n") else "")
    if out == source:
        raise Rejected("the edits change nothing")
    return out


def _bodies(source: str) -> list[list[str]]:
    lines = source.splitlines()
    return [lines[a:b] for a, b in evolve_blocks(source)]


def splice_blocks(parent: str, code: str) -> str:
    """``parent`` with its evolve blocks replaced by those in ``code`` (or by ``code`` itself when it has
    no markers and the parent has exactly one block)."""
    try:
        blocks = evolve_blocks(parent)
        new = _bodies(code) if EVOLVE_START in code else [code.strip("\n").splitlines()]
    except ValueError as exc:
        raise Rejected(f"unbalanced evolve-block markers: {exc}") from None
    if not blocks:
        raise Rejected("the parent has no evolve block: nothing may be rewritten")
    if len(new) != len(blocks):
        raise Rejected(f"the answer has {len(new)} evolve block(s), the parent {len(blocks)}")
    lines = parent.splitlines()
    for (a, b), body in sorted(zip(blocks, new, strict=True), reverse=True):
        lines[a:b] = body
    out = "\n".join(lines) + ("\n" if parent.endswith("\n") else "")
    if out == parent:
        raise Rejected("the rewrite changes nothing")
    return out


def check_outside(parent: str, source: str) -> str:
    """``source`` if it differs from ``parent`` only inside evolve blocks, else :class:`Rejected` naming a line."""
    try:
        pb, sb = evolve_blocks(parent), evolve_blocks(source)
    except ValueError as exc:
        raise Rejected(f"unbalanced evolve-block markers: {exc}") from None
    if len(pb) != len(sb):
        raise Rejected(f"the source has {len(sb)} evolve block(s), the parent {len(pb)}; keep the markers")

    def outside(text: str, blocks: list[tuple[int, int]]) -> list[tuple[int, str]]:
        inner = {i for a, b in blocks for i in range(a, b)}
        return [(i, s.rstrip()) for i, s in enumerate(text.splitlines()) if i not in inner and s.strip()]

    po, so = outside(parent, pb), outside(source, sb)
    for (_, p), (i, s) in zip(po, so, strict=False):
        if p != s:
            raise Rejected(f"line {i + 1} ({s.strip()[:60]!r}) is outside every evolve block and differs from "
                           "the parent; only code between EVOLVE-BLOCK-START and EVOLVE-BLOCK-END may change")
    if len(po) != len(so):
        raise Rejected("lines were added or removed outside the evolve blocks; only their insides may change")
    return source


def extract_code(text: str) -> str:
    """The one fenced code block of an answer (the longest, if the model gave several)."""
    blocks = _FENCE.findall(text)
    if not blocks:
        raise Rejected("no fenced code block found (answer with one ```c ... ``` block)")
    return max(blocks, key=len)


def extract_json(text: str) -> dict[str, Any]:
    """The one JSON object of an answer (fenced or bare)."""
    candidates = [b for b in _FENCE.findall(text) if b.strip().startswith("{")]
    if not candidates:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end <= start:
            raise Rejected("no JSON object found (answer with one {...} object of parameter values)")
        candidates = [text[start : end + 1]]
    try:
        value = json.loads(candidates[0])
    except json.JSONDecodeError as exc:
        raise Rejected(f"invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise Rejected("the JSON must be one object mapping parameter names to values")
    return value
