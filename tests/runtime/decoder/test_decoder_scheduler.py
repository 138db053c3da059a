"""The scheduler's KV cache budget when two engines share it, as they do while a swap lets the old one finish."""

from __future__ import annotations

import threading
import time

from runtime.decoder import SamplingParams, Scheduler, SchedulerConfig, kv_bytes_per_token


def test_two_schedulers_sharing_a_budget_never_hold_more_than_it(llama) -> None:
    """A budget for one generation: the new engine's request waits while the old engine's holds the cache, runs
    once it is freed, and both finish with the tokens they get alone."""
    dec = llama.decoder
    ids = dec.encode_prompt("What is the")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    need = (len(ids) + params.max_tokens) * kv_bytes_per_token(dec.model.config)
    config = SchedulerConfig(kv_budget_bytes=need)
    alone = dec.generate("What is the", params)
    old = Scheduler(dec, config)
    new = Scheduler(dec, config, held_elsewhere=lambda: old.kv_used_bytes)
    peak, watching = [0], threading.Event()

    def watch() -> None:
        while not watching.is_set():
            peak[0] = max(peak[0], old.kv_used_bytes + new.kv_used_bytes)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        first = old.submit(ids, params)
        second = new.submit(ids, params)
        assert new.waiting == 1 and new.running == 0  # the old engine holds the budget
        results = first.result(), second.result()
    finally:
        watching.set()
        watcher.join()
        old.close()
        new.close()
    assert [r.token_ids for r in results] == [alone.token_ids] * 2
    assert 0 < peak[0] <= need
