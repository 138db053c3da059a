"""Process workers: same embeddings as thread workers, errors and crashes reach the clients, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from runtime.engine import Engine, EngineConfig
from runtime.engine.engine import fit_threads
from runtime.engine.ops import numpy_ops
from runtime.engine.workers import ProcessWorkers, WorkerDied
from runtime.sandbox.hosted_engine import statm_mb


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone as far as the engine is concerned
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_process_workers_embed_like_the_in_process_engine(model, sentences):
    texts = sentences[:40]
    expected = Engine(model, numpy_ops(), EngineConfig()).embed(texts)
    engine = Engine(model, numpy_ops(), EngineConfig(workers=2, worker_kind="process", max_batch=4))
    results: dict[int, np.ndarray] = {}

    def client(k: int) -> None:
        for i in range(k, len(texts), 4):
            results[i] = engine.submit(texts[i]).result(timeout=60)

    with engine:
        pids = engine.worker_pids
        assert len(pids) == 2 and os.getpid() not in pids and all(_alive(p) for p in pids)
        # memory as the engine backend counts it: the first process whole, the others less the shared weights
        whole = statm_mb([os.getpid()], 0)
        assert statm_mb([os.getpid(), *pids], 0) > statm_mb([os.getpid(), *pids], model.nbytes()) >= whole
        clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert engine.batches >= 10  # batches of at most 4 requests
    assert sorted(results) == list(range(len(texts)))
    got = np.stack([results[i] for i in range(len(texts))])
    np.testing.assert_allclose(got, expected, atol=2e-6)
    assert not any(_alive(p) for p in pids)  # close() stops the children
    with pytest.raises(RuntimeError, match="start"):
        engine.submit(texts[0])


def test_a_stopped_engine_starts_again_with_its_kernels(model, sentences, tmp_path):
    from runtime.engine import KernelSource, build_ops
    from runtime.settings import CompilerSettings
    from runtime.task import load_task_class

    gelu = load_task_class("gelu")()
    ks = KernelSource("gelu", "t", gelu.render(gelu.seeds()[1]), ())
    engine = Engine(model, build_ops({"gelu": ks}, compiler=CompilerSettings(), cache_dir=str(tmp_path)),
                    EngineConfig(workers=2, worker_kind="process"))
    want = Engine(model, numpy_ops(), EngineConfig()).embed(sentences[:3])
    try:
        for _ in range(2):
            engine.start()
            got = np.stack([engine.submit(s).result(timeout=60) for s in sentences[:3]])
            engine.stop()
            np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        engine.close()
    assert not engine.ops.kernels


def _fails_on_empty(seqs):
    if any(len(s) == 0 for s in seqs):
        raise ValueError("an empty sequence")
    return np.stack([np.full(3, float(len(s)), np.float32) for s in seqs])


def test_the_children_left_serve_when_one_dies():
    workers = ProcessWorkers(_fails_on_empty, 2)
    try:
        os.kill(workers.pids[0], signal.SIGKILL)
        results = []
        for _ in range(4):  # the dead one fails at most one batch, then the other serves them all
            try:
                results.append(workers([np.zeros(4, np.int32)]))
            except WorkerDied:
                results.append(None)
        assert sum(r is None for r in results) <= 1 and workers.alive == 1
        assert results[-1].tolist() == [[4, 4, 4]]
    finally:
        workers.close()


def test_an_error_in_a_worker_process_reaches_the_caller_and_the_worker_goes_on():
    workers = ProcessWorkers(_fails_on_empty, 1)
    try:
        with pytest.raises(RuntimeError, match="ValueError: an empty sequence"):
            workers([np.zeros(0, np.int32)])
        np.testing.assert_array_equal(workers([np.zeros(5, np.int32)]), [[5, 5, 5]])
    finally:
        workers.close()


def test_a_crashed_worker_process_fails_its_batch_instead_of_hanging():
    workers = ProcessWorkers(_fails_on_empty, 1)
    try:
        (pid,) = workers.pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=f"{pid} died"):
            workers([np.zeros(2, np.int32)])
        assert workers.alive == 0
        with pytest.raises(WorkerDied, match="every engine worker process has died"):  # at once, never a hang
            workers([np.zeros(2, np.int32)])
    finally:
        workers.close()
    assert not _alive(pid)


@pytest.mark.parametrize(("asked", "cores", "fitted"), [
    ((2, 1), 2, (2, 1)), ((2, 2), 2, (2, 1)), ((1, 4), 2, (1, 2)), ((4, 1), 2, (2, 1)), ((3, 3), 1, (1, 1)),
    ((2, 3), 8, (2, 3)),
])
def test_threads_never_exceed_the_cores(asked, cores, fitted):
    assert fit_threads(*asked, cores) == fitted


def test_an_engine_pinned_to_one_core_runs_one_thread(model):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to pin to one")
    code = (
        "import os\nos.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "from runtime.engine import Engine, EngineConfig, load_model, numpy_ops\n"
        "e = Engine(load_model(), numpy_ops(), EngineConfig(workers=2, blas_threads=2, worker_kind='process'))\n"
        "with e:\n    e.submit('one core').result(timeout=60)\n    print(e.threads, len(e.worker_pids))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "(1, 1) 1"
    assert "exceed the 1 core(s)" in out.stderr


def test_openmp_kernels_run_on_thread_workers_never_in_forked_children(model, sentences, tmp_path, caplog):
    """GNU OpenMP hangs in a child forked after it ran in the parent: such an engine keeps its workers in threads."""
    from runtime.engine import KernelSource, build_ops
    from runtime.settings import CompilerSettings
    from runtime.task import load_task_class

    gelu = load_task_class("gelu")({"threads": 2})
    ks = KernelSource("gelu", "t", gelu.render(gelu.seeds()[1]), tuple(gelu.compile_flags()))
    ops = build_ops({"gelu": ks}, compiler=CompilerSettings(), cache_dir=str(tmp_path))
    assert ops.kernels["gelu"].openmp
    engine = Engine(model, ops, EngineConfig(workers=2, worker_kind="process"))
    want = Engine(model, numpy_ops(), EngineConfig()).embed(sentences[:2])
    with caplog.at_level("WARNING"):
        engine.start()
    try:
        assert engine.worker_kind == "thread" and engine.worker_pids == []
        got = np.stack([engine.submit(s).result(timeout=60) for s in sentences[:2]])
        np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        engine.close()
    assert "OpenMP kernels cannot run in forked workers" in caplog.text


def test_the_bulk_path_runs_longest_first_and_answers_in_the_order_of_the_texts(model, sentences):
    texts = [" ".join([sentences[i]] * (1 + i % 3)) for i in range(24)]  # three lengths, interleaved
    expected = Engine(model, numpy_ops(), EngineConfig()).embed(texts)
    engine = Engine(model, numpy_ops(), EngineConfig(workers=1, max_batch=4, bucketing="none"))
    lengths: list[int] = []
    forward = engine.run_batch

    def run_batch(seqs):  # the engine's own forward, recording the order it runs in
        lengths.extend(len(s) for s in seqs)
        return forward(seqs)

    engine.run_batch = run_batch  # type: ignore[method-assign]
    with engine:
        got = np.stack([f.result(timeout=60) for f in engine.submit_all(texts)])
    np.testing.assert_allclose(got, expected, atol=2e-6)
    assert len(lengths) == len(texts) and lengths == sorted(lengths, reverse=True)
