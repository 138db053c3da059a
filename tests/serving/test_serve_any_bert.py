"""Another encoder end to end: an engine search for a random-weight BERT of another shape (built here,
nothing downloaded), then `evo serve` of its best, answering under the model's own name with the
embeddings sentence-transformers computes for that model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from serve_helpers import start_server, stop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "engine"))
from bert_models import encode, make_bert  # noqa: E402

pytest.importorskip("sentence_transformers")

TEXTS = ["a short one", "the engine serves another encoder", "pooling by the first token, not the mean",
         "no normalisation either: the vectors keep their length"]  # fmt: skip


def test_a_search_and_a_server_for_another_bert(tmp_path):
    model = make_bert(tmp_path / "tiny-bert", hidden=96, heads=3, layers=2, intermediate=200, act="gelu_new",
                      pooling="cls", normalize=False)  # fmt: skip
    cfg = {
        "task": {"name": "engine", "args": {"model_dir": "tiny-bert", "threads": 2, "concurrency": 2,
                                            "duration_s": 0.3, "warmup_s": 0.05, "texts": 8, "lengths": {10: 1.0},
                                            "p99_budget_ms": 10000}},
        "search": {"workers": 1, "initial_random": 1, "confirm": {"repeats": 1}}, "budget": {"max_evals": 2},
        "archive": {"descriptors": ["p99_ms", "memory_mb"], "bins": [3, 3], "ranges": [[0, 10000], [0, 4096]]},
        "memory": {"enabled": False},
    }  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(run)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    srv = start_server(run)
    try:
        status, models, _ = srv.call("GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "tiny-bert" and models["data"][0]["dimensions"] == 96
        status, body, _ = srv.call("POST", "/v1/embeddings", {"input": TEXTS})
        assert status == 200 and body["model"] == "tiny-bert", body
        status, wrong, _ = srv.call("POST", "/v1/embeddings", {"input": "x", "model": "all-MiniLM-L6-v2"})
        assert status == 404 and wrong["error"]["code"] == "model_not_found"  # not the model served
    finally:
        stop(srv)
    got = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], np.float32)
    want = encode(model, TEXTS)
    cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3)
