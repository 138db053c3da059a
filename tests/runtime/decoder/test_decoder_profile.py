"""The chat engine's profile under generative load: every slot timed, each GEMM by its matrix, and the parts add up
to the load's wall time."""

from __future__ import annotations

import pytest

from runtime.decoder import SchedulerConfig
from runtime.decoder.profile import profile_decoder

pytestmark = pytest.mark.xdist_group("decoder-tiny")


def test_a_profile_times_every_slot_and_accounts_for_the_whole_load(llama, sentences):
    dec = llama.decoder
    prompts = [dec.tokenizer.encode(s) for s in sentences[:4]]
    got = profile_decoder(dec, prompts, 6, SchedulerConfig(step_tokens=16))
    assert (got.requests, got.output_tokens, got.prompt_tokens) == (4, 24, sum(len(p) for p in prompts))
    assert got.steps >= 6 + sum(len(p) for p in prompts) // 16 - 1  # chunked prefill, then a step per token
    gemms = {"linear qkv", "linear o", "linear gate_up", "linear down"}
    assert gemms | {"lm_head", "attention", "rmsnorm", "rope", "swiglu"} <= set(got.slots), got.slots
    assert "linear other" not in got.slots and all(s > 0 for s in got.slots.values())
    assert sum(got.slots.values()) <= got.forward_s <= got.total_s
    assert abs(sum(got.shares().values()) - 1.0) < 1e-9
    assert got.table()[0][1] == max(got.parts.values())
