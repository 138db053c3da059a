"""The batcher keeps every request's result its own, never loses or duplicates one, refuses overflow."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from runtime.engine import Batcher, BatcherClosed, QueueFull
from runtime.engine.scheduler import length_class


class Recorder:
    """A batch function that returns each item transformed and records the batches it saw."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.lock = threading.Lock()
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, items: list[int]) -> list[int]:
        self.gate.wait()
        with self.lock:
            self.batches.append(list(items))
        if self.delay:
            time.sleep(self.delay)
        return [i * 10 + 1 for i in items]


@pytest.mark.parametrize("workers,bucketing", [(1, False), (3, False), (2, True)])
def test_concurrent_clients_get_their_own_results_none_lost_or_duplicated(workers, bucketing):
    rec = Recorder(delay=0.0005)
    n_clients, per_client = 8, 60
    results: dict[int, int] = {}
    lock = threading.Lock()
    with Batcher(rec, max_batch=7, token_budget=40, workers=workers, bucketing=bucketing, queue_size=10_000) as b:

        def client(c: int) -> None:
            futures: list[tuple[int, Future]] = []
            for k in range(per_client):
                item = c * per_client + k
                futures.append((item, b.submit(item, tokens=1 + item % 13)))
                if k % 3 == 0:  # some clients wait as they go (closed loop), some pile up
                    futures[-1][1].result()
            for item, fut in futures:
                got = fut.result(timeout=30)
                with lock:
                    assert item not in results
                    results[item] = got

        threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    total = n_clients * per_client
    assert results == {i: i * 10 + 1 for i in range(total)}  # each its own result
    seen = [i for batch in rec.batches for i in batch]
    assert sorted(seen) == list(range(total))  # each run exactly once
    for batch in rec.batches:
        assert 1 <= len(batch) <= 7
        assert len(batch) == 1 or sum(1 + i % 13 for i in batch) <= 40  # the token budget
        if bucketing:
            assert len({length_class(1 + i % 13) for i in batch}) == 1  # one length class per batch


def test_a_batch_takes_what_is_queued_in_order():
    rec = Recorder()
    rec.gate.clear()  # hold the worker on its first batch while more requests queue
    with Batcher(rec, max_batch=4, token_budget=1000) as b:
        futs = [b.submit(0)]
        time.sleep(0.05)
        futs += [b.submit(i) for i in range(1, 10)]
        rec.gate.set()
        assert [f.result(timeout=10) for f in futs] == [i * 10 + 1 for i in range(10)]
    assert rec.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]


def test_overflow_is_refused_not_buffered():
    rec = Recorder()
    rec.gate.clear()
    b = Batcher(rec, max_batch=1, queue_size=3)
    first = b.submit(0)
    time.sleep(0.05)  # the worker took it and waits at the gate: the queue is empty again
    queued = [b.submit(i) for i in (1, 2, 3)]
    with pytest.raises(QueueFull):
        b.submit(4)
    assert b.queued == 3
    rec.gate.set()
    assert first.result(timeout=10) == 1 and [f.result(timeout=10) for f in queued] == [11, 21, 31]
    b.close()
    with pytest.raises(BatcherClosed):
        b.submit(5)


def test_max_wait_collects_a_fuller_batch():
    rec = Recorder()
    with Batcher(rec, max_batch=8, max_wait_ms=300) as b:
        futs = [b.submit(0)]
        time.sleep(0.02)
        futs += [b.submit(i) for i in range(1, 4)]
        [f.result(timeout=10) for f in futs]
    assert rec.batches[0] == [0, 1, 2, 3]


def test_errors_reach_every_client_of_the_batch_and_the_batcher_goes_on():
    calls = []

    def run(items: list[int]) -> list[int]:
        calls.append(items)
        if 13 in items:
            raise ValueError("bad item")
        return items

    with Batcher(run, max_batch=1) as b:
        bad, good = b.submit(13), b.submit(1)
        with pytest.raises(ValueError, match="bad item"):
            bad.result(timeout=10)
        assert good.result(timeout=10) == 1


def test_length_classes():
    assert [length_class(t) for t in (1, 8, 9, 16, 17, 256)] == [8, 8, 16, 16, 32, 256]


def test_a_split_batch_runs_each_length_class_longest_first_and_answers_it_at_once():
    gate, calls, futs = threading.Event(), [], {}

    def run(items):
        gate.wait(10)
        # every class that ran before this one has its answers already
        calls.append((items, all(futs[i].done() for done, _ in calls for i in done)))
        return [i * 10 for i in items]

    tokens = {0: 5, 1: 9, 2: 100, 3: 30, 4: 120, 5: 8}  # classes 8, 16, 128, 32, 128, 8
    with Batcher(run, max_batch=8, split=True) as b:
        futs[0] = b.submit(0, tokens[0])
        time.sleep(0.05)  # the worker holds item 0 at the gate: the rest queue as one batch
        futs.update({i: b.submit(i, tokens[i]) for i in range(1, 6)})
        gate.set()
        assert [futs[i].result(timeout=10) for i in range(6)] == [0, 10, 20, 30, 40, 50]
    assert [items for items, _ in calls] == [[0], [2, 4], [3], [1], [5]]
    assert all(answered for _, answered in calls)
    assert b.batches == 2 and b.served == 6
