"""The factory on a chat model: a tiny random-weight GGUF goes through profile (in a confined host), plan (the
decoder's slots), kernel searches at its decode shapes, the chat engine search following them, the duel and the
promotion; `evo serve --follow` serves the promotion from a confined process and swaps to the next one while
streams run, none failed or cut."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from factory_testlib import evo
from gguf_models import Shape, train_vocabulary, write_random_gguf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "serving"))  # serve_helpers

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.xdist_group("chat-factory")


@pytest.fixture(scope="module")
def chat_factory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat-factory")
    sentences = [s for s in (ROOT / "tests" / "data" / "sentences.txt").read_text().splitlines() if s.strip()]
    write_random_gguf(root / "tiny-chat.gguf", train_vocabulary(sentences), shape=Shape(context=512))
    config = {
        "model": "tiny-chat.gguf",
        "load": {"threads": 2, "streams": 2, "requests": 2, "prompt_tokens": [8, 40], "max_tokens": 12},
        "budget": {"rounds": 1, "kernel_evals": 8, "engine_evals": 4, "engine_after_kernels": 2, "min_evals": 2,
                   "confirm_repeats": 0},
        "plan": {"min_share": 0.0, "precisions": ["fp32"]},
        "promote": {"held_out_texts": 2, "rounds": 1, "min_gain": -0.9, "finalists": 2},
    }  # fmt: skip
    (root / "chat-factory.yaml").write_text(yaml.safe_dump(config))
    got = evo("factory", "chat-factory.yaml", "--dir", "fac", cwd=root)
    assert got.returncode == 0, got.stderr[-3000:]
    return root / "fac"


def test_a_chat_factory_profiles_plans_searches_and_promotes(chat_factory: Path) -> None:
    profile = json.loads((chat_factory / "profiles" / "round-1.json").read_text())
    assert {"attention", "rmsnorm", "linear qkv", "lm_head", "sampling and scheduling"} <= set(profile["shares"])
    assert profile["output_tokens"] == profile["requests"] * 12
    plan = json.loads((chat_factory / "plans" / "round-1.json").read_text())
    from runtime.hardware import cpu_flags
    from runtime.tasks.lm_head_topk import head_tasks

    heads = {("lm_head", name) for name in head_tasks(cpu_flags())}  # the VNNI tile too, where it runs
    assert {(s["slot"], s["task"]) for s in plan["searches"]} == {("linear", "linear_f32"),
                                                                  ("attention", "attention_decode_f16"),
                                                                  ("rmsnorm", "rmsnorm"), *heads}  # fmt: skip
    kernel = yaml.safe_load((chat_factory / "configs" / "attention_decode_f16.yaml").read_text())
    assert kernel["task"]["args"]["batch"] == 2 and kernel["task"]["args"]["head_dim"] > 0  # the load's shapes:
    assert kernel["task"]["args"]["length"] == 40 + 12  # its longest requests' positions
    assert kernel["task"]["args"]["queries"] > 1  # prompts' chunks beside decode steps
    assert kernel["task"]["args"]["cache"] == "f16"  # plan.kv_dtypes' default: the cache the fastest engines run
    engine = yaml.safe_load((chat_factory / "configs" / "engine-r1.yaml").read_text())
    assert engine["task"]["name"] == "chat_engine" and set(engine["task"]["args"]["kernels"]) == {
        "linear", "attention", "rmsnorm", "lm_head"}
    events = [json.loads(line) for line in (chat_factory / "events.jsonl").read_text().splitlines()]
    searched = next(e for e in events if e["event"] == "searched" and e["task"] == "engine")
    assert {o["slot"] for o in searched["offered"]} == {"linear", "attention", "rmsnorm", "lm_head"}
    duel = json.loads((chat_factory / "duels" / "round-1.json").read_text())
    c = duel["figures"]["candidate"]
    # fp32 GEMMs, whose only reduced precision can be a top-list head's (q8): within the promotion's floor
    assert duel["unit"] == "tokens/s" and c["throughput"] > 0 and c["top1"] >= 0.94 and c["kl"] <= 0.01, duel
    assert duel["promoted"] is True and duel["engines"]["incumbent"] is None, duel["why"]
    # the search's best two, each in a duel of its own against the default engine: the one ahead by the most wins
    finalists = duel["finalists"]
    assert len(finalists) == 2 and len({f["elite"] for f in finalists}) == 2, finalists
    assert all(f["figures"]["candidate"]["throughput"] > 0 and f["figures"]["incumbent"]["throughput"] > 0
               for f in finalists)  # fmt: skip
    best = max((f for f in finalists if f["promoted"]), key=lambda f: f["gain"])
    assert duel["engines"]["candidate"]["elite"] == best["elite"] and duel["gain"] == best["gain"]
    promotion = json.loads((chat_factory / "promotions.jsonl").read_text().splitlines()[-1])
    assert promotion["elite"] == best["elite"]
    report = evo("report", str(chat_factory), "-o", str(chat_factory.parent / "r.html"), cwd=chat_factory.parent)
    assert report.returncode == 0, report.stderr
    duels = (chat_factory.parent / "r.html").read_text().split('<section id="duels">')[1].split("</section>")[0]
    for f in finalists:  # a row for each finalist's duel, its figure beside it
        throughput = f["figures"]["candidate"]["throughput"]
        assert f"<td>{f['elite'][:12]}</td>" in duels and f"<td>{throughput:.4g}</td>" in duels
    status = evo("factory", "status", str(chat_factory), cwd=chat_factory)
    assert status.returncode == 0 and "tokens/s" in status.stdout, status.stderr


def _stream(port: int, out: list[tuple[int, int, bool]], stop: threading.Event) -> None:
    """Streams greedy chat answers until ``stop``: each one's status, tokens counted and whether it ended."""
    body = json.dumps({"messages": [{"role": "user", "content": "a question under load"}], "max_tokens": 24,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            tokens, done = 0, False
            while line := resp.readline():
                if line.strip() == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: ") and (usage := json.loads(line[6:]).get("usage")):
                    tokens = usage["completion_tokens"]
            out.append((resp.status, tokens, done))
        except OSError:
            out.append((0, 0, False))
        finally:
            conn.close()


def _knock(port: int, out: list[str], stop: threading.Event) -> None:
    """New connections one after another until ``stop``, each asking GET /health: what any one of them met other
    than a 200 (a connection the old engine's process accepted just before it drained must still be answered)."""
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                out.append(f"status {resp.status}")
        except OSError as exc:
            out.append(repr(exc))
        finally:
            conn.close()


def _ask_late(port: int, out: list[str], swapped: threading.Event) -> None:
    """Connects now (the engine being served accepts it), and sends its request 2 s after the next engine serves:
    a slow client, once the old engine's process was told to stop."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.connect()
        swapped.wait(120)
        time.sleep(2.0)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        out.append(f"status {resp.status}")
    except OSError as exc:
        out.append(repr(exc))
    finally:
        conn.close()


def test_serve_follow_swaps_chat_engines_without_a_cut_stream(chat_factory: Path, tmp_path: Path) -> None:
    import shutil

    from serve_helpers import start_server, stop

    from archive import Store

    factory = Path(shutil.copytree(chat_factory, tmp_path / "fac"))  # a copy to promote in: the fixture is shared
    first = json.loads((factory / "promotions.jsonl").read_text().splitlines()[0])
    with Store(first["run_dir"], readonly=True) as store:
        other = next(c for c in store.best(10) if c.id != first["elite"])
    srv = start_server(None, "--follow", str(factory))
    port = int(srv.url.rsplit(":", 1)[1])
    answers: list[tuple[int, int, bool]] = []
    halt = threading.Event()
    refused: list[str] = []
    clients = [threading.Thread(target=_stream, args=(port, answers, halt)) for _ in range(2)]
    clients += [threading.Thread(target=_knock, args=(port, refused, halt)) for _ in range(4)]
    late: list[str] = []
    swapped = threading.Event()
    clients.append(threading.Thread(target=_ask_late, args=(port, late, swapped)))
    try:
        served = srv.call("GET", "/ready")[1]["engine"]
        for t in clients:
            t.start()
        time.sleep(1.0)
        with (factory / "promotions.jsonl").open("a") as f:  # the factory's next promotion
            f.write(json.dumps({**first, "round": 2, "elite": other.id, "at": time.time()}) + "\n")
        deadline = time.monotonic() + 120
        while (after := srv.call("GET", "/ready")[1]["engine"]) == served:
            assert time.monotonic() < deadline, "never swapped to the new promotion"
            time.sleep(0.2)
        swapped.set()
        time.sleep(2.5)
    finally:
        halt.set()
        swapped.set()
        for t in clients:
            if t.ident is not None:
                t.join(90)
        code = stop(srv)
    assert code == 0
    params = other.genome.params
    assert after == {**{k: v for k, v in params.items() if not k.startswith("kernel_")},
                     "kernels": {k.removeprefix("kernel_"): v for k, v in params.items()
                                 if k.startswith("kernel_") and v != "numpy"}}  # fmt: skip
    assert len(answers) >= 4 and all(a == (200, 24, True) for a in answers), answers
    assert not refused, refused[:5]
    assert late == ["status 200"], late  # accepted by the old engine's process, asked after it was told to stop
    swaps = [json.loads(line) for line in (factory / "swaps.jsonl").read_text().splitlines()]
    assert swaps[-1]["elite"] == other.id and swaps[-1]["ok"] is True and swaps[-1]["round"] == 2, swaps


def test_a_round_whose_finalists_all_lose_promotes_none_and_says_why_for_each(chat_factory: Path,
                                                                             tmp_path: Path) -> None:
    """The fixture's round again, its duel redone by a resumed factory that asks more than any finalist gives:
    each finalist still duels the incumbent, none is promoted, and the record says why for each."""
    import shutil

    factory = Path(shutil.copytree(chat_factory, tmp_path / "fac"))
    stored = yaml.safe_load((factory / "factory.yaml").read_text())
    stored["promote"]["min_gain"] = 100.0  # ahead by 10,000%: no engine is
    (factory / "factory.yaml").write_text(yaml.safe_dump(stored))
    (factory / "duels" / "round-1.json").unlink()
    (factory / "promotions.jsonl").unlink()
    got = evo("factory", "run", "chat-factory.yaml", "--dir", str(factory), "--resume", cwd=chat_factory.parent)
    assert got.returncode == 0, got.stderr[-3000:]
    duel = json.loads((factory / "duels" / "round-1.json").read_text())
    assert duel["promoted"] is False and len(duel["finalists"]) == 2, duel
    assert duel["why"].startswith("none of 2 finalists won: ")
    for f in duel["finalists"]:
        assert not f["promoted"] and f["elite"][:12] in duel["why"] and f["figures"]["candidate"]["throughput"] > 0
    assert not (factory / "promotions.jsonl").exists() or not (factory / "promotions.jsonl").read_text().strip()
    events = [json.loads(line) for line in (factory / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "not promoted" and events[-1]["why"] == duel["why"]


@pytest.mark.parametrize(("config", "says"), [
    ({"model": "nowhere.gguf"}, "model: "),
    ({"model": "smollm2", "model_dir": "tiny-bert"}, "give model (a GGUF chat model) or model_dir"),
    ({"model": "smollm2", "load": {"concurrency": 8}}, "load.concurrency"),
    ({"load": {"streams": 8}}, "load.streams: Extra inputs are not permitted (a sentence encoder's"),
])  # fmt: skip
def test_a_chat_factory_config_a_user_got_wrong_is_one_line(tmp_path: Path, config: dict, says: str) -> None:
    (tmp_path / "f.yaml").write_text(yaml.safe_dump(config))
    got = evo("factory", "f.yaml", "--dir", "fac", cwd=tmp_path, timeout=120)
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1 and says in got.stderr, got.stderr
    assert not (tmp_path / "fac").exists()
