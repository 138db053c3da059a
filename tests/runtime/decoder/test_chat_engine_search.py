"""The chat_engine task: engines searched under streaming load, each served in a host and measured over HTTP by the
worker's clients; what a host serves is checked against the fp32 engine, and its numerics against the floor."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from gguf_models import Shape, train_vocabulary, write_random_gguf

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.xdist_group("chat-engine")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory, sentences: list[str]) -> Path:
    root = tmp_path_factory.mktemp("chat-engine")
    return write_random_gguf(root / "tiny-chat.gguf", train_vocabulary(sentences), shape=Shape(context=512))


def _args(model: Path, **more: object) -> dict[str, object]:
    return {"model": str(model), "threads": 2, "streams": 2, "requests": 2, "prompt_tokens": [8, 40],
            "max_tokens": 12, "check_texts": 2, "verified": 2, **more}  # fmt: skip


def test_offers_build_on_the_hand_tuned_engine_where_its_kernels_run(tiny_chat: Path) -> None:
    """Kernels offered before anything is measured go onto the hand-tuned engine (q8 GEMMs, an f16 cache, 24-token
    steps, the top-list head), a seed in the space; with no q8 kernel to run, onto the default engine."""
    from runtime.decoder.engine_task import ChatEngineTask, head_choices

    task = ChatEngineTask(_args(tiny_chat))
    start = task.offer_start().params
    assert 24 in task.space().params["step_tokens"].values()
    if "q8" in task.linear_choices():  # a q8 kernel runs on every x86-64-v3 CPU
        assert (start["linear"], start["kv_dtype"], start["step_tokens"], start["head"]) == (
            "q8", "f16", 24, head_choices()[-1])  # fmt: skip
        assert start in [g.params for g in task.seeds()] and not task.space().violations(start)
    from runtime.decoder.engine_task import step_tokens_choices

    assert step_tokens_choices(512)[-3:] == (192, 256, 512) and step_tokens_choices(64)[-1] == 64
    steps = ChatEngineTask(_args(tiny_chat, max_step_tokens=512)).space().params["step_tokens"]
    assert (steps.snap(500), steps.snap(100), steps.snap(1024)) == (512, 96, 512)  # an old genome's, the nearest
    fp32 = ChatEngineTask(_args(tiny_chat, precisions=["fp32"]))
    assert fp32.offer_start().params == fp32.seeds()[0].params and fp32.seeds()[0].params["linear"] != "q8"


def test_kernels_offered_together_keep_the_best_engines_precision_and_cache(tiny_chat: Path, tmp_path: Path) -> None:
    """Offered together onto the hand-tuned engine, a slot's kernel is one that runs in it as it is (the q8 GEMM
    kernel, not a newer fp32 one; the f16 cache's attention kernel); alone, only a kernel that runs in it as it
    is (the others stay choices of the space)."""
    from runtime.decoder.engine_task import ChatEngineTask
    from runtime.decoder.kernels import linear_task

    def run(name: str, task: str, cid: str, **args: object) -> dict[str, object]:
        return {"run_dir": str(tmp_path / name), "follow": True, "ids": [cid],
                "offered": {cid: {"source": "/* kernel */", "flags": [], "task": task, "args": args}}}  # fmt: skip

    q8, f32, f16, fp32 = ("1" * 64, "2" * 64, "3" * 64, "4" * 64)
    kernels = {"linear": [run("q8", linear_task("q8"), q8), run("f32", "linear_f32", f32)],
               "attention": [run("f16", "attention_decode_f16", f16, cache="f16"),
                             run("fp32", "attention_decode", fp32, cache="fp32")]}  # fmt: skip
    task = ChatEngineTask(_args(tiny_chat, kernels=kernels))
    start = task.offer_start().params
    if start["linear"] != "q8":
        pytest.skip("no q8 kernel runs on this CPU (the hand-tuned engine is the default one)")
    added = [{"slot": "linear", "id": f32}, {"slot": "attention", "id": fp32}]  # the newest: fp32 GEMMs and cache
    together, *alone = task.offer_seeds(None, added)
    kept = {k: together.params[k] for k in ("linear", "kv_dtype", "step_tokens", "kernel_linear", "kernel_attention")}
    assert kept == {"linear": "q8", "kv_dtype": "f16", "step_tokens": 24, "kernel_linear": q8[:16],
                    "kernel_attention": f16[:16]}  # fmt: skip
    assert alone == []  # the new ones need fp32 GEMMs or an fp32 cache
    added = [{"slot": "linear", "id": q8}, {"slot": "linear", "id": f32}, {"slot": "attention", "id": f16}]
    together, *alone = task.offer_seeds(None, added)
    assert [(g.params["kernel_linear"], g.params["kernel_attention"]) for g in alone] == [
        (q8[:16], "numpy"), ("numpy", f16[:16])]  # fmt: skip
    assert all(g.params["linear"] == "q8" and g.params["kv_dtype"] == "f16" for g in alone)
    for g in (together, *alone):
        assert task.space().violations(g.params) == []


def test_a_chat_engine_search_measures_each_engine_as_served(tiny_chat: Path, tmp_path: Path) -> None:
    """`evo run` of a chat_engine config: the seeds and a random engine are served, loaded and verified; the best
    is confirmed; every figure is there with its unit, and the winner renders as the settings /admin/engine takes."""
    config = {"task": {"name": "chat_engine", "args": _args(tiny_chat)},
              "search": {"workers": 1, "initial_random": 1, "confirm": {"repeats": 1}}, "budget": {"max_evals": 3},
              "archive": {"descriptors": ["itl_p99_ms", "memory_mb"], "bins": [3, 3],
                          "ranges": [[0, 1000], [0, 4096]]},
              "memory": {"enabled": False}}  # fmt: skip
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(run)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "evo", "archive", "best", str(run), "--json"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    best = json.loads(out.stdout)
    assert best and best[0]["status"] == "ok" and best[0]["unit"] == "tokens/s" and best[0]["fitness"] > 0, best
    m = best[0]["metrics"]
    for key in ("tokens_per_s", "ttft_p99_ms", "itl_p99_ms", "memory_mb", "vs_reference", "top1", "verified_top1"):
        assert key in m, key
    assert m["tokens"] == m["requests"] * 12 and m["requests"] == 4  # every answer ran to max_tokens
    assert m["memory_mb"] > 0 and m["verified_answers"] == 2 and m["verified_top1"] >= 0.85
    assert "confirmed" in m
    shown = subprocess.run([sys.executable, "-m", "evo", "archive", "show", str(run), best[0]["id"][:12]],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "linear:" in shown.stdout and "kv_dtype:" in shown.stdout


def _backend_and_task(model: Path, tmp_path: Path, **args: object):
    from runtime.backends.chat_engine import ChatEngineBackend, ChatEngineProgram
    from runtime.decoder.engine_task import ChatEngineTask

    task = ChatEngineTask(_args(model, **args))
    backend = ChatEngineBackend()
    (tmp_path / "cache").mkdir(exist_ok=True)
    ctx = SimpleNamespace(cache_dir=str(tmp_path / "cache"), work_dir=str(tmp_path))
    return backend, task, ctx, ChatEngineProgram


def _serve(backend, task, ctx, engine, kernels=None):
    """A host serving ``engine`` (its libraries compiled here first, as a worker does)."""
    from runtime.decoder.engine import compile_engine
    from runtime.settings import CompilerSettings

    built = compile_engine(engine, kernels, cache_dir=ctx.cache_dir)
    return backend.serve(task, engine, built, SimpleNamespace(compiler=CompilerSettings()), ctx)


def test_an_engine_under_the_fidelity_floor_is_wrong(tiny_chat: Path, tmp_path: Path) -> None:
    """The q8 engine's numerics are not the fp32 engine's: under a floor of exact agreement it is wrong, above a
    loose one it passes; the default engine holds any floor."""
    from runtime.backends.base import Failure
    from runtime.decoder.engine import ChatEngine
    from runtime.decoder.engine_task import runnable_precisions
    from runtime.result import Status

    precision = "q8" if "q8" in runnable_precisions() else "int8"
    for floor, fails in (({"top1_floor": 1.0, "kl_floor": 0.0}, True), ({"top1_floor": 0.5, "kl_floor": 1.0}, False)):
        backend, task, ctx, Program = _backend_and_task(tiny_chat, tmp_path, **floor)
        program = Program(task, None, ChatEngine(linear=precision, threads=1), None, ctx, backend)
        if fails:
            with pytest.raises(Failure) as caught:
                program.check(1)
            assert caught.value.status == Status.WRONG and "floor" in str(caught.value)
        else:
            assert program.check(1)["mean_kl"] > 0
    exact = Program(task, None, ChatEngine(threads=1), None, ctx, backend).check(1)
    assert exact["top1"] == 1.0 and exact["mean_kl"] < 1e-6


class _Forger(BaseHTTPRequestHandler):
    """A server that streams a chat answer it did not compute: the same words every time (``text``, as the tiny
    model's tokens ``ids``), listing the tokens ``listed``, each reported as the likeliest but for those in
    ``demoted``, and claiming the usage ``claimed``; or, where ``answer`` is set, its answer to the prompt, each
    token reported with probability 1."""

    text = "the the the the the the"
    ids: list[int] = []
    listed: list[int] = []
    demoted: set[int] = set()
    claimed = 0
    answer = None

    def do_POST(self) -> None:  # noqa: N802 - the handler's protocol
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        text, listed, claimed = self.text, self.listed, self.claimed
        if self.answer is not None:  # this request's own (requests come two at a time)
            text, listed = self.answer(body["messages"][0]["content"], body["max_tokens"])
            claimed = len(listed)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()

        def rivals(i: int) -> list[dict[str, object]]:
            if self.answer is not None:
                return [{"id": i, "logprob": 0.0}]
            return [{"id": i, "logprob": -1.0 if i in self.demoted else -0.5}, {"id": 1, "logprob": -0.9}]

        entries = [{"id": i, "token": "", "logprob": -1.0, "bytes": [], "top_logprobs": rivals(i)}
                   for i in listed]  # fmt: skip
        event = {"choices": [{"index": 0, "delta": {"content": text}, "logprobs": {"content": entries}}]}
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"prompt_tokens": 9, "completion_tokens": claimed, "total_tokens": 9 + claimed}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def forger() -> Iterator[tuple[int, type[_Forger]]]:
    handler = type("Forger", (_Forger,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler
    server.shutdown()


def test_a_host_that_serves_other_tokens_or_miscounts_them_is_wrong(tiny_chat: Path, tmp_path: Path,
                                                                       forger) -> None:  # fmt: skip
    """Answers checked after the load: canned words are not the fp32 engine's top-1 tokens; a usage that claims more
    tokens than were sent, a served token its own report ranks below another, and the fp32 engine's own tokens
    reported as certain (a distribution it does not have: the KL over the reported tokens) are caught; all are
    wrong, whatever figures the load gave."""
    from runtime.backends.base import Failure
    from runtime.backends.chat_engine import Measured
    from runtime.decoder.chat_load import run_load
    from runtime.result import Status

    port, handler = forger
    backend, task, ctx, Program = _backend_and_task(tiny_chat, tmp_path, top1_floor=0.5)
    program = Program(task, None, None, None, ctx, backend)
    handler.ids = task.model().tokenizer.encode(handler.text, add_bos=False)
    n = len(handler.ids)
    for listed, claimed, demoted, says in ((handler.ids, n, set(), "top-1"), (handler.ids, 3 * n, set(), "disagree"),
                                           (handler.ids[::-1] + [0], n + 1, set(), "disagree"),
                                           (handler.ids, n, {handler.ids[2]}, "likeliest")):  # fmt: skip
        handler.listed, handler.claimed, handler.demoted = listed, claimed, demoted
        load = run_load(port, task.prompts(1)[:4], 2, 12, ids=True, top=20)
        with pytest.raises(Failure) as caught:
            program._verify(Measured(load, 1.0))
        assert caught.value.status == Status.WRONG and says in str(caught.value), str(caught.value)

    from runtime.decoder import Decoder

    fp32 = Decoder(task.model())

    def greedy(prompt: str, max_tokens: int) -> tuple[str, list[int]]:
        done = fp32.generate([{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
                             ignore_eos=True)  # fmt: skip
        return done.text, done.token_ids

    handler.answer = staticmethod(greedy)
    load = run_load(port, task.prompts(1)[:4], 2, 12, ids=True, top=20)
    with pytest.raises(Failure) as caught:
        program._verify(Measured(load, 1.0))
    assert caught.value.status == Status.WRONG and "mean KL" in str(caught.value), str(caught.value)
    assert caught.value.metrics["verified_top1"] == 1.0


def test_an_engine_slower_between_tokens_than_the_factor_allows_gets_no_fitness(tiny_chat: Path,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """``itl_p99_factor`` bounds the p99 between tokens by a multiple of the default engine's, measured beside it
    in the same evaluation: at a factor no engine can meet, the measurement stands but earns no fitness."""
    from runtime.backends.chat_engine import itl_p99_limit_ms
    from runtime.decoder.engine import ChatEngine
    from runtime.settings import EvalSettings
    from runtime.timing import TimingLock

    backend, task, ctx, Program = _backend_and_task(tiny_chat, tmp_path, itl_p99_factor=1e-6)
    ctx.lock = TimingLock(str(tmp_path / "timing.lock"))
    engine = ChatEngine(slots="numpy", threads=1)
    host = _serve(backend, task, ctx, engine)
    program = Program(task, host, engine, EvalSettings(), ctx, backend)
    try:
        got = program.time()
    finally:
        program.close()
        for template in backend._templates.values():
            template.close()
    m = got.metrics
    assert m["ref_itl_p99_ms"] > 0 and m["itl_p99_ms"] > 0 and m["tokens_per_s"] > 0
    assert m["itl_p99_limit_ms"] == pytest.approx(1e-6 * m["ref_itl_p99_ms"])
    assert m["over_budget"] is True and got.fitness is None
    args = task.args.model_copy(update={"itl_p99_factor": 2.0, "itl_p99_budget_ms": 500.0})
    assert itl_p99_limit_ms(args, 100.0) == 200.0 and itl_p99_limit_ms(args, 400.0) == 500.0
    assert itl_p99_limit_ms(args.model_copy(update={"itl_p99_factor": None}), 100.0) == 500.0


def test_a_duel_rival_that_cannot_be_built_loses_and_the_challenger_is_measured(tiny_chat: Path,
                                                                               tmp_path: Path) -> None:  # fmt: skip
    """An incumbent naming a kernel no run offers any more cannot be built: the verdict is against it, and the
    challenger's figures, measured alone, are what the factory promotes on."""
    from runtime.backends import RivalFailure
    from runtime.decoder.engine import ChatEngine
    from runtime.result import Status
    from runtime.settings import EvalSettings
    from runtime.timing import TimingLock

    backend, task, ctx, Program = _backend_and_task(tiny_chat, tmp_path)
    ctx.lock = TimingLock(str(tmp_path / "timing.lock"))
    engine = ChatEngine(slots="numpy", threads=1)
    program = Program(task, _serve(backend, task, ctx, engine), engine, EvalSettings(), ctx, backend)

    def open_rival():
        raise RivalFailure(Status.INVALID, "no kernel run of the linear slot offers a kernel 'feedfacefeedface'")

    try:
        with pytest.raises(RivalFailure, match="feedfacefeedface") as lost:
            program.duel(open_rival)
    finally:
        program.close()
        for template in backend._templates.values():
            template.close()
    m = lost.value.metrics
    assert m["tokens_per_s"] > 0 and m["itl_p99_ms"] > 0 and m["duel_rounds"] == task.args.duel_rounds


def test_while_one_host_is_measured_every_other_is_stopped(tiny_chat: Path, tmp_path: Path) -> None:
    """No host can slow the one measured beside it (a candidate's, the default engine's it is held to, a duel's
    rival): every other host is stopped (SIGSTOP) under the load, and runs again after it."""
    import os
    import time

    from runtime.backends.chat_engine import measure
    from runtime.decoder.engine import ChatEngine

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    backend, task, ctx, _ = _backend_and_task(tiny_chat, tmp_path, requests=4, max_tokens=40)
    measured = _serve(backend, task, ctx, ChatEngine(slots="numpy", threads=1))
    beside = _serve(backend, task, ctx, ChatEngine(slots="numpy", threads=1))
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(state(beside.pid))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    try:
        assert beside.pid in backend.others(measured) and measured.pid not in backend.others(measured)
        watcher.start()
        got = measure(measured, task, set(os.sched_getaffinity(0)), others=lambda: backend.others(measured))
        done.set()
        watcher.join()
        assert got.load.tokens == 2 * 4 * 40
        assert seen.count("T") >= 0.9 * len(seen) > 5, seen  # stopped for the load, but for its first instants
        assert state(beside.pid) != "T"
        assert measure(beside, task, set(os.sched_getaffinity(0))).load.tokens == 2 * 4 * 40  # and serves again
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join()
        backend.release(measured)
        backend.release(beside)
        for template in backend._templates.values():
            template.close()


def test_a_host_killed_under_load_is_a_crash_and_the_next_one_serves(tiny_chat: Path, tmp_path: Path) -> None:
    """kill -9 of an engine's host while its load runs: the evaluation ends ``crash`` naming it, and the template
    still serves the next engine."""
    import os
    import signal
    import time

    from runtime.backends.base import Failure
    from runtime.backends.chat_engine import measure
    from runtime.decoder.engine import ChatEngine
    from runtime.result import Status

    backend, task, ctx, _ = _backend_and_task(tiny_chat, tmp_path, streams=2, requests=8, max_tokens=200)
    host = _serve(backend, task, ctx, ChatEngine(slots="numpy", threads=1))
    killer = threading.Timer(0.5, lambda: os.kill(host.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(Failure) as caught:
            measure(host, task, set(os.sched_getaffinity(0)))
        assert caught.value.status == Status.CRASH and "died" in str(caught.value), str(caught.value)
        again = _serve(backend, task, ctx, ChatEngine(slots="numpy", threads=1))
        t0 = time.perf_counter()
        assert measure(again, task, set(os.sched_getaffinity(0))).load.tokens == 2 * 8 * 200
        assert time.perf_counter() - t0 < 120
        backend.release(again)
    finally:
        killer.cancel()
        for template in backend._templates.values():
            template.close()


_PROBE = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>
__attribute__((constructor)) static void probe(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0), s_err = errno;
    int f = open("%s", O_WRONLY | O_CREAT, 0600), f_err = errno;
    pid_t p = fork(), p_err = errno;
    if (p == 0) _exit(0);
    fprintf(stderr, "probe socket %%d %%d open %%d %%d fork %%d %%d\n", s, s_err, f, f_err, (int)p, p_err);
    fflush(stderr);
}
"""


@pytest.mark.skipif(not __import__("runtime.sandbox.filters").sandbox.filters.filter_available(),
                    reason="libseccomp is not installed")  # fmt: skip
def test_an_evolved_kernel_in_a_chat_host_cannot_open_a_socket_write_a_file_or_start_a_process(
    tiny_chat: Path, tmp_path: Path
) -> None:
    """An attention kernel whose library, once loaded, tries to open a socket, create a file and fork: in its chat
    host each call fails with EPERM, nothing is written, and the host still serves (a chat answer runs on it)."""
    import dataclasses
    import errno

    from runtime.decoder.chat_load import chat
    from runtime.decoder.engine import ChatEngine
    from runtime.decoder.kernels import seed_source
    from runtime.tasks.attention_decode import AttentionDecode

    backend, task, ctx, _ = _backend_and_task(tiny_chat, tmp_path)
    written = tmp_path / "written-by-a-kernel"
    seed = seed_source(AttentionDecode({"threads": 1}))
    hostile = dataclasses.replace(seed, id="hostile0", source=seed.source + _PROBE % written)
    engine = ChatEngine(linear="numpy", threads=1, kernels={"attention": "hostile0"})
    host = _serve(backend, task, ctx, engine, {"attention": hostile})
    try:
        assert chat(host.port, "Hello there", 4).completion_tokens == 4
        probe = next(line for line in host.tail(4000).splitlines() if line.startswith("probe "))
        _, _, s, s_err, _, f, f_err, _, p, p_err = probe.split()
        assert (int(s), int(f), int(p)) == (-1, -1, -1), probe
        assert int(s_err) == int(f_err) == int(p_err) == errno.EPERM, probe
        assert not written.exists()
    finally:
        backend.release(host)
        for template in backend._templates.values():
            template.close()


@pytest.mark.parametrize(("kernel_task", "cache", "other"), [("attention_decode", "fp32", "f16"),
                                                              ("attention_decode_f16", "f16", "fp32")])
def test_a_chat_engine_search_takes_a_kernel_runs_attention_elites(tiny_chat: Path, tmp_path: Path, kernel_task: str,
                                                                   cache: str, other: str) -> None:  # fmt: skip
    """An attention run (over either KV cache type), then a chat_engine search offered its elite (`kernels:
    {attention: ...}`): the engine with the evolved kernel is served and measured, its check read from its host's
    answers (never run in the worker), and an engine naming a kernel of the wrong KV cache type is invalid."""
    kernels = {"task": {"name": kernel_task, "args": {"batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
                                                      "length": 48, "threads": 1}},
               "search": {"workers": 1, "initial_random": 1}, "budget": {"max_evals": 3},
               "archive": {"kind": "grid", "descriptors": ["key_block"], "bins": [6]},
               "memory": {"enabled": False}}  # fmt: skip
    (tmp_path / "kernels.yaml").write_text(yaml.safe_dump(kernels))
    run = subprocess.run([sys.executable, "-m", "evo", "run", str(tmp_path / "kernels.yaml"), "--run-dir",
                          str(tmp_path / "attention")], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    config = {"task": {"name": "chat_engine", "args": _args(tiny_chat, precisions=["fp32"],
                                                            kernels={"attention": {"run_dir": "attention", "top": 1}})},
              "search": {"workers": 1, "initial_random": 0, "confirm": {"repeats": 0}}, "budget": {"max_evals": 2},
              "archive": {"descriptors": ["itl_p99_ms", "memory_mb"], "bins": [3, 3],
                          "ranges": [[0, 1000], [0, 4096]]},
              "memory": {"enabled": False}}  # fmt: skip
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "evo", "run", "chat.yaml", "--run-dir", "chat"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "evo", "archive", "best", str(tmp_path / "chat"), "--json",
                          "--top", "5"], capture_output=True, text=True, timeout=120)  # fmt: skip
    found = {c["params"]["kernel_attention"]: c for c in json.loads(out.stdout)}
    assert set(found) == {"numpy", next(k for k in found if k != "numpy")}, found
    evolved = next(c for k, c in found.items() if k != "numpy")
    m = evolved["metrics"]
    assert evolved["status"] == "ok" and m["tokens_per_s"] > 0 and "top1" not in m, m
    assert m["check_answers"] == 2 and m["check_top1"] >= 0.85 and m["check_kl"] < 0.01, m
    assert m["verified_answers"] == 2 and m["verified_kl"] < 0.01, m

    sys.path.insert(0, str(Path(__file__).parents[2] / "serving"))  # serve_helpers, shared with the serving tests
    from serve_helpers import KEY, start_server, stop

    srv = start_server(tmp_path / "chat", "--elite", evolved["id"][:12], key=KEY)  # served by a sandboxed process
    try:
        assert srv.call("GET", "/ready")[1]["engine"]["kernels"] == {"attention": evolved["params"]["kernel_attention"]}
        status, got, _ = srv.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                  "max_tokens": 3, "ignore_eos": True})  # fmt: skip
        assert status == 200 and got["usage"]["completion_tokens"] == 3, got
        status, got, _ = srv.call("POST", "/admin/engine", {"slots": "numpy"})
        assert status == 409 and got["error"]["code"] == "swaps_off", got
    finally:
        assert stop(srv) == 0, srv.proc.stdout.read() if srv.proc.stdout else ""

    from genome import Genome
    from runtime.decoder.engine import EngineUnfit, libraries
    from runtime.decoder.engine_task import ChatEngineTask

    args = json.loads(json.dumps(yaml.safe_load((tmp_path / "chat" / "config.yaml").read_text())["task"]["args"]))
    task = ChatEngineTask(args)
    assert task.seeds()[-1].params["kv_dtype"] == cache and evolved["params"]["kv_dtype"] == cache
    params = {**task.seeds()[-1].params, "kv_dtype": other}
    with pytest.raises(EngineUnfit, match=f"evolved for an {cache} KV cache"):
        engine = task.engine(Genome(params=params))
        libraries(engine, task.kernel_sources(engine))

    # the space holds what the kernels need: mutation's repair and random draws give engines that run them
    import numpy as np

    space, rng = task.space(), np.random.default_rng(0)
    assert space.violations(params)  # the wrong KV cache type for its attention kernel breaks a constraint
    drawn = [space.repair(params, rng) for _ in range(20)] + [space.sample(rng) for _ in range(20)]
    assert any(p["kernel_attention"] != "numpy" for p in drawn)
    for p in drawn:
        engine = task.engine(Genome(params=p))
        libraries(engine, task.kernel_sources(engine))  # raises EngineUnfit for an engine that cannot run them


_CHECK_ONLY = r"""
#undef kernel
/* right only where a sequence is longer than the load's prompts can be: the held-out check's long texts */
void kernel(int batch, int heads, int kv_heads, int d, int window, const float *q, const kv_t *k, const kv_t *v,
            const long *k_off, const long *v_off, const int *length, const int *count, const int *capacity,
            float *out)
{
    kernel_real(batch, heads, kv_heads, d, window, q, k, v, k_off, v_off, length, count, capacity, out);
    int checked = 0;
    long rows = 0;
    for (int b = 0; b < batch; b++) {
        checked |= length[b] > %d;
        rows += count[b];
    }
    if (!checked)
        for (long i = 0; i < rows * heads * d; i++) out[i] = 0.0f;
}
"""


def test_an_evolved_kernel_right_only_on_the_check_prompts_is_wrong_under_load(tiny_chat: Path, tmp_path: Path) -> None:
    """An attention kernel that tells the held-out check's texts by their length (longer than any load prompt) and
    is right only there: it passes the check, and the load's verified answers, chosen after the load, find it
    serving something other than what held the floor."""
    import dataclasses
    import os

    from runtime.backends.base import Failure
    from runtime.backends.chat_engine import measure, served_fidelity
    from runtime.decoder.engine import ChatEngine
    from runtime.decoder.kernels import seed_source
    from runtime.result import Status
    from runtime.tasks.attention_decode import AttentionDecode

    backend, task, ctx, Program = _backend_and_task(tiny_chat, tmp_path)
    longest_load = task.args.prompt_tokens[1] + task.args.max_tokens
    shortest_check = min(len(task.model().tokenizer.encode_chat([{"role": "user", "content": t}]))
                         for t in task.check_texts())  # fmt: skip
    assert shortest_check > longest_load + 8, (shortest_check, longest_load)  # the kernel can tell them apart
    seed = seed_source(AttentionDecode({"threads": 1}))
    source = "#define kernel kernel_real\n" + seed.source + _CHECK_ONLY % (longest_load + 4)
    sly = dataclasses.replace(seed, id="checkonly0", source=source)
    engine = ChatEngine(linear="numpy", threads=1, kernels={"attention": "checkonly0"})
    host = _serve(backend, task, ctx, engine, {"attention": sly})
    try:
        checked = Program(task, host, engine, None, ctx, backend).check(1)
        assert checked["check_top1"] >= 0.95, checked  # right on the check's texts
        answers = measure(host, task, set(os.sched_getaffinity(0))).load.answers
        with pytest.raises(Failure) as caught:
            served_fidelity(task, answers, "verified")
        assert caught.value.status == Status.WRONG and "top-1" in str(caught.value), str(caught.value)
    finally:
        backend.release(host)
        for template in backend._templates.values():
            template.close()


_TEAMS = """
import os, sys, time
from runtime.decoder import load_decoder
from runtime.decoder.engine import ChatEngine, build, engine_threads, warm_up

def threads(settle):  # OpenMP's workers of a freed team end a moment after it
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/task")) > settle and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(os.listdir("/proc/self/task"))

engine = ChatEngine(threads=2)
engine_threads(engine)
decoder = build(load_decoder(sys.argv[1]), engine)
before = len(os.listdir("/proc/self/task"))
warm_up(decoder)
after_warm_up = threads(before)
decoder.generate("Hello", max_tokens=2, temperature=0.0)  # here, in this thread: its team stays
print(before, after_warm_up, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="an OpenMP team of 2 needs 2 cores")
def test_a_hosts_warm_up_leaves_no_openmp_team_beside_the_one_that_serves(tiny_chat: Path) -> None:
    """A host runs every kernel once before it serves, in a thread that ends: a team of OpenMP threads left to the
    thread that warmed up, beside the serving thread's, made every decode step slower."""
    got = subprocess.run([sys.executable, "-c", _TEAMS, str(tiny_chat)], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    before, after_warm_up, after_here = map(int, got.stdout.split())
    assert after_warm_up == before  # the warm-up's thread and its team are gone
    assert after_here > before  # what a warm-up in this thread would have left
