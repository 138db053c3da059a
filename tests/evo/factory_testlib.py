"""One small factory, run for real, shared by the tests that read a factory directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime" / "engine"))

from probe_testlib import SECRET, SECRET_ENV, Listener, probe_block, probe_source  # noqa: E402


def evo(*args: str, cwd: Path, timeout: float = 900, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "evo", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)  # fmt: skip


def tiny_factory(tmp: Path, **sections: dict) -> dict:
    """A factory config on a small random BERT (saved in ``tmp/tiny-bert``) with budgets of a test; each of
    ``sections`` updates that section."""
    from bert_models import make_bert

    make_bert(tmp / "tiny-bert", hidden=64, heads=4, layers=2, intermediate=128)
    cfg = {
        "model_dir": "tiny-bert",
        "load": {"threads": 2, "concurrency": 2, "duration_s": 0.3, "warmup_s": 0.05, "texts": 16,
                 "lengths": {10: 1.0}, "p99_budget_ms": 10000},
        "budget": {"rounds": 1, "kernel_evals": 4, "engine_evals": 3, "engine_after_kernels": 1, "min_evals": 2,
                   "confirm_repeats": 1},
        "plan": {"slots": ["gelu", "layernorm"], "min_share": 0.0},
        "promote": {"held_out_texts": 16, "rounds": 1, "duration_s": 0.5, "min_gain": -0.5},
    }  # fmt: skip
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def _processes_naming(path: Path) -> list[str]:
    """Command lines of the live processes that name ``path`` (a factory's searches)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in cmd:
            out.append(cmd)
    return out


def _logs_named(text: str, logs: Path) -> str:
    """The ends of the search logs ``text`` names (where a failed factory says to look)."""
    return "".join(f"\n--- {log}:\n{log.read_text(errors='replace')[-4000:]}" for log in sorted(logs.glob("*.log"))
                   if str(log) in text)  # fmt: skip


@dataclass
class Probe:
    """The probing GELU's marker file (it writes what it saw there, when it can write) and its listener."""

    marker: Path
    listener: Listener = field(default_factory=Listener)

    def source(self) -> str:
        return probe_source(self.marker, self.listener.port)


def plant_probe(tmp: Path, probe: Probe, env: dict[str, str]) -> Path:
    """A gelu search at the tiny BERT's shape whose model endpoint (scripted) answers with the probing GELU: it
    becomes the search's best and enters the memory of ``env``. Returns the run's directory."""
    from llm_testlib import KEY_ENV, FakeLLM, Reply

    answer = "A faster GELU:\n```c\n" + probe_block(probe.marker, probe.listener.port) + "\n```\n"
    with FakeLLM([Reply(text=answer)]) as llm:
        cfg = {
            "task": {"name": "probe_testlib:NaiveGelu", "args": {"rows": 2048, "cols": 128}},
            "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 5, "min_repeats": 3}, "check_trials": 1},
            "search": {"workers": 1, "initial_random": 0, "operators": {"weights": {"llm_rewrite": 1.0}},
                       "confirm": {"repeats": 0}},
            "budget": {"max_evals": 2},
            "archive": {"descriptors": ["source_lines"], "bins": 8, "ranges": [[0, 200]]},
            "llm": {"models": [{"base_url": llm.url, "model": "scripted", "api_key_env": KEY_ENV}]},
        }  # fmt: skip
        (tmp / "probe.yaml").write_text(yaml.safe_dump(cfg))
        done = evo("run", "probe.yaml", "--run-dir", "probe-run", cwd=tmp, timeout=300,
                   env={**env, KEY_ENV: "scripted", "PYTHONPATH": str(Path(__file__).parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "probe-run"


def killed_and_resumed_factory(tmp: Path, probe: Probe) -> Path:
    """A one-round factory on a small random BERT, killed with -9 (the factory alone) once its first kernel
    search is done and its engine search is running alongside the second, then resumed. Its memory holds the
    probing GELU (:func:`plant_probe`), and a key sits in its environment."""
    cfg = tiny_factory(tmp, budget={"engine_evals": 8, "engine_after_kernels": 5})  # room for every offer
    (tmp / "factory.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "EVOFORGE_MEMORY_DIR": str(tmp / "memory"), "OPENAI_API_KEY": SECRET, SECRET_ENV: SECRET}
    plant_probe(tmp, probe, env)
    out = tmp / "fac"
    proc = subprocess.Popen([sys.executable, "-m", "evo", "factory", "factory.yaml", "--dir", str(out)], cwd=tmp,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not list((out / "runs").glob("*/factory-rounds.json")) and time.monotonic() < deadline:
        assert proc.poll() is None, "the factory ended before its first kernel search did"
        time.sleep(0.2)
    assert (out / "runs" / "engine-r1" / "archive.db").exists(), "no engine search alongside the kernel searches"
    os.kill(proc.pid, signal.SIGKILL)  # the factory only: its searches die with it
    proc.wait()
    deadline = time.monotonic() + 30
    while _processes_naming(out):
        assert time.monotonic() < deadline, f"searches outlived their factory: {_processes_naming(out)}"
        time.sleep(0.2)
    assert not (out / "duels" / "round-1.json").exists()
    searched = {p.parent.name: p.read_text() for p in (out / "runs").glob("*/factory-rounds.json")}
    resumed = evo("factory", "factory.yaml", "--dir", str(out), "--resume", cwd=tmp, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:] + _logs_named(resumed.stderr, out / "logs")
    for task, rounds in searched.items():  # the kernel searches that were done: not run again
        assert (out / "runs" / task / "factory-rounds.json").read_text() == rounds
    return out
