"""The engine task: its space and seeds, and one evaluation in this process (no sandbox) per outcome."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml

from genome import Genome
from runtime.backends import backend_for
from runtime.cascade import WorkerContext, evaluate
from runtime.engine.task import EngineTask
from runtime.executors import EvalRequest
from runtime.result import Status
from runtime.settings import EvalSettings, TaskSpec
from runtime.task import load_task_class
from runtime.timing import TimingLock

pytestmark = pytest.mark.exclusive  # it measures time

TINY = {"threads": 2, "concurrency": 3, "duration_s": 0.4, "warmup_s": 0.1, "texts": 16, "lengths": {10: 1.0},
        "precisions": ["fp32", "int8"], "p99_budget_ms": 10000}


@pytest.fixture(scope="module")
def task(model):
    t = EngineTask(TINY)
    t.share_model(model)
    t.prime()
    return t


def test_builtin_engine_task_space_and_seeds():
    cls = load_task_class("engine")
    assert cls is EngineTask and cls.backend == "engine"
    t = cls(TINY)
    space = t.space()
    assert {"max_batch", "max_wait_ms", "token_budget", "bucketing", "pack", "workers", "worker_kind",
            "blas_threads", "precision"} == set(space.names())
    assert yaml.safe_load(yaml.safe_dump(space.to_dict()))  # YAML-able
    for g in t.seeds():
        assert space.is_valid(g.params)
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = space.sample(rng)
        assert p["workers"] * p["blas_threads"] <= 2
        assert t.engine_config(Genome(params=p)).workers == p["workers"]
    assert "max_batch: 32" in t.render(t.seeds()[0])


def _request(task: EngineTask, params: dict, tmp_path, **args) -> tuple[EvalRequest, EngineTask]:
    spec = TaskSpec(name="engine", args={**TINY, **args})
    t = EngineTask(spec.args)
    t.share_model(task.model())
    t._reference = task._reference_embeddings()
    g = Genome(params={**t.seeds()[0].params, **params})
    req = EvalRequest(key=g.id, genome=g, task=spec, settings=EvalSettings(), cache_dir=str(tmp_path))
    return req, t


def _ctx(tmp_path) -> WorkerContext:
    return WorkerContext(cache_dir=str(tmp_path), work_dir=str(tmp_path), lock=TimingLock(str(tmp_path / "lock")))


def test_evaluation_measures_throughput_latency_memory(task, tmp_path):
    req, t = _request(task, {"max_batch": 4}, tmp_path)
    res = evaluate(req, t, _ctx(tmp_path))
    assert res.status == Status.OK, res.error
    m = res.metrics
    assert res.fitness == pytest.approx(m["throughput"]) and res.fitness > 0 and res.unit == "sentences/s"
    assert 0 < m["p50_ms"] <= m["p99_ms"] and m["memory_mb"] > 50 and m["similarity"] > 0.9999
    assert m["over_budget"] is False and m["vs_reference"] > 0 and m["ref_throughput"] > 0
    assert {"p99_ms", "memory_mb"} <= set(t.descriptors())


def test_the_default_engine_is_re_measured_when_its_figures_are_old(task, tmp_path):
    req, t = _request(task, {}, tmp_path, reference_every_s=0)
    seen = []
    for _ in range(2):
        res = evaluate(req, t, _ctx(tmp_path))
        assert res.status == Status.OK and res.metrics["ref_age_s"] == 0.0
        seen.append(backend_for(t).reference_of(t).load)
    assert seen[0] is not seen[1]  # measured anew each time
    req, t = _request(task, {}, tmp_path)
    evaluate(req, t, _ctx(tmp_path))  # measures it if there are no figures yet
    before = backend_for(t).reference_of(t).load
    res = evaluate(req, t, _ctx(tmp_path))  # within reference_every_s (300 s): reused
    assert backend_for(t).reference_of(t).load is before and 0 < res.metrics["ref_age_s"] < 300


def test_process_workers_are_measured_with_their_memory(task, tmp_path):
    req, t = _request(task, {"workers": 2, "worker_kind": "process"}, tmp_path)
    res = evaluate(req, t, _ctx(tmp_path))
    assert res.status == Status.OK, res.error
    assert res.fitness > 0 and res.metrics["similarity"] > 0.9999 and res.metrics["memory_mb"] > 50


def test_over_the_p99_budget_is_recorded_but_has_no_fitness(task, tmp_path):
    req, t = _request(task, {}, tmp_path, p99_budget_ms=0.001)
    res = evaluate(req, t, _ctx(tmp_path))
    assert res.status == Status.OK and res.fitness is None
    assert res.metrics["over_budget"] is True and res.metrics["throughput"] > 0


def test_under_the_similarity_floor_is_wrong(task, tmp_path):
    req, t = _request(task, {"precision": "int8"}, tmp_path, similarity_floor=0.99999)
    res = evaluate(req, t, _ctx(tmp_path))
    assert res.status == Status.WRONG and "under the floor" in res.error
    assert res.metrics["similarity"] < 0.99999 and res.timings["check_s"] > 0
    # in a duel too, the similarity is checked first: under the floor is wrong, whatever the rival
    duel = evaluate(dataclasses.replace(req, stages="duel", rival=None), t, _ctx(tmp_path))
    assert duel.status == Status.WRONG and "under the floor" in duel.error


def test_the_similarity_check_embeds_real_sentences_beside_the_request_texts(task):
    """The floor holds over the first request texts (random vocabulary words, ~10 tokens here) and the real
    sentences shipped for the check (9 to 103 tokens): an int8 engine's figure is the lower of the two sets'."""
    from runtime.engine import Engine, EngineConfig, numpy_ops
    from runtime.engine.task import check_sentences, cosines

    sentences = check_sentences()
    assert len(sentences) >= 60 and task.check_texts() == [*task.texts()[: task.args.check_texts], *sentences]
    tokens = [len(task.model().tokenizer.encode(s)) for s in sentences]
    assert max(tokens) > 100 > 3 * max(len(task.model().tokenizer.encode(t)) for t in task.texts())
    fp32 = Engine(task.model(), numpy_ops(), EngineConfig())
    int8 = Engine(task.model().with_precision("int8"), numpy_ops(), EngineConfig(precision="int8"))
    words, real = task.texts()[: task.args.check_texts], sentences
    by_set = [float(cosines(int8.embed(x), fp32.embed(x)).min()) for x in (words, real)]
    assert task.similarity(int8) == pytest.approx(min(by_set), abs=1e-6) and task.similarity(fp32) > 0.99999


def test_a_genome_outside_the_engine_is_invalid(task, tmp_path):
    req, t = _request(task, {"bucketing": "zigzag"}, tmp_path)
    assert evaluate(req, t, _ctx(tmp_path)).status == Status.INVALID


def test_a_missing_kernel_run_is_an_error_unless_optional(tmp_path):
    from archive import Run
    from genome import SpaceError

    missing = {"gelu": {"run_dir": str(tmp_path / "no-run")}}
    resolved = EngineTask.read_runs(EngineTask.resolve_args({**TINY, "kernels": missing}, str(tmp_path)), Run.open)
    assert "no run in" in resolved["kernels"]["gelu"]["unreadable"]
    with pytest.raises(SpaceError, match=r"kernels\.gelu: no run in .*optional: true"):
        EngineTask(resolved).space()
    with pytest.raises(SpaceError, match=r"kernels\.gelu: .* was not read"):  # never resolved: says so
        EngineTask({**TINY, "kernels": missing}).space()
    optional = {"gelu": {**missing["gelu"], "optional": True}}
    t = EngineTask(EngineTask.read_runs(EngineTask.resolve_args({**TINY, "kernels": optional}, str(tmp_path)),
                                        Run.open))  # fmt: skip
    assert "kernel_gelu" not in t.space().names() and "kernel_gelu" not in t.seeds()[0].params


def test_a_kernel_run_is_read_once_into_the_args_it_travels_in(tmp_path):
    """Resolving reads the top elites' sources into the args; a task built from them offers those kernels
    with no run on disk (a worker, a Ray node or a server never reads a kernel run), and resolving again
    keeps what was read (a resumed run offers the same kernels)."""
    import shutil

    from archive import Run, Store
    from runtime.result import EvalResult

    run = tmp_path / "gelu-run"
    run.mkdir()
    store = Store(run)
    store.set_meta("config", yaml.safe_dump({"task": {"name": "gelu", "args": {"rows": 4, "cols": 64}}}))
    sources = [f"void kernel(const float *x, float *y, int rows, int cols) {{ /* {i} */ }}" for i in range(3)]
    for i, source in enumerate(sources):
        genome = Genome(params={}, source=source)
        store.add_pending(genome=genome, operator="seed")
        store.record_result(genome.id, EvalResult(status=Status.OK, fitness=float(i), unit="GB/s"))
    store.close()
    kernels = {"gelu": {"run_dir": "gelu-run", "top": 2}}
    args = EngineTask.read_runs(EngineTask.resolve_args({**TINY, "kernels": kernels}, str(tmp_path)), Run.open)
    entry = args["kernels"]["gelu"]
    assert entry["run_dir"] == str(run) and len(entry["ids"]) == 2
    offered = [o["source"] for o in entry["offered"].values()]  # rendered: the fittest first
    assert len(offered) == 2 and offered[0].endswith(sources[2]) and offered[1].endswith(sources[1])
    shutil.rmtree(run)
    task = EngineTask(args)
    assert task.kernel_choices() == {"gelu": [i[:16] for i in entry["ids"]]}
    config = task.engine_config(Genome(params={**task.seeds()[-1].params}))
    assert task.kernel_sources(config)["gelu"].source == offered[0]
    assert EngineTask.read_runs(EngineTask.resolve_args(args, str(tmp_path)), Run.open) == args


def test_two_tasks_kernels_of_one_genome_are_both_offered_each_as_itself(tmp_path):
    """A template genome's id does not name its task: linear_f32's and linear_int8_avx2's kernels of the same
    parameters share it. The slot offers both, the second named ``<id>@<task>``, and each name builds its own
    task's kernel (the second was shadowed: an engine asked for it ran the first)."""
    from archive import Run, Store
    from runtime.result import EvalResult

    params = {"KU": 2, "MR": 4, "NR": 1, "PANEL": 64}
    for name in ("linear_f32", "linear_int8_avx2"):
        (tmp_path / name).mkdir()
        store = Store(tmp_path / name)
        store.set_meta("config", yaml.safe_dump({"task": {"name": name, "args": {}}}))
        store.add_pending(genome=Genome(params=params), operator="seed")
        store.record_result(Genome(params=params).id, EvalResult(status=Status.OK, fitness=1.0, unit="GFLOP/s"))
        store.close()
    kernels = {"linear": [{"run_dir": "linear_f32"}, {"run_dir": "linear_int8_avx2"}]}
    task = EngineTask(EngineTask.read_runs(EngineTask.resolve_args({**TINY, "kernels": kernels}, str(tmp_path)),
                                           Run.open))  # fmt: skip
    short = Genome(params=params).id[:16]
    assert task.kernel_choices() == {"linear": [short, f"{short}@linear_int8_avx2"]}
    built = {name: task.kernel_source("linear", name) for name in task.kernel_choices()["linear"]}
    assert [k.task for k in built.values()] == ["linear_f32", "linear_int8_avx2"]
    assert "_mm256_madd_epi16" in built[f"{short}@linear_int8_avx2"].source
    assert "_mm256_madd_epi16" not in built[short].source
    offer = {"slot": "linear", "id": Genome(params=params).id, "task": "linear_int8_avx2"}
    assert task.offered_name(offer) == f"{short}@linear_int8_avx2"
    assert task.offer_seeds(None, [offer])[-1].params["kernel_linear"] == f"{short}@linear_int8_avx2"


def test_a_kernel_named_by_its_task_is_found_when_the_offers_name_it_plainly(tmp_path):
    """An engine of an earlier round names an int8 kernel ``<id>@linear_int8_avx2`` (linear_f32 offered the id
    then). Offered alone now, it is named plainly, and the old name still builds it, never the other task's."""
    from archive import Run, Store
    from runtime.followed_runs import RunNotFound
    from runtime.result import EvalResult

    params = {"KU": 2, "MR": 4, "NR": 1, "PANEL": 64}
    (tmp_path / "int8").mkdir()
    store = Store(tmp_path / "int8")
    store.set_meta("config", yaml.safe_dump({"task": {"name": "linear_int8_avx2", "args": {}}}))
    store.add_pending(genome=Genome(params=params), operator="seed")
    store.record_result(Genome(params=params).id, EvalResult(status=Status.OK, fitness=1.0, unit="GOP/s"))
    store.close()
    task = EngineTask(EngineTask.read_runs(EngineTask.resolve_args({**TINY, "kernels": {"linear": {"run_dir": "int8"}}},
                                                                   str(tmp_path)), Run.open))  # fmt: skip
    short = Genome(params=params).id[:16]
    assert task.kernel_choices() == {"linear": [short]}
    assert task.kernel_source("linear", f"{short}@linear_int8_avx2").task == "linear_int8_avx2"
    with pytest.raises(RunNotFound, match="linear_f32"):
        task.kernel_source("linear", f"{short}@linear_f32")


def test_a_duel_rival_naming_a_kernel_no_run_offers_loses_the_duel(task, tmp_path):
    """The rival is the one that cannot be built: the verdict is against it, the challenger keeps its figures."""
    import dataclasses

    req, t = _request(task, {"max_batch": 8}, tmp_path)
    rival = Genome(params={**t.seeds()[0].params, "kernel_linear": "feedfacefeedface"})
    res = evaluate(dataclasses.replace(req, stages="duel", rival=rival), t, _ctx(tmp_path))
    assert res.status == Status.OK, res.error
    assert res.metrics["rival_status"] == "invalid" and "feedfacefeedface" in res.metrics["rival_failed"]
    assert res.metrics["throughput"] > 0


def test_relative_kernel_run_dirs_are_made_absolute():  # nothing to read them with: paths only
    args = EngineTask.resolve_args({"kernels": {"gelu": {"run_dir": "runs/g"}, "softmax": {"run_dir": "/abs/s"}},
                                      "model_dir": "m"}, "/work/here")
    assert args["kernels"] == {"gelu": {"run_dir": "/work/here/runs/g"}, "softmax": {"run_dir": "/abs/s"}}
    assert args["model_dir"] == "/work/here/m"


def test_an_engine_duel_runs_both_engines_in_turn(task, tmp_path):
    import dataclasses

    req, t = _request(task, {"max_batch": 8}, tmp_path)
    rival = Genome(params={**t.seeds()[0].params, "max_batch": 1})
    res = evaluate(dataclasses.replace(req, stages="duel", rival=rival), t, _ctx(tmp_path))
    assert res.status == Status.OK, res.error
    m = res.metrics
    assert m["duel_rival"] == rival.id and m["duel_rounds"] == 2 and m["rival_throughput"] > 0
    assert m["duel_ratio"] == pytest.approx(m["throughput"] / m["rival_throughput"])
    assert res.fitness == pytest.approx(m["throughput"]) and m["similarity"] > 0.9999


def test_new_kernels_are_tried_together_and_alone_in_the_best_engine(tmp_path):
    def run(slot: str, *ids: str) -> dict:
        return {"run_dir": str(tmp_path / slot), "follow": True, "ids": list(ids),
                "offered": {i: {"source": f"/* {i} */", "flags": [], "task": slot} for i in ids}}  # fmt: skip

    a, b, c = ("a" * 64, "b" * 64, "c" * 64)
    t = EngineTask({**TINY, "kernels": {"gelu": run("gelu", a, b), "layernorm": run("layernorm", c)}})
    assert t.offers_every_s() == t.args.follow_every_s > 0
    base = t.seeds()[0]
    together, alone = t.offer_seeds(base, [{"slot": "gelu", "id": b}])
    assert together.params == {**base.params, "kernel_gelu": b[:16], "kernel_layernorm": c[:16]}
    assert alone.params == {**base.params, "kernel_gelu": b[:16]}
    for g in (together, alone):
        assert t.space().violations(g.params) == []  # both are engines of the space
    # two new ones at once come fittest first: the fittest goes in together, not the last offered
    together, *alone = t.offer_seeds(base, [{"slot": "gelu", "id": a}, {"slot": "gelu", "id": b}])
    assert together.params["kernel_gelu"] == a[:16] and [g.params["kernel_gelu"] for g in alone] == [a[:16], b[:16]]
