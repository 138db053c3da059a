"""Seeding from the memory (ranking, params carried across spaces) and rejecting near-duplicate code."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("faiss")

from memory_testlib import ELSEWHERE, HERE, MATMUL_SIG, matmul, softmax  # noqa: E402

from archive.memory import (  # noqa: E402
    Memory,
    MemoryEntry,
    MemoryHit,
    NoveltyFilter,
    code_text,
    map_params,
    seed_genomes,
)
from genome import ChoiceParam, FloatParam, Genome, IntParam, ParamSpace, Pow2Param  # noqa: E402

C_DIR = Path(__file__).parents[2] / "runtime" / "tasks" / "c"

SPACE = ParamSpace(
    {
        "MR": IntParam(type="int", low=1, high=16),
        "NR": IntParam(type="int", low=8, high=64, step=8),
        "UNROLL": Pow2Param(type="pow2", low=1, high=8),
        "ORDER": ChoiceParam(type="choice", values=("JPI", "PJI")),
        "ALPHA": FloatParam(type="float", low=0.0, high=1.0),
    },
    ["MR * NR <= 256"],
)


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def test_map_params_clamps_snaps_drops_and_fills():
    free = ParamSpace(dict(SPACE.params))  # no constraints: values are only clamped/snapped
    point = map_params({"MR": 20, "NR": 50, "OLD": 3, "ORDER": "XYZ", "ALPHA": 7.5}, free, rng())
    assert point is not None and free.is_valid(point)
    assert point["MR"] == 16 and point["NR"] == 48 and point["ALPHA"] == 1.0 and point["ORDER"] == "JPI"
    assert "OLD" not in point and point["UNROLL"] in (1, 2, 4, 8)  # missing in the old point: drawn


def test_map_params_repairs_constraints():
    point = map_params({"MR": 16, "NR": 64, "UNROLL": 4, "ORDER": "PJI", "ALPHA": 0.5}, SPACE, rng())
    assert point is not None and SPACE.is_valid(point) and point["MR"] * point["NR"] <= 256
    assert point["UNROLL"] == 4 and point["ORDER"] == "PJI"  # what the constraint does not name is kept
    ok = {"MR": 4, "NR": 32, "UNROLL": 2, "ORDER": "JPI", "ALPHA": 0.25}
    assert map_params(ok, SPACE, rng()) == ok


def test_map_params_gives_none_when_impossible():
    assert map_params({"VEC": 16}, SPACE, rng()) is None  # nothing in common: a random point is no seed
    never = ParamSpace({"MR": IntParam(type="int", low=1, high=4)}, ["MR > 100"])
    assert map_params({"MR": 3}, never, rng()) is None


def test_seed_genomes_reuses_code_only_for_the_same_signature():
    task = SimpleNamespace(name="matmul", signature=MATMUL_SIG)
    code = "void kernel(int M, int N, int K, const float *A, const float *B, float *C) { }"
    same = matmul(4, 32, source=code, run="runs/a")
    other_sig = matmul(4, 32, n=512, source=code, run="runs/b", signature="void kernel(int n, float *x)")
    template = matmul(12, 64, run="runs/c")
    unrelated = MemoryEntry(task="rmsnorm", task_args={}, genome=Genome(params={"VEC": 8}), run="runs/d")
    hits = [MemoryHit(e, 1.0, 1.0) for e in (same, other_sig, template, template, unrelated)]
    seeds = seed_genomes(hits, task, SPACE, rng())
    assert [run for _, run in seeds] == ["runs/a", "runs/b", "runs/c"]  # the duplicate and the unrelated dropped
    (g1, _), (g2, _), (g3, _) = seeds
    assert g1.source == code and g2.source is None and g3.source is None
    assert all(SPACE.is_valid(g.params) for g in (g1, g2, g3))
    assert g1.params["MR"] == 4 and g1.params["NR"] == 32


def test_seeding_ranks_same_task_and_hardware_first(tmp_path, minilm):
    with Memory(tmp_path, embedder=minilm) as mem:
        mem.add([
            matmul(8, 48, n=1024, vs=1.0),                       # same task, here
            matmul(6, 48, n=1024, vs=1.3, hardware=ELSEWHERE),   # fitter, but measured elsewhere
            matmul(4, 32, n=1024, vs=0.4),                       # here, but slow
            softmax(hardware=HERE, vs=3.0),                      # another task
            matmul(9, 48, n=1024, vs=1.2, kind="failure"),       # failures never seed
        ])  # fmt: skip
        hits = mem.nearest_for_task("matmul", {"m": 768, "n": 768, "k": 768, "threads": 1}, HERE, k=4)
    got = [(h.entry.genome.params.get("MR"), h.entry.hardware["id"]) for h in hits]
    assert got[0] == (8, HERE["id"])
    assert hits[-1].entry.task == "softmax" and len(hits) == 4
    assert all(h.entry.kind == "improvement" for h in hits)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_novelty_rejects_a_near_identical_source_and_accepts_another(minilm):
    naive = (C_DIR / "matmul_naive.c").read_text()
    f = NoveltyFilter(minilm, 0.98)
    assert f.is_novel(code_text(naive))
    f.add(code_text(naive))
    cosmetic = naive.replace("float sum", "/* accumulate */ float sum").replace("    ", "  ").replace("k++", "++k")
    assert not f.is_novel(code_text(cosmetic))
    assert f.is_novel(code_text((C_DIR / "softmax_naive.c").read_text()))
    assert (f.accepted, f.rejected, len(f)) == (2, 1, 1)
    off = NoveltyFilter(minilm, None)
    off.add(code_text(naive))
    assert off.is_novel(code_text(naive))


def test_memory_seeds_take_at_most_a_quarter_of_a_runs_budget(tmp_path, minilm):
    """A small search seeded with all of ``seed_k`` would spend its budget measuring past discoveries again (a
    factory's 10-evaluation engine search got 7 of them): at most a quarter of ``max_evals``, one at least."""
    from archive.memory import MemorySettings
    from evo.memory_link import MemoryLink
    from runtime.tasks.matmul import Matmul

    task = Matmul({"m": 1024, "n": 1024, "k": 1024})
    with Memory(tmp_path, embedder=minilm) as mem:
        mem.add([matmul(mr, nr, vs=1.0 + mr / 100) for mr in (2, 4, 6, 8) for nr in (16, 32, 48)])
        link = MemoryLink(mem, MemorySettings(seed_k=8, novelty_threshold=None), task, "runs/new")
        try:
            counts = {n: len(link.seeds(task.space(), HERE, 0, max_evals=n)) for n in (None, 200, 10, 2)}
        finally:
            link.close()
    assert counts == {None: 8, 200: 8, 10: 2, 2: 1}, counts
