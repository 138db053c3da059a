"""The engine factory: the plan follows the profile, and one real factory on a small random BERT runs end
to end (killed with -9 and resumed on the way), promotes an engine, and `evo serve --follow` serves it
and swaps to the next promotion without a failed request."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from factory_testlib import evo

from evo.factory.config import FactoryConfig
from evo.factory.kinds import kind_of
from evo.factory.plan import make_plan as plan_by_shares
from evo.factory.plan import slot_tasks_for
from evo.factory.run import why_not_promoted
from runtime.engine.profile import Profile
from runtime.result import EvalResult, Status

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime" / "engine"))
sys.path.insert(0, str(ROOT / "tests" / "serving"))

FLAGS = ["avx", "avx2", "fma", "avx512_bf16", "avx512_vnni", "avx512f"]
AVX2 = ["avx", "avx2", "fma", "f16c", "bmi1", "bmi2"]  # x86-64-v3: AMD Zen 2 and 3, Intel Haswell


def _profile(**seconds: float) -> Profile:
    slots = {s: seconds.get(s, 0.0) for s in ("layernorm", "softmax", "gelu", "linear")}
    rest = seconds.get("other", 0.0)
    return Profile(texts=8, tokens=80, batches=1, total_s=sum(slots.values()) + rest, tokenize_s=0.0, slots=slots,
                   gemms={}, attention_s=0.0, other_s=rest)  # fmt: skip


def make_plan(n, profile, config, *, cpu_flags, hidden, intermediate, gains=None):
    """The plan of an encoder's factory of ``hidden`` and ``intermediate`` sizes, on a CPU with ``cpu_flags``."""
    return plan_by_shares(n, profile.shares(), config, gains=gains,
                          slot_tasks=lambda slot: slot_tasks_for(slot, cpu_flags, hidden, intermediate))



def _chat_duel(mine: list[float], theirs: list[float], p99_ms: float = 200.0) -> EvalResult:
    """A chat duel's result as the backend reports it, its median and its rounds' tokens/s for each side."""

    def side(rounds: list[float]) -> dict[str, object]:
        ordered = sorted(rounds)
        mid = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
        return {"tokens_per_s": mid, "itl_p99_ms": p99_ms, "ttft_p99_ms": 4000.0, "check_top1": 0.97,
                "check_kl": 0.003, "rounds": [{"tokens_per_s": x, "itl_p99_ms": p99_ms} for x in rounds]}

    metrics = {**side(mine), **{f"rival_{k}": v for k, v in side(theirs).items()}}
    return EvalResult(status=Status.OK, fitness=metrics["tokens_per_s"], metrics=metrics)


def test_a_duel_carried_by_one_lucky_round_promotes_nothing():
    # a factory's round-2 duel on SmolLM2 (+5.5% in the median): the incumbent's first round was the faster one
    kind = kind_of(FactoryConfig.model_validate({"model": "smollm2"}))
    promote = kind.config.promote
    split = _chat_duel([110.2, 104.0], [116.1, 86.8])
    assert "+5.6% in the median, but round 1 of the duel gave 110.2 tokens/s against the incumbent's 116.1" \
        in why_not_promoted(kind, promote, split)
    assert why_not_promoted(kind, promote.model_copy(update={"every_round": False}), split) == ""
    assert why_not_promoted(kind, promote, _chat_duel([120.0, 104.0], [116.1, 86.8])) == ""  # ahead in each round
    # min_gain holds in every round too; a negative one accepts a loss that small in each
    ahead = _chat_duel([120.0, 110.0], [116.1, 100.0])
    assert "round 1" in why_not_promoted(kind, promote.model_copy(update={"min_gain": 0.05}), ahead)
    assert why_not_promoted(kind, promote.model_copy(update={"min_gain": -0.1}), _chat_duel([110, 99], [116, 100])) \
        == ""
    assert "over the budget" in why_not_promoted(kind, promote, _chat_duel([200.0], [100.0], p99_ms=5000.0))


def test_a_chat_duel_holds_the_candidate_to_the_limit_measured_beside_it():
    """With ``itl_p99_factor`` the duel records the limit it applied (that multiple of the incumbent's p99 between
    tokens, under the absolute budget): a candidate over it is not promoted, whatever its tokens/s."""
    config = FactoryConfig.model_validate({"model": "smollm2", "load": {"itl_p99_factor": 1.0}})
    assert config.load.itl_p99_factor == 1.0
    kind = kind_of(config)
    faster_but_slower_between_tokens = _chat_duel([150.0, 140.0], [100.0, 100.0], p99_ms=300.0)
    assert why_not_promoted(kind, config.promote, faster_but_slower_between_tokens) == ""  # under 1000 ms
    faster_but_slower_between_tokens.metrics["itl_p99_limit_ms"] = 250.0
    assert why_not_promoted(kind, config.promote, faster_but_slower_between_tokens) == \
        "p99 300.0 ms is over the budget 250 ms"
    with pytest.raises(ValueError, match="itl_p99_factor"):
        FactoryConfig.model_validate({"model": "smollm2", "load": {"itl_p99_factor": 0}})


def test_the_plan_follows_what_each_slot_could_save():
    config = FactoryConfig.model_validate({"budget": {"kernel_evals": 60, "min_evals": 4}})
    profile = _profile(linear=6.0, gelu=2.0, layernorm=1.0, softmax=0.3, other=0.7)
    plan = make_plan(1, profile, config, cpu_flags=FLAGS, hidden=384, intermediate=1536)
    got = {s.task: (s.slot, s.evals) for s in plan.searches}
    # the linear slot's 40: split between its bf16 and int8 kernels (the engine search picks among both)
    assert got == {"linear_bf16": ("linear", 20), "linear_int8": ("linear", 20), "gelu": ("gelu", 13),
                   "layernorm": ("layernorm", 7)}  # fmt: skip
    assert [s.slot for s in plan.searches] == ["linear", "linear", "gelu", "layernorm"]  # the largest share first
    assert "3.0% of the time, under plan.min_share" in plan.skipped["softmax"]
    assert plan.searches[0].why == "60.0% of the engine's time: 40 of the round's kernel evaluations, 20 each for " \
        "linear_bf16 and linear_int8"
    # a small budget: each of a slot's tasks still gets budget.min_evals
    small = make_plan(1, profile, config.model_copy(update={"budget": config.budget.model_copy(
        update={"kernel_evals": 8})}), cpu_flags=FLAGS, hidden=384, intermediate=1536)  # fmt: skip
    assert {s.task: s.evals for s in small.searches if s.slot == "linear"} == {"linear_bf16": 4, "linear_int8": 4}
    assert "8 of the round's kernel evaluations, 4 each for linear_bf16 and linear_int8 (budget.min_evals each)" \
        in small.searches[0].why
    # the AVX2 siblings stand in for the AVX-512 tasks only where the CPU lacks those
    assert not {"linear_int8_avx2", "linear_f32"} & {s.task for s in plan.searches}
    plain = make_plan(1, profile, config, cpu_flags=AVX2, hidden=384, intermediate=1536)
    assert {s.task: s.evals for s in plain.searches if s.slot == "linear"} == {"linear_int8_avx2": 20,
                                                                                 "linear_f32": 20}  # fmt: skip
    # only VNNI (and AVX2): the int8 kernels, and fp32 in bf16's place; sizes that fit no linear task: none
    vnni = make_plan(1, profile, config, cpu_flags=[*AVX2, "avx512_vnni"], hidden=384, intermediate=1536)
    assert [s.task for s in vnni.searches if s.slot == "linear"] == ["linear_int8", "linear_f32"]
    odd = make_plan(1, profile, config, cpu_flags=FLAGS, hidden=96, intermediate=200)
    assert "the model's are 96 and 200" in odd.skipped["linear"]
    # a search that stagnated is stopped; one with no figure yet goes on
    later = make_plan(2, profile, config, cpu_flags=FLAGS, hidden=384, intermediate=1536,
                      gains={"linear": 0.3, "gelu": 0.001, "layernorm": None})  # fmt: skip
    assert {s.slot for s in later.searches} == {"linear", "layernorm"}
    assert "gained +0.1%, under plan.stagnation" in later.skipped["gelu"]
    assert plan == type(plan).from_dict(json.loads(json.dumps(plan.to_dict())))



def test_a_slot_two_tasks_searched_goes_on_while_either_gained_or_is_unmeasured(tmp_path):
    """The linear slot's bf16 and int8 searches: its gain is the better of theirs (stagnation stops the slot only
    when both stagnated), and unmeasured while either is."""
    from evo.factory.run import Factory

    (tmp_path / "plans").mkdir()
    searches = [{"slot": "linear", "task": t, "evals": 4, "share": 0.6, "why": ""} for t in ("linear_int8",
                                                                                          "linear_bf16")]
    searches.append({"slot": "gelu", "task": "gelu", "evals": 4, "share": 0.2, "why": ""})
    (tmp_path / "plans" / "round-1.json").write_text(json.dumps({"round": 1, "searches": searches, "skipped": {}}))

    def history(task: str, before: float, after: float | None) -> None:
        (tmp_path / "runs" / task).mkdir(parents=True, exist_ok=True)
        (tmp_path / "runs" / task / "factory-rounds.json").write_text(json.dumps({"1": {"before": before,
                                                                                      "after": after}}))

    factory = Factory(FactoryConfig(), tmp_path, note=lambda _: None)
    history("linear_bf16", 100.0, 100.5)
    history("linear_int8", 100.0, 130.0)
    history("gelu", 10.0, 10.0)
    assert factory._gains(2) == {"linear": pytest.approx(0.3), "gelu": 0.0}
    history("linear_int8", 100.0, None)  # no figure after: the slot is not judged yet (bf16 stagnated)
    assert factory._gains(2)["linear"] is None

def test_a_factory_profiles_plans_searches_and_promotes(factory):
    profile = json.loads((factory / "profiles" / "round-1.json").read_text())
    assert set(profile["slots"]) == {"layernorm", "softmax", "gelu", "linear"} and profile["total_s"] > 0
    plan = json.loads((factory / "plans" / "round-1.json").read_text())
    assert {s["task"] for s in plan["searches"]} == {"gelu", "layernorm"} and all(s["why"] for s in plan["searches"])
    assert set(plan["skipped"]) == set()  # only the two slots were asked for, min_share 0
    from archive import Store

    for s in plan["searches"]:
        with Store(factory / "runs" / s["task"], readonly=True) as store:
            assert store.count() - store.count("pending") == s["evals"]  # the planned budget, not more
    engine_cfg = yaml.safe_load((factory / "configs" / "engine-r1.yaml").read_text())
    assert set(engine_cfg["task"]["args"]["kernels"]) == {"gelu", "layernorm"}  # offered the kernel runs
    assert engine_cfg["task"]["args"]["concurrency"] == 2 and engine_cfg["task"]["args"]["lengths"] == {10: 1.0}
    for name in ("gelu", "layernorm", "engine-r1"):  # the factory's confirmation reaches every run
        run_cfg = yaml.safe_load((factory / "configs" / f"{name}.yaml").read_text())
        assert run_cfg["search"]["confirm"]["repeats"] == 1, name
    with Store(factory / "runs" / "engine-r1", readonly=True) as store:
        confirmed = [c.metrics["confirmed"] for c in store.evaluated() if "confirmed" in c.metrics]
    assert confirmed and all(len(c["statuses"]) == 1 for c in confirmed)  # one fresh evaluation, as configured
    from archive import Run

    with Run.open(factory / "runs" / "engine-r1") as engine:  # it followed them: offered each elite as it landed
        offers = engine.offers()
        stored = engine.task_args["kernels"]
        tried = [c for c in engine.evaluated() if c.operator == "offer"]
    assert {o["slot"] for o in offers} == {"gelu", "layernorm"}
    assert len({o["id"] for o in offers}) == len(offers)  # the resumed search offered none twice
    # every kernel of the round came as an offer: none had landed when the engine search read its runs
    assert {i for slot in ("gelu", "layernorm") for i in stored[slot]["ids"]} <= {o["id"] for o in offers}
    for o in offers:
        assert o["id"] in stored[o["slot"]]["offered"] and o["evaluations"] >= 0 and o["at"] > 0
    assert tried, "no candidate tried a newly offered kernel"
    duel = json.loads((factory / "duels" / "round-1.json").read_text())
    assert duel["engines"]["candidate"]["elite"] and duel["engines"]["incumbent"] is None  # against the default
    figures = duel["figures"]["candidate"]
    assert figures["similarity"] >= 0.99 and len(figures["rounds"]) == 1 and figures["throughput"] > 0
    assert duel["promoted"] is True, duel["why"]
    promotions = [json.loads(line) for line in (factory / "promotions.jsonl").read_text().splitlines()]
    assert len(promotions) == 1 and promotions[0]["elite"] == duel["engines"]["candidate"]["elite"]
    assert Path(promotions[0]["run_dir"]).is_absolute()
    events = [json.loads(line)["event"] for line in (factory / "events.jsonl").read_text().splitlines()]
    assert events[0] == "profiled" and "planned" in events and events[-1] == "promoted"
    status = evo("factory", "status", str(factory), "--json", cwd=factory)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["promotions"] == promotions
    shown = evo("factory", "status", str(factory), cwd=factory)
    assert "promoted" in shown.stdout and "sentences/s" in shown.stdout
    assert "offered" in shown.stdout  # which kernels the engine search was offered, and when


def test_serve_follow_swaps_to_each_promotion_without_a_failed_request(factory, tmp_path):
    from serve_helpers import start_server, stop

    from archive import Store

    factory = Path(shutil.copytree(factory, tmp_path / "fac"))  # a copy to promote in: the fixture is shared

    first = json.loads((factory / "promotions.jsonl").read_text().splitlines()[0])
    with Store(first["run_dir"], readonly=True) as store:
        other = next(c.id for c in store.best(10) if c.id != first["elite"])
    srv = start_server(None, "--follow", str(factory))
    statuses: list[int] = []
    stop_load = threading.Event()

    def load() -> None:
        while not stop_load.is_set():
            statuses.append(srv.call("POST", "/v1/embeddings", {"input": ["a text under load"]})[0])

    try:
        status, _, headers = srv.call("POST", "/v1/embeddings", {"input": ["hello"]})
        assert status == 200 and headers["x-elite-id"] == first["elite"]
        assert srv.call("GET", "/v1/models")[1]["data"][0]["id"] == "tiny-bert"
        worker = threading.Thread(target=load)
        worker.start()
        with (factory / "promotions.jsonl").open("a") as f:  # the factory's next promotion
            f.write(json.dumps({**first, "round": 2, "elite": other, "at": time.time()}) + "\n")
        deadline = time.monotonic() + 60
        while srv.call("POST", "/v1/embeddings", {"input": ["x"]})[2].get("x-elite-id") != other:
            assert time.monotonic() < deadline, "never swapped to the new promotion"
            time.sleep(0.2)
        time.sleep(0.5)
        stop_load.set()
        worker.join()
    finally:
        stop_load.set()
        stop(srv)
    assert statuses and set(statuses) == {200}, statuses
    swaps = [json.loads(line) for line in (factory / "swaps.jsonl").read_text().splitlines()]
    assert swaps[-1]["elite"] == other and swaps[-1]["ok"] is True and swaps[-1]["round"] == 2


def test_serve_follow_needs_a_promotion(tmp_path):
    (tmp_path / "factory.yaml").write_text("{}\n")
    got = evo("serve", "--follow", str(tmp_path), cwd=tmp_path, timeout=60)
    assert got.returncode == 2 and "has promoted no engine yet" in got.stderr
    both = evo("serve", str(tmp_path), "--follow", str(tmp_path), cwd=tmp_path, timeout=60)
    assert both.returncode == 2 and "give one of RUN_DIR, --follow FACTORY_DIR or --gguf FILE" in both.stderr


def test_a_factory_a_user_got_wrong_is_one_line(tmp_path):
    missing = evo("factory", "nope.yaml", cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "cannot read nope.yaml" in missing.stderr
    (tmp_path / "bad.yaml").write_text("budget: {rounds: 0}\n")
    bad = evo("factory", "bad.yaml", cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and "budget.rounds" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "nomodel.yaml").write_text("model_dir: no-such-model\n")
    nomodel = evo("factory", "nomodel.yaml", cwd=tmp_path, timeout=60)
    assert nomodel.returncode == 2 and "model_dir:" in nomodel.stderr and "config.json is missing" in nomodel.stderr
    assert not (tmp_path / "factories").exists()  # nothing written for a factory that cannot start
    (tmp_path / "twice.yaml").write_text("model: smollm2\nplan: {kv_dtypes: [f16, f16]}\n")
    twice = evo("factory", "twice.yaml", cwd=tmp_path, timeout=60)
    assert twice.returncode == 2 and "plan.kv_dtypes" in twice.stderr and "once" in twice.stderr, twice.stderr
    status = evo("factory", "status", str(tmp_path), cwd=tmp_path, timeout=60)
    assert status.returncode == 2 and "no factory in" in status.stderr


def test_a_search_that_ended_unsaid_is_said_once_when_the_round_resumes(tmp_path):
    """A factory killed between a search's record (its run's round history) and its ``searched`` event: the
    resumed round writes the event once."""
    from evo.factory.plan import Plan
    from evo.factory.run import Factory

    plan = Plan.from_dict({"round": 1, "searches": [{"slot": "gelu", "task": "gelu", "evals": 4, "share": 0.2,
                                                      "why": ""}], "skipped": {}})  # fmt: skip
    (tmp_path / "runs" / "gelu").mkdir(parents=True)
    (tmp_path / "runs" / "gelu" / "factory-rounds.json").write_text(json.dumps({"1": {"before": 2.0, "after": 3.0}}))
    factory = Factory(FactoryConfig(), tmp_path, note=lambda _: None)
    for _ in range(2):
        factory._say_searched(1, plan)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["round"], e["task"], e["before"], e["after"]) for e in events] == [
        ("searched", 1, "gelu", 2.0, 3.0)]  # fmt: skip


def test_a_search_that_fails_says_why_in_the_factorys_error(tmp_path):
    """A kernel search that ends in an error: the factory's error carries the search's own last error line, not
    only where its log is."""
    from evo.factory.run import _SearchProcess

    log = tmp_path / "gelu.log"
    search = _SearchProcess([sys.executable, "-m", "evo", "run", str(tmp_path / "gone.yaml")], log)
    with pytest.raises(RuntimeError) as failed:
        search.wait()
    assert f"evo run {tmp_path / 'gone.yaml'} ended 2 (error: config file not found" in str(failed.value)
    assert str(log) in str(failed.value)
    crashed = _SearchProcess([sys.executable, "-c", "import sqlite3; raise sqlite3.OperationalError('locked')",
                              "run", "crash.yaml"], tmp_path / "crash.log")  # fmt: skip
    with pytest.raises(RuntimeError, match=r"ended 1 \(sqlite3.OperationalError: locked\)"):
        crashed.wait()
