"""Rejecting near-duplicate code genomes before they are evaluated (cosine similarity within one run)."""

from __future__ import annotations

import re

from archive.memory._embed import Embedder
from archive.memory._index import load_faiss
from genome import evolve_blocks

__all__ = ["NoveltyFilter", "code_text"]

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def code_text(source: str) -> str:
    """What novelty compares: the evolve blocks (else the whole source), comments dropped, spaces collapsed."""
    lines = source.splitlines()
    try:
        blocks = evolve_blocks(source)
    except ValueError:
        blocks = []
    text = "\n".join("\n".join(lines[a:b]) for a, b in blocks) if blocks else source
    return " ".join(_COMMENT.sub(" ", text).split())


class NoveltyFilter:
    """Remembers the texts evaluated in this run; a new one within ``threshold`` (cosine) of any is not novel.

    ``threshold=None`` accepts everything. ``accepted`` and ``rejected`` count :meth:`is_novel`'s answers.
    """

    def __init__(self, embedder: Embedder, threshold: float | None) -> None:
        self.embedder = embedder
        self.threshold = threshold
        self._index = load_faiss().IndexFlatIP(embedder.dim)
        self.accepted = 0
        self.rejected = 0

    def similarity(self, text: str) -> float:
        """The highest cosine similarity of ``text`` to a text seen so far (-1 when none)."""
        if self._index.ntotal == 0:
            return -1.0
        scores, _ = self._index.search(self.embedder.embed([text]), 1)
        return float(scores[0, 0])

    def is_novel(self, text: str) -> bool:
        """Whether ``text`` is farther than the threshold from everything seen (counted)."""
        novel = self.threshold is None or self.similarity(text) < self.threshold
        if novel:
            self.accepted += 1
        else:
            self.rejected += 1
        return novel

    def add(self, text: str) -> None:
        """Records a text as evaluated in this run."""
        self._index.add(self.embedder.embed([text]))

    def __len__(self) -> int:
        return int(self._index.ntotal)
