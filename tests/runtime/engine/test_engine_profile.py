"""An engine's profile attributes its time to the slots, the GEMM shapes, attention, tokenising and the rest."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from runtime.engine import Engine, EngineConfig, numpy_ops
from runtime.engine.ops import SLOTS
from runtime.engine.profile import Profile, profile_engine


def test_the_profile_accounts_for_the_whole_time(model, sentences):
    profile = profile_engine(Engine(model, numpy_ops(), EngineConfig(max_batch=8)), sentences[:24])
    assert (profile.texts, profile.batches) == (24, 3) and profile.tokens > 24
    assert set(profile.slots) == set(SLOTS) and all(v > 0 for v in profile.slots.values())
    assert set(profile.gemms) == {"k=384 n=1152", "k=384 n=384", "k=384 n=1536", "k=1536 n=384"}  # MiniLM's
    assert sum(profile.gemms.values()) == pytest.approx(profile.slots["linear"], rel=0.05)
    parts = sum(profile.slots.values()) + profile.attention_s + profile.tokenize_s + profile.other_s
    assert parts == pytest.approx(profile.total_s, rel=1e-6)
    assert sum(profile.shares().values()) == pytest.approx(1.0)
    assert profile.slots["linear"] == max(profile.slots.values())  # the GEMMs dominate a BERT forward pass
    again = Profile.from_dict(profile.to_dict())
    assert again == profile and again.table()[0][0] == "linear"


def test_a_slow_slot_shows_as_the_largest_share(model, sentences):
    ops = numpy_ops()

    def slow_softmax(x: np.ndarray) -> np.ndarray:
        time.sleep(0.02)
        return numpy_ops().softmax(x)

    slowed = replace(ops, softmax=slow_softmax)
    profile = profile_engine(Engine(model, slowed, EngineConfig(max_batch=8)), sentences[:16])
    # 2 batches x 6 layers x 20 ms at least
    assert profile.slots["softmax"] >= 0.24 and profile.table()[0][0] == "softmax"
