"""The backend protocol and the one cascade: the registry, each stage's rules on a toy backend, unsupported
stages refused, a backend named by a task as ``module:Class`` evaluated in the sandboxed pool, and no
backend name compared outside the registry."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest
import toy_backend
from runtime_helpers import make_settings, run
from toy_backend import ToyTask

from genome import Genome
from runtime import KernelTask, Task, TaskLoadError, TaskSpec, UnsupportedStage, backend_for, load_task_class
from runtime.backends import BACKENDS, STAGES, WorkerContext
from runtime.cascade import evaluate
from runtime.executors import EvalRequest, LocalPool
from runtime.result import Status
from runtime.task import BUILTIN_TASKS

pytestmark = pytest.mark.exclusive  # it measures time

ROOT = Path(__file__).resolve().parents[2]
TOY = TaskSpec(name="toy_backend:ToyTask")


def _request(workdir: str, params: dict, **kw) -> EvalRequest:
    g = Genome(params=params)
    return EvalRequest(key=g.id, genome=g, task=TOY, settings=make_settings(workdir), cache_dir=workdir,
                       sys_path=(os.path.dirname(toy_backend.__file__),), **kw)


def _eval(workdir: str, params: dict, **kw):
    ctx = WorkerContext(cache_dir=workdir, work_dir=workdir, lock=None, hardware={"id": "toy"})
    return evaluate(_request(workdir, params, **kw), ToyTask(), ctx)


def test_every_builtin_task_has_a_registered_backend_with_its_stages():
    offered = {}
    for name in BUILTIN_TASKS:
        cls = load_task_class(name)
        backend = backend_for(cls)
        assert backend.name == cls.backend and cls.backend in BACKENDS
        assert backend is backend_for(cls)  # one instance per process
        offered[cls.backend] = {s for s in STAGES if backend.supports(s)}
    assert offered == {
        "c": {"compile", "check", "full", "run", "duel"},
        "cuda": {"compile", "check", "full"},
        "engine": {"compile", "check", "full", "duel", "profile"},
        "chat_engine": {"compile", "check", "full", "profile", "duel"},
    }


def test_the_engine_task_is_not_a_kernel_task():
    cls = load_task_class("engine")
    assert issubclass(cls, Task) and not issubclass(cls, KernelTask)
    for kernel_only in ("template", "full_case", "inputs", "outputs", "reference", "kernel_args", "work"):
        assert not hasattr(cls, kernel_only), kernel_only
    assert issubclass(load_task_class("matmul"), KernelTask) and issubclass(load_task_class("matmul_cuda"), KernelTask)


def test_a_task_that_names_no_backend_is_refused(tmp_path, monkeypatch):
    (tmp_path / "no_backend_task.py").write_text(
        "from runtime import Task\nclass T(Task):\n    name = 't'\n    unit = 'x'\n"
        "    def space(self): ...\n    def seeds(self): ...\n    def render(self, g): ...\n")
    (tmp_path / "odd_backend_task.py").write_text(
        "from no_backend_task import T\nclass U(T):\n    backend = 'fpga'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskLoadError, match="names no backend: subclass runtime.KernelTask"):
        load_task_class("no_backend_task:T")
    known = "use one of c, chat_engine, cuda, engine or 'module:Class'"
    with pytest.raises(TaskLoadError, match=f"unknown backend 'fpga': {known}"):
        load_task_class("odd_backend_task:U")


@pytest.mark.parametrize(("stages", "has"), [("compile", {"compile_s"}), ("check", {"compile_s", "check_s"}),
                                              ("full", {"compile_s", "check_s", "time_s", "lock_wait_s"})])
def test_partial_stages_stop_where_asked(tmp_path, stages, has):
    r = _eval(str(tmp_path), {"speed": 3}, stages=stages)
    assert r.status is Status.OK and (r.fitness == 3.0) is (stages == "full")
    assert has <= set(r.timings) and not ({"compile_s", "check_s", "time_s"} - has) & set(r.timings)
    assert {"total_s", "calls_s", "overhead_s"} <= set(r.timings) and r.hardware == {"id": "toy"}
    assert r.metrics["toy_size"] == 1 and ("checked_trials" in r.metrics) is (stages != "compile")
    assert ("flagged" in r.metrics) is (stages == "full")
    assert all(p.closed for p in toy_backend.LOADED)


def test_an_implausible_speedup_is_confirmed_and_flagged(tmp_path):
    r = _eval(str(tmp_path), {"speed": 50})  # implausible_speedup defaults to 20
    assert r.status is Status.OK and r.metrics["flagged"] is True and r.fitness == 50
    lucky = _eval(str(tmp_path), {"speed": 50, "later_speed": 30})  # timed again: the slower figure counts
    assert lucky.fitness == 30 and lucky.metrics["vs_reference"] == 30 and lucky.metrics["fitness_first_timing"] == 50
    assert lucky.timings["time_s"] == pytest.approx(0.004)
    assert _eval(str(tmp_path), {"speed": 5}).metrics["flagged"] is False
    caught = _eval(str(tmp_path), {"speed": 50, "fail": "confirm"})
    assert caught.status is Status.WRONG and caught.fitness is None
    assert "on fresh inputs (on re-verifying an implausible 50.0x speed-up)" in caught.error
    assert _eval(str(tmp_path), {"speed": 5, "fail": "confirm"}).status is Status.OK  # plausible: not re-checked


@pytest.mark.parametrize(("fail", "status"), [("compile", Status.COMPILE_ERROR), ("load", Status.COMPILE_ERROR),
                                              ("check", Status.WRONG)])
def test_a_failing_stage_ends_the_result_with_its_status_and_metrics(tmp_path, fail, status):
    toy_backend.LOADED.clear()
    r = _eval(str(tmp_path), {"speed": 3, "fail": fail})
    assert r.status is status and r.fitness is None and r.error
    # a failed result keeps compile_cached and what its failure carries, nothing else
    expect = {"compile": {}, "load": {"compile_cached": False}, "check": {"compile_cached": False, "answer": 41}}
    assert r.metrics == expect[fail]
    assert all(p.closed for p in toy_backend.LOADED) and len(toy_backend.LOADED) == (fail == "check")


def test_a_duel_loads_both_and_a_rival_that_cannot_be_built_gives_no_verdict(tmp_path):
    rival = Genome(params={"speed": 2})
    won = _eval(str(tmp_path), {"speed": 6}, stages="duel", rival=rival)
    assert won.status is Status.OK and won.metrics["duel_ratio"] == 3.0 and won.metrics["duel_rival"] == rival.id
    broken = _eval(str(tmp_path), {"speed": 6}, stages="duel", rival=Genome(params={"speed": 2, "fail": "compile"}))
    assert broken.status is Status.COMPILE_ERROR and "could not be built: toy compiler says no" in broken.error
    assert _eval(str(tmp_path), {"speed": 6}, stages="duel").status is Status.INVALID  # no rival given


def test_an_unsupported_stage_is_refused_not_run_as_something_else(tmp_path):
    r = _eval(str(tmp_path), {"speed": 3}, stages="run")  # the toy program does not run on given inputs
    assert r.status is Status.INVALID and r.fitness is None
    assert "the toy backend cannot run stage 'run' (it offers: compile, check, full, duel)" in r.error
    for task, stage in (("softmax_cuda", "duel"), ("softmax_cuda", "run"), ("engine", "run")):
        cls = load_task_class(task)
        with pytest.raises(UnsupportedStage, match=f"the {cls.backend} backend cannot run stage '{stage}'"):
            backend_for(cls).require(stage)
    spec = TaskSpec(name="softmax_cuda")
    req = EvalRequest(key="k", genome=Genome(params={}), task=spec, settings=make_settings(str(tmp_path)),
                      cache_dir=str(tmp_path), stages="duel", rival=Genome(params={}))
    with LocalPool(workers=1) as pool, pytest.raises(UnsupportedStage):  # refused in the controller
        pool.submit(req)
    in_worker = evaluate(req, load_task_class("softmax_cuda")(), WorkerContext(str(tmp_path), None, None))
    assert in_worker.status is Status.INVALID and "cannot run stage 'duel'" in in_worker.error


def test_a_backend_named_by_its_task_runs_in_the_sandboxed_pool(tmp_path):
    with LocalPool(workers=1) as pool:
        ok = run(pool, _request(str(tmp_path), {"speed": 4}))
        assert ok.status is Status.OK and ok.fitness == 4.0 and ok.unit == "ops/s", ok.error
        assert ok.hardware and ok.hardware.get("id")  # the worker's own fingerprint
        duel = run(pool, dataclasses.replace(_request(str(tmp_path), {"speed": 4}), stages="duel",
                                             rival=Genome(params={"speed": 8})))
        assert duel.status is Status.OK and duel.metrics["duel_ratio"] == 0.5


_BACKEND_WORD = re.compile(r"(^|_)backend(_name|_ref)?$", re.IGNORECASE)


def _names_a_backend(node: ast.AST) -> bool:
    """Whether an expression reads a backend's name, whatever holds it: a variable or attribute named for it
    (``backend``, ``task.backend``, ``spec_backend``), a key or ``getattr`` of ``"backend"``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and _BACKEND_WORD.search(sub.id):
            return True
        if isinstance(sub, ast.Attribute) and _BACKEND_WORD.search(sub.attr):
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and _BACKEND_WORD.search(sub.value):
            return True
    return False


def _backend_name_comparisons(source: str, where: str = "<source>") -> list[str]:
    """Each comparison (``==``, ``!=``, ``in``, ``match``) that decides on a backend's name: both sides
    considered, whatever the holder of the name is called."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [s for s in sides if _names_a_backend(s)]
            literal = [s for s in sides if any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                                               for c in ast.walk(s))]  # fmt: skip
            if names and literal:
                found.append(f"{where}:{node.lineno}")
        elif isinstance(node, ast.Match) and _names_a_backend(node.subject):
            found.append(f"{where}:{node.lineno}")
    return found


def test_the_check_catches_a_backend_name_compared_under_any_name():
    caught = [
        'backend == "engine"', 'task.backend != "cuda"', 'spec["backend"] == "c"',
        'getattr(t, "backend", "") in ("engine", "cuda")', 'task_backend == "engine"',
        'match task.backend:\n    case "c": pass',
    ]
    for code in caught:
        assert _backend_name_comparisons(code), code
    for code in ('kind == "ray"', 'name == task.name', 'status in ("ok", "wrong")', 'x == 1',
                 'torch.backends.cpu.get_cpu_capability() == "AVX2"'):
        assert not _backend_name_comparisons(code), code


def test_no_code_outside_the_registry_compares_backend_names():
    packages = ("evo", "runtime", "serving", "archive", "genome", "bench")
    sources = [p for pkg in packages for p in (ROOT / pkg).rglob("*.py")]
    assert len(sources) > 50
    registry = ROOT / "runtime" / "backends" / "__init__.py"
    hits = [hit for p in sources if p != registry
            for hit in _backend_name_comparisons(p.read_text(), str(p.relative_to(ROOT)))]  # fmt: skip
    assert hits == []
