"""One small factory, run for real, shared by the tests that read a factory directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime" / "engine"))


def evo(*args: str, cwd: Path, timeout: float = 900, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "evo", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)  # fmt: skip


def killed_and_resumed_factory(tmp: Path) -> Path:
    """A one-round factory on a small random BERT, killed with -9 during its engine search and resumed."""
    from bert_models import make_bert

    make_bert(tmp / "tiny-bert", hidden=64, heads=4, layers=2, intermediate=128)
    cfg = {
        "model_dir": "tiny-bert",
        "load": {"threads": 2, "concurrency": 2, "duration_s": 0.3, "warmup_s": 0.05, "texts": 16,
                 "lengths": {10: 1.0}, "p99_budget_ms": 10000},
        "budget": {"rounds": 1, "kernel_evals": 4, "engine_evals": 3, "min_evals": 2},
        "plan": {"slots": ["gelu", "layernorm"], "min_share": 0.0},
        "promote": {"held_out_texts": 16, "rounds": 1, "duration_s": 0.5, "min_gain": -0.5},
    }  # fmt: skip
    (tmp / "factory.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "EVOFORGE_MEMORY_DIR": str(tmp / "memory")}
    out = tmp / "fac"
    proc = subprocess.Popen([sys.executable, "-m", "evo", "factory", "factory.yaml", "--dir", str(out)], cwd=tmp,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not (out / "runs" / "engine-r1" / "archive.db").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, "the factory ended before its engine search"
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "duels" / "round-1.json").exists()
    searched = {t: json.loads((out / "runs" / t / "factory-rounds.json").read_text()) for t in ("gelu", "layernorm")}
    resumed = evo("factory", "factory.yaml", "--dir", str(out), "--resume", cwd=tmp, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for task, rounds in searched.items():  # the kernel searches were done: not run again
        assert json.loads((out / "runs" / task / "factory-rounds.json").read_text()) == rounds
    return out
