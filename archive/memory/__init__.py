"""The memory of discoveries: what earlier runs found, shared by runs, to seed, prompt and deduplicate.

``Memory`` keeps entries in SQLite and a FAISS index beside them; ``nearest_for_task`` and
``seed_genomes`` turn them into seeds of a new run; ``NoveltyFilter`` rejects near-duplicate code.
Needs the ``memory`` extra (faiss-cpu, the bundled MiniLM, and what evoforge's engine reads it with).
"""

from archive.memory._db import MemoryStoreError
from archive.memory._embed import Embedder, HashEmbedder, MiniLMEmbedder, make_embedder
from archive.memory._entry import EntryKind, MemoryEntry, MemoryHit, hardware_id, summary_text
from archive.memory._memory import Memory
from archive.memory._novelty import NoveltyFilter, code_text
from archive.memory._run_elites import entries_from_run
from archive.memory._seeding import SEED_WEIGHTS, map_params, quality_ranks, seed_genomes, seed_score
from archive.memory._settings import MEMORY_DIR_ENV, MemorySettings, default_memory_dir

__all__ = [
    "MEMORY_DIR_ENV",
    "SEED_WEIGHTS",
    "Embedder",
    "EntryKind",
    "HashEmbedder",
    "Memory",
    "MemoryEntry",
    "MemoryHit",
    "MemorySettings",
    "MemoryStoreError",
    "MiniLMEmbedder",
    "NoveltyFilter",
    "code_text",
    "default_memory_dir",
    "entries_from_run",
    "hardware_id",
    "make_embedder",
    "map_params",
    "quality_ranks",
    "seed_genomes",
    "seed_score",
    "summary_text",
]
