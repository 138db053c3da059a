"""The factory's measurements of whole engines, each in a child process of its own (``python -m
evo.factory.measure KIND`` with a JSON spec on stdin, the JSON answer on stdout): an engine's evolved
kernels never run in the factory's process.

- ``profile``: where the engine's time goes (:func:`runtime.engine.profile.profile_engine`);
- ``duel``: a candidate engine against the incumbent: minimum cosine to the fp32 engine on held-out texts
  (never a search's: their own salt), then alternating load rounds, both under the same load, pinned to
  the same cores, under the machine's timing lock (no search compiles or times meanwhile).

An engine is ``{"run_dir": ..., "elite": ...}``, or ``null`` for the default configuration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["HELD_OUT_SALT", "measure"]

HELD_OUT_SALT = (1 << 62) + 7  # the held-out texts' salt: a search's loads draw theirs at random below 2^63


def measure(kind: str, spec: dict[str, Any], *, timeout: float = 1800) -> dict[str, Any]:
    """Runs one measurement in a child process; raises RuntimeError with its error output when it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "evo.factory.measure", kind], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} measurement failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def _engine(which: dict[str, Any] | None, model: Any) -> Any:
    from archive import read_run
    from runtime.engine import Engine, EngineConfig, load_elite, numpy_ops

    if which is None:
        return Engine(model, numpy_ops(), EngineConfig())
    with read_run(which["run_dir"]) as run:
        return load_elite(run, which["elite"], runs=read_run, model=model)


def _task(spec: dict[str, Any]) -> Any:
    from runtime.engine.task import EngineTask

    return EngineTask({**spec["load"], "model_dir": spec.get("model_dir"), "seed": spec.get("seed", 0)})


def _profile(spec: dict[str, Any]) -> dict[str, Any]:
    from runtime.engine.profile import profile_engine

    task = _task(spec)
    engine = _engine(spec.get("engine"), task.model())
    try:
        return profile_engine(engine, task.texts()).to_dict()
    finally:
        engine.close()


def _duel(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from runtime.engine import closed_loop
    from runtime.engine.task import cosines
    from runtime.timing import TimingLock, pinned

    task = _task(spec)
    model = task.model()
    held = task.fresh_texts(HELD_OUT_SALT)
    held_out = [held[i] for i in range(spec["held_out_texts"])]
    reference = task.reference_embed(held_out)
    load = spec["load"]
    engines = {"candidate": _engine(spec["candidate"], model), "incumbent": _engine(spec.get("incumbent"), model)}
    out: dict[str, Any] = {name: {"rounds": []} for name in engines}
    try:
        for name, engine in engines.items():
            out[name]["similarity"] = float(np.min(cosines(engine.embed(held_out), reference)))
        lock = TimingLock(spec["lock_file"])
        with lock.held(), pinned(None, load["threads"]):
            for r in range(spec["rounds"]):
                for name, engine in engines.items():
                    engine.start()
                    try:
                        texts = task.fresh_texts(HELD_OUT_SALT + 1 + r)  # each round new texts, both alike
                        got = closed_loop(engine.submit, texts, concurrency=load["concurrency"],
                                          duration_s=spec["duration_s"], warmup_s=load["warmup_s"])  # fmt: skip
                    finally:
                        engine.stop()
                    out[name]["rounds"].append({"throughput": got.throughput, "p99_ms": got.p99_ms})
    finally:
        for engine in engines.values():
            engine.close()
    for name in engines:
        rounds = out[name]["rounds"]
        out[name]["throughput"] = float(np.median([r["throughput"] for r in rounds]))
        out[name]["p99_ms"] = float(np.median([r["p99_ms"] for r in rounds]))
    return out


if __name__ == "__main__":
    kinds = {"profile": _profile, "duel": _duel}
    if len(sys.argv) != 2 or sys.argv[1] not in kinds:
        sys.exit(f"usage: python -m evo.factory.measure {{{','.join(kinds)}}} < spec.json")
    print(json.dumps(kinds[sys.argv[1]](json.load(sys.stdin))))
