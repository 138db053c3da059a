"""``evo memory`` and importing a real run's elites."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("faiss")

from click.testing import CliRunner  # noqa: E402
from memory_testlib import tiny_run  # noqa: E402

from archive import Store  # noqa: E402
from archive.memory import Memory, MemorySettings, entries_from_run  # noqa: E402
from evo.errors import UserError  # noqa: E402
from evo.memory_cli import memory  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("tiny"))


def evo_memory(*args: str, ok: bool = True) -> object:
    result = CliRunner().invoke(memory, list(args), catch_exceptions=True)
    if ok:
        assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_import_run_stores_the_elites(run_dir, tmp_path):
    entries = entries_from_run(run_dir)
    with Store(run_dir, readonly=True) as store:
        best = store.best(1)[0]
    assert entries and all(e.task == "matmul" and e.task_args["n"] == 64 for e in entries)
    (top,) = [e for e in entries if e.genome == best.genome]  # the run's best, as reported
    assert top.fitness == best.fitness and top.vs_reference > 0
    assert top.hardware["cpu_model"] and top.hardware["id"] and top.signature.startswith("void kernel(")
    assert top.run == str(run_dir.resolve()) and "matrix multiply" in top.summary
    with Memory(tmp_path, settings=MemorySettings(embedder="hash")) as mem:
        assert mem.import_run(run_dir) == len(entries)
        assert mem.import_run(run_dir) == 0


def test_cli_add_search_stats_export_import_prune(run_dir, tmp_path, minilm):
    path = str(tmp_path / "mem")
    out = evo_memory("--path", path, "add", str(run_dir)).output
    assert out.startswith("added ") and "elites" in out
    stats = json.loads(evo_memory("--path", path, "stats", "--json").output)
    assert stats["embedder"] == "minilm" and stats["entries"] >= 1 and stats["per_task"] == {"matmul": stats["entries"]}
    assert "entries, flat index" in evo_memory("--path", path, "stats").output
    hits = json.loads(evo_memory("--path", path, "search", "fast matrix multiply", "--k", "2", "--json").output)
    assert 1 <= len(hits) <= 2 and hits[0]["task"] == "matmul" and "score" in hits[0]
    assert "memory: fast" in evo_memory("--path", path, "search", "fast matrix multiply", "--task", "matmul").output
    assert json.loads(evo_memory("--path", path, "search", "x", "--task", "softmax", "--json").output) == []

    file = str(tmp_path / "mem.jsonl")
    assert f"wrote {stats['entries']} entries" in evo_memory("--path", path, "export", file).output
    other = str(tmp_path / "other")
    assert f"imported {stats['entries']} new" in evo_memory("--path", other, "import", file).output
    assert "imported 0 new" in evo_memory("--path", other, "import", file).output
    assert "1 remain" in evo_memory("--path", other, "prune", "--keep-best-per-task", "1").output


def test_cli_user_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOFORGE_MEMORY_DIR", str(tmp_path / "default"))
    r = evo_memory("search", "a blocked matmul", ok=False)  # searching a memory not made yet
    assert isinstance(r.exception, UserError) and "no memory in" in str(r.exception)
    assert str(tmp_path / "default") in str(r.exception)
    r = evo_memory("--path", str(tmp_path), "add", str(tmp_path / "nope"), ok=False)
    assert isinstance(r.exception, UserError) and "not a run directory" in str(r.exception)
    r = evo_memory("--path", str(tmp_path), "import", str(tmp_path / "nope.jsonl"), ok=False)
    assert isinstance(r.exception, UserError) and "no such file" in str(r.exception)
    r = evo_memory("--path", str(tmp_path / "h"), "--embedder", "bogus", "import", __file__, ok=False)
    assert isinstance(r.exception, UserError) and "unknown embedder" in str(r.exception)


def test_evo_memory_entry_point(run_dir, tmp_path):
    def evo(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "evo", "memory", *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)

    done = evo("--path", str(tmp_path / "m"), "--embedder", "hash", "add", str(run_dir))
    assert done.returncode == 0 and done.stdout.startswith("added "), done.stderr
    err = evo("--path", str(tmp_path / "none"), "search", "a blocked matmul")
    assert err.returncode == 2 and err.stderr.startswith("error: no memory in") and err.stderr.count("\n") == 1
    empty = evo("--path", str(tmp_path / "none"), "stats")
    assert empty.returncode == 0 and "0 entries" in empty.stdout


def test_stats_of_a_memory_not_made_yet_is_an_empty_summary(tmp_path):
    """An empty memory is a state, not an error: exit 0, zero entries, in text and JSON."""
    where = str(tmp_path / "not-yet")
    text = evo_memory("--path", where, "stats")
    assert "no memory yet, 0 entries" in text.output
    as_json = json.loads(evo_memory("--path", where, "stats", "--json").output)
    assert as_json["entries"] == 0 and as_json["per_task"] == {}
    assert not (tmp_path / "not-yet").exists()  # looking creates nothing
