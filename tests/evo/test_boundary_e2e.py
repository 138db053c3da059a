"""A probing kernel planted through the real path reaches every context that runs candidate code, and none of
them shows it a key, a socket, a file it can write, root or an unfiltered process.

The path (tests/evo/factory_testlib.py, probe_testlib.py): a gelu search whose scripted model endpoint answers
with the probing GELU, so that it becomes the search's best and enters the memory; the shared factory's gelu
search is seeded from that memory and its engine search tries an engine with it. Here the factory's own
measurements (profile and duel, :class:`evo.factory.measure.Measurer`) take that engine, and `evo serve
--follow` serves it once it is promoted. A key sits in the environment of every process that starts them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml
from factory_testlib import ROOT
from probe_testlib import SECRET, SECRET_ENV

from archive import Store
from evo.factory.config import FactoryConfig
from evo.factory.measure import Measurer

sys.path.insert(0, str(ROOT / "tests" / "serving"))


def _candidates(run: Path) -> list[tuple[str, str, dict, str]]:
    """(id, status, genome params, source) of the run's evaluated candidates."""
    with Store(run, readonly=True) as store:
        return [(c.id, str(c.status), dict(c.genome.params), c.genome.source or "") for c in store.evaluated()]


def _logs(where: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in where.rglob("*.log*") if p.is_file())


def test_a_probing_kernel_sees_no_key_socket_writable_file_root_or_unfiltered_process(factory, probe, tmp_path,
                                                                                      monkeypatch):
    from serve_helpers import start_server, stop

    env = {**os.environ, "OPENAI_API_KEY": SECRET, SECRET_ENV: SECRET}
    planted = factory.parent / "probe-run"
    ((probe_id, status, _, _),) = [c for c in _candidates(planted) if "EVOFORGE-PROBE-RAN" in c[3]]
    assert status == "ok"  # the search's best, proposed by the model endpoint
    assert [c[1] for c in _candidates(factory / "runs" / "gelu") if c[0] == probe_id] == ["ok"], \
        "the factory's gelu search was not seeded with it from the memory"
    holding = [(c[0], c[1]) for c in _candidates(factory / "runs" / "engine-r1")
               if probe_id.startswith(str(c[2].get("kernel_gelu")))]
    engines = [cid for cid, status in holding if status == "ok"]
    assert engines, f"the factory's engine search tried no engine with it: {holding}"
    engine = {"run_dir": str(factory / "runs" / "engine-r1"), "elite": engines[0]}

    fac = Path(shutil.copytree(factory, tmp_path / "fac"))  # measured and served from a copy: the fixture is shared
    config = FactoryConfig.model_validate(yaml.safe_load((fac / "factory.yaml").read_text()))
    for name in (SECRET_ENV, "OPENAI_API_KEY"):  # as in the factory's own environment
        monkeypatch.setenv(name, SECRET)
    measurer = Measurer(fac, config)
    try:
        profiled, dueled = measurer.profile(engine), measurer.duel(engine, None)
    finally:
        measurer.close()
    assert profiled.status.value == "ok" and dueled.status.value == "ok", (profiled.error, dueled.error)

    (fac / "promotions.jsonl").write_text(json.dumps({"round": 1, "run_dir": engine["run_dir"],
                                                      "elite": engine["elite"], "at": time.time()}) + "\n")
    srv = start_server(None, "--follow", str(fac), key=SECRET, env=env)
    try:
        status, _, headers = srv.call("POST", "/v1/embeddings", {"input": ["hello"]})
        assert status == 200 and headers["x-elite-id"] == engine["elite"]
    finally:
        stop(srv)
    served = srv.proc.stdout.read() if srv.proc.stdout else ""

    contexts = {"the planted search": _logs(planted), "the factory's gelu search": _logs(factory / "runs" / "gelu"),
                "the factory's engine search": _logs(factory / "runs" / "engine-r1"),
                "the factory's profile and duel": _logs(fac / "logs" / "measurements"), "the server": served}
    for where, text in contexts.items():
        assert "EVOFORGE-PROBE-RAN" in text, f"the probe never ran in {where}"
    everything = "".join(contexts.values()) + _logs(factory)
    saw = sorted({line for line in everything.splitlines() if "EVOFORGE-PROBE-SAW" in line})
    assert not saw, saw
    assert not probe.marker.exists() and not Path(f"{probe.marker}.created").exists()
    assert probe.listener.connections == 0


def test_without_the_filter_every_command_that_runs_candidates_says_so_loudly(tmp_path, monkeypatch):
    from cli_testlib import evo_here

    from runtime.sandbox import filters

    (tmp_path / "factory.yaml").write_text("{}\n")
    for args in (["serve", str(tmp_path / "no-run")], ["factory", "factory.yaml", "--dir", str(tmp_path / "f"),
                                                       "--resume"], ["run", str(tmp_path / "missing.yaml")]):
        quiet = evo_here(*args, cwd=tmp_path)
        assert "UNFILTERED" not in quiet.stderr, quiet.stderr
    monkeypatch.setattr(filters, "filter_available", lambda: False)
    for args in (["serve", str(tmp_path / "no-run")], ["factory", "factory.yaml", "--dir", str(tmp_path / "f"),
                                                       "--resume"]):
        loud = evo_here(*args, cwd=tmp_path)
        assert "candidate code runs UNFILTERED" in loud.stderr and loud.returncode == 2, (args, loud.stderr)
