"""Every engine slot has a task for a CPU with AVX2 and FMA only (AMD Zen 2 and 3 servers, Intel before
AVX-512): a slot task that needs an instruction has a sibling that does not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from evo.factory.plan import slot_tasks_for
from runtime.engine.ops import SLOTS, slot_task, tasks_of_slot

AVX2 = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "popcnt")  # x86-64-v3


@pytest.mark.parametrize("slot", SLOTS)
def test_every_slot_has_a_task_for_an_avx2_cpu(slot: str) -> None:
    tasks, why = slot_tasks_for(slot, AVX2, hidden=384, intermediate=1536)
    assert tasks, f"the {slot} slot has no task an AVX2 CPU runs: {why}"
    for name in tasks:
        assert not slot_task(slot, name).slot.missing(AVX2)


def test_a_task_needing_more_has_a_sibling_needing_less() -> None:
    for slot in SLOTS:
        for name in tasks_of_slot(slot):
            if slot_task(slot, name).slot.missing(AVX2):
                siblings = [t for t in tasks_of_slot(slot) if slot_task(slot, t).slot.stands_in_for == name]
                assert siblings, f"{name} needs more than AVX2 and no task of the {slot} slot stands in for it"


def test_the_avx2_mask_hides_the_wider_instructions_from_every_process() -> None:
    """EVOFORGE_CPU_ISA=avx2: this process's flags, the fingerprint, the compiler's -march and the caps of the
    libraries a worker inherits all say AVX2, whatever the CPU has."""
    code = (
        "import os, runtime, json\n"
        "from runtime.hardware import cpu_flags, fingerprint\n"
        "from runtime import isa\n"
        "print(json.dumps({'wide': sorted(f for f in cpu_flags() if f.startswith(('avx512', 'amx'))),"
        " 'isa': fingerprint().get('isa'), 'march': isa.march(), 'blas': os.environ.get('OPENBLAS_CORETYPE'),"
        " 'onednn': os.environ.get('ONEDNN_MAX_CPU_ISA')}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "EVOFORGE_CPU_ISA": "avx2"}, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    import json

    got = json.loads(out)
    assert got == {"wide": [], "isa": "avx2", "march": "-march=x86-64-v3", "blas": "Haswell", "onednn": "AVX2"}


def test_an_unknown_level_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "evo", "archive", "best", "nowhere"], capture_output=True,
                          text=True, env={**os.environ, "EVOFORGE_CPU_ISA": "avx9000"})  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: EVOFORGE_CPU_ISA='avx9000' is not a level evoforge knows: use one of native, avx2"]


@pytest.mark.parametrize("slot", ["linear", "attention", "rmsnorm", "lm_head"])
def test_every_chat_engine_slot_has_a_task_for_an_avx2_cpu(slot: str) -> None:
    """A chat factory's plan finds a kernel search for each of a chat engine's slots on a CPU with AVX2 and FMA
    alone (the GEMMs in q8 on ``linear_q8``, the LM head's top list on ``lm_head_topk``)."""
    from evo.factory.config import CHAT_SLOTS, FactoryConfig
    from evo.factory.kinds import kind_of
    from runtime.task import load_task_class

    assert slot in CHAT_SLOTS
    kind = kind_of(FactoryConfig.model_validate({"model": "smollm2"}))
    tasks, why = kind.slot_tasks(slot, AVX2)
    assert tasks, f"the chat engine's {slot} slot has no task an AVX2 CPU runs: {why}"
    for name in tasks:
        assert not load_task_class(name).slot.missing(AVX2)
