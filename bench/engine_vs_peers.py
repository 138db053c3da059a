"""The best evolved engine against its peers, each at its best, side by side in one run: same machine, same
cores and thread count, same request texts, same closed-loop load. Our engines run as they are served: in
host processes of their own (the sandbox user, the system-call filter), and behind ``evo serve``.

    python bench/engine_vs_peers.py --run-dir runs/engine_minilm
    python bench/engine_vs_peers.py --config configs/engine_minilm.yaml   # runs the search first
    peers-venv/bin/python bench/engine_vs_peers.py --run-dir runs/engine_minilm --engine-python .venv/bin/python

The peers' venv holds numpy at 1.x (Infinity needs it); ``--engine-python`` runs our engine hosts and ``evo serve``
on evoforge's own venv instead, as a user deploys it (each side on its own best environment).

Peers (``pip install -c constraints.txt -e '.[peers]'``; one that cannot run is listed with the reason):
sentence-transformers on torch, and on OpenVINO (fp32, and int8 weights where its compression runs offline);
ONNX Runtime on the same model exported to ONNX (fp32, dynamic int8 per tensor and per channel); FastEmbed on
that export; Infinity (``infinity-emb``), an embedding server, on its torch engine (and on ONNX Runtime, its
``optimum`` engine, where ``optimum-onnx`` is installed: not in the extra). Nothing is downloaded.

Serving: closed-loop clients at the task's concurrency; sentences/s and p50/p99 latency. In process, our
engines take requests through their own queue, and the peers through the bench's, which groups them by length
class as ours does (up to ``--batch`` a batch). Over HTTP, ``evo serve`` and Infinity (its own length-sorted
batching) answer the same clients' requests on keep-alive connections. Bulk: ``--bulk`` texts at once, each
contestant through its own bulk path (``SentenceTransformer.encode`` sorts by length; FastEmbed's ``embed``
does not, and is measured again sorted by the bench; ONNX Runtime has none: sorted by the bench).

Prints each one's minimum cosine to the fp32 reference (sentence-transformers) over the load's texts and the
real sentences the engine's similarity check embeds (``runtime/engine/check_sentences.txt``), and, for serving
and bulk, ours against the strongest peer at min cosine >= 0.99 and the distance to the goal of 1.5x. Under
``EVOFORGE_CPU_ISA=avx2`` the peers are capped at AVX2 too: on a CPU that can fault CPUID, the bench starts
again with its CPUID masked (``runtime/cpuid_mask.c``), which caps every library; elsewhere each library's own
setting caps it, and those that have none are named.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable, Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _peers import Peer, build_peers, cap_cpu, has_avx512, not_capped, versions  # noqa: E402

try:  # before numpy, torch, ONNX Runtime and OpenVINO load: each reads its cap then
    CAPS = cap_cpu()
except ValueError as _exc:  # runtime.isa.IsaError: a level evoforge does not know
    raise SystemExit(str(_exc)) from None

import numpy as np  # noqa: E402
from _servers import EVO_SERVE, INFINITY, HttpServer, ServerFailed, evo_serve, infinity  # noqa: E402

from archive import Run  # noqa: E402
from runtime.engine import Batcher, LoadResult, closed_loop  # noqa: E402
from runtime.engine.task import EngineTask, check_sentences  # noqa: E402
from runtime.sandbox.hosted_engine import pin, spawn_elite  # noqa: E402
from runtime.timing import pinned  # noqa: E402

GOAL = 1.5  # ours over the strongest peer
FLOOR = 0.99  # min cosine a peer needs to count as the strongest
RESAMPLES = 2000  # bootstrap resamples behind each p99's interval


def run_search(config: Path, run_dir: Path, max_evals: int | None) -> float:
    t0 = time.monotonic()
    extra = ["--max-evals", str(max_evals)] if max_evals else []
    subprocess.run([sys.executable, "-m", "evo", "run", str(config), "--run-dir", str(run_dir), *extra], check=True,
                   cwd=ROOT)
    return time.monotonic() - t0


def min_cosine(got: Any, reference: np.ndarray) -> float:
    got = np.asarray(got, np.float32)
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
    return float(np.min(np.sum(got * reference, axis=1) / norms))


def median_figures(runs: Sequence[LoadResult], rng: np.random.Generator | None = None) -> dict[str, Any]:
    """The median throughput over the rounds, each round's, and the latency percentiles over every round's
    requests pooled (a p99 over one 3 s round rests on its three or four slowest requests) (``None``s: no round).
    ``p99_resampled``: the pooled p99 of each of :data:`RESAMPLES` bootstrap resamples of the requests, which
    :func:`p99_interval` and :func:`p99_verdict` read (not printed, not in the JSON)."""
    if not runs:
        return {"throughput": None, "p50_ms": None, "p99_ms": None, "completed": 0, "rounds": []}
    pooled = np.asarray([x for r in runs for x in r.latencies_ms])
    resampled = None
    if len(pooled):
        rng = rng or np.random.default_rng(0)
        resampled = np.percentile(rng.choice(pooled, size=(RESAMPLES, len(pooled))), 99, axis=1)
    return {"throughput": float(np.median([r.throughput for r in runs])),
            "p50_ms": float(np.percentile(pooled, 50)) if len(pooled) else float(np.median([r.p50_ms for r in runs])),
            "p99_ms": float(np.percentile(pooled, 99)) if len(pooled) else float(np.median([r.p99_ms for r in runs])),
            "p99_resampled": resampled, "completed": int(sum(r.completed for r in runs)),
            "rounds": [round(r.throughput, 1) for r in runs]}


def p99_interval(row: dict[str, Any]) -> tuple[float, float] | None:
    """The 95% bootstrap interval of a row's pooled p99 (None: no requests pooled)."""
    boot = row.get("p99_resampled")
    return None if boot is None else (float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5)))


def p99_verdict(ours: dict[str, Any], peer: dict[str, Any]) -> tuple[str, tuple[float, float] | None]:
    """Our p99 against the peer's: ``better`` or ``worse`` where the 95% bootstrap interval of the difference
    (ours - theirs, both pools resampled on their own) excludes 0, else ``equal within noise``; with that
    interval (None where a side pooled no requests: then the point figures alone decide)."""
    a, b = ours.get("p99_resampled"), peer.get("p99_resampled")
    if a is None or b is None:
        return ("equal or better" if ours["p99_ms"] <= peer["p99_ms"] else "worse"), None
    lo, hi = (float(np.percentile(a - b, q)) for q in (2.5, 97.5))
    return ("better" if hi < 0 else "worse" if lo > 0 else "equal within noise"), (lo, hi)


def numpy_of(python: str) -> str:
    """The numpy version of interpreter ``python`` (what our engines' attention and numpy slots run on)."""
    done = subprocess.run([python, "-c", "import numpy; print(numpy.__version__)"], capture_output=True, text=True,
                          check=False)  # fmt: skip
    return done.stdout.strip() or f"unknown ({python})"


def timed(bulk: Callable[[list[str]], Any], texts: list[str]) -> float:
    """Sentences/s of one call embedding all of ``texts``."""
    t0 = time.perf_counter()
    bulk(texts)
    return len(texts) / (time.perf_counter() - t0)


def engine_bulk(engine: Any, texts: list[str]) -> float:
    """Sentences/s of the engine over all of ``texts`` through its bulk path (``submit_all``: longest first to its
    own batcher and workers)."""
    engine.start()
    try:
        t0 = time.perf_counter()
        for fut in engine.submit_all(texts):
            fut.result()
        return len(texts) / (time.perf_counter() - t0)
    finally:
        engine.stop()


@contextlib.contextmanager
def paused(servers: Iterable[HttpServer]) -> Iterator[None]:
    """``servers`` stopped meanwhile: only the contestant measured uses the cores."""
    with contextlib.ExitStack() as stack:
        for s in servers:
            stack.enter_context(s.paused())
        yield


def start_servers(run_dir: Path, cid: str, model_dir: Path, threads: int, batch: int, log_dir: Path,
                  skipped: dict[str, str], python: str | None = None) -> list[HttpServer]:  # fmt: skip
    """``evo serve`` and Infinity (on torch, and on ONNX Runtime where its optimum engine is installed), started
    one after the other, each paused while the next starts; one that cannot start goes into ``skipped``."""
    starts: dict[str, Callable[[], HttpServer]] = {
        EVO_SERVE: lambda: evo_serve(run_dir, cid, threads=threads, log_dir=log_dir, python=python),
        **{name: (lambda e=engine: infinity(model_dir, e, threads=threads, batch=batch, log_dir=log_dir))
           for engine, name in INFINITY.items()},
    }  # fmt: skip
    servers: list[HttpServer] = []
    for name, start in starts.items():
        with paused(servers):
            try:
                servers.append(start())
            except ServerFailed as exc:
                skipped[name] = str(exc)
    return servers


def versus(rows: list[dict[str, Any]], measure: str, mode: str | None = None) -> dict[str, Any] | None:
    """Our best ``measure`` over the strongest peer's (the highest among those at min cosine >= FLOOR), in
    ``mode`` only if given; with serving, whether our p99 is equal or better. None: a side has no figure."""
    pool = [r for r in rows if r[measure] and (mode is None or r["mode"] == mode)]
    ours = [r for r in pool if r["ours"]]
    theirs = [r for r in pool if not r["ours"] and r["min_cosine"] >= FLOOR]
    if not ours or not theirs:
        return None
    best, peer = max(ours, key=lambda r: r[measure]), max(theirs, key=lambda r: r[measure])
    ratio = best[measure] / peer[measure]
    out = {"ours": best["name"], "peer": peer["name"], "ratio": ratio, "goal": GOAL, "to_goal": GOAL / ratio}
    if measure == "throughput":
        verdict, difference = p99_verdict(best, peer)
        out.update(ours_p99_ms=best["p99_ms"], peer_p99_ms=peer["p99_ms"], p99=verdict,
                   p99_difference_ms=difference, p99_ok=verdict != "worse")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="take the best engine of this run")
    src.add_argument("--config", type=Path, help="run this engine config first (into --out)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_engine"), help="run dir for --config")
    ap.add_argument("--max-evals", type=int, help="with --config: evaluations of the search")
    ap.add_argument("--id", help="this engine instead of the run's best")
    ap.add_argument("--also", nargs="*", default=[], metavar="ID", help="more engines of the run, side by side")
    ap.add_argument("--duration", type=float, help="measured seconds per contestant [default: the run's]")
    ap.add_argument("--batch", type=int, default=32, help="peers' max batch size (bulk batch size too)")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each contestant, interleaved")
    ap.add_argument("--bulk", type=int, default=512, help="texts of the bulk measure (0: none)")
    ap.add_argument("--bulk-tokens", type=int, help="every bulk text about this many tokens [default: the load's mix]")
    ap.add_argument("--bulk-only", action="store_true", help="skip the serving rounds")
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP servers (evo serve, Infinity)")
    ap.add_argument("--engine-python", help="the interpreter our engines and evo serve run on [default: this one]: "
                    "evoforge's own venv, whose numpy the peers' venv holds back for Infinity")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.json:  # stdout carries the JSON alone: what the libraries print (NNCF's tables) goes to stderr
        json_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    seconds = run_search(args.config, args.out, args.max_evals) if args.config else None
    run_dir = args.out if args.config else args.run_dir
    run = Run.open(run_dir)
    task = EngineTask(run.task_args)
    a = task.args
    threads, duration = task.cores, args.duration or a.duration_s
    cid = args.id or (run.elite_ids(1) or [None])[0]
    if cid is None:
        raise SystemExit(f"no engine elite in {run_dir}")
    cand = run.stored(cid)

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    uncapped = not_capped() if CAPS else {}
    if CAPS and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "DEFAULT", "NO AVX"):
        uncapped["torch"] = f"its kernels run {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY unread)"
    model = task.model()
    texts = task.texts()
    tokens = {t: len(s) for t, s in zip(texts, model.tokenizer.encode_batch(texts), strict=True)}
    st = SentenceTransformer(str(model.path), device="cpu")
    checked = [*texts, *check_sentences()]  # the load's texts and real sentences: the min cosine is over both
    reference = st.encode(checked, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    fresh = task.fresh_texts(salt=11)
    if args.bulk_tokens:
        from runtime.engine.task import FreshTexts

        fresh = FreshTexts(model.tokenizer.vocabulary_words(), {args.bulk_tokens: 1.0}, salt=11)
    bulk_texts = [fresh[i] for i in range(args.bulk)]

    load = {"concurrency": a.concurrency, "duration_s": duration, "warmup_s": a.warmup_s}
    with tempfile.TemporaryDirectory() as tmp, pinned(None, threads) as cores:
        peers, skipped = build_peers(st, model, threads, args.batch, tmp)
        # the elite as evolved, and with its workers of the other kind: threads vs processes, side by side
        kind = task.engine_config(cand.genome).worker_kind
        other = "process" if kind == "thread" else "thread"
        # ours in hosts of their own (filtered, the sandbox user), as served: the clock stays in this process
        py = args.engine_python
        engines = {f"evoforge engine (evolved: {kind} workers)": spawn_elite(run, cand.id, model, runs=Run.open,
                                                                             python=py),
                   f"evoforge engine ({other} workers)": spawn_elite(run, cand.id, model, runs=Run.open,
                                                                     overrides={"worker_kind": other}, python=py)}
        for extra in args.also:
            engines[f"evoforge engine {run.stored(extra).id[:12]}"] = spawn_elite(run, extra, model, runs=Run.open,
                                                                                  python=py)
        for engine in engines.values():
            pin(engine.process.tree(), cores)  # the peers' cores (a process worker forked later inherits them)
        servers: list[HttpServer] = []
        try:
            if not (args.no_http or args.bulk_only):  # started here: they inherit the cores
                servers = start_servers(run_dir, cand.id, model.path, threads, args.batch, Path(tmp), skipped, py)
            with paused(servers):
                similarity = {name: min_cosine(e.embed(checked), reference) for name, e in engines.items()}
                similarity.update({p.name: min_cosine(p.bulk(checked), reference) for p in peers})
            for s in servers:
                with paused(x for x in servers if x is not s):
                    try:
                        similarity[s.name] = min_cosine(s.embed(checked, args.batch), reference)
                    except ServerFailed as exc:
                        skipped[s.name] = str(exc)
            runs, bulk_runs = measure(engines, peers, servers, texts, tokens, bulk_texts, load, args, skipped)
        finally:
            for e in engines.values():
                e.close()
            for s in servers:
                s.close()
    rows, rng = [], np.random.default_rng(0)
    for name in similarity:
        if name in skipped:  # a server that failed after it started
            continue
        peer = next((p for p in peers if p.name == name), None)
        server = next((s for s in servers if s.name == name), None)
        library = peer.library if peer else server.library if server else "evoforge"
        bulk_path = (peer.bulk_path if peer else None if server
                     else "submit_all: longest first to its own queue and workers")  # fmt: skip
        rows.append({"name": name, "ours": library == "evoforge", "mode": "HTTP" if server else "in process",
                     "min_cosine": similarity[name], **median_figures(runs.get(name, []), rng),
                     "bulk": float(np.median(bulk_runs[name])) if bulk_runs.get(name) else None,
                     "bulk_path": bulk_path, "not_capped": uncapped.get(library)})  # fmt: skip
    base = next((r["throughput"] for r in rows if r["name"] == "sentence-transformers"), None)
    for r in rows:
        r["vs_sentence_transformers"] = r["throughput"] / base if base and r["throughput"] else None
    measures = {"throughput": ("serving", None), "throughput_http": ("serving over HTTP", "HTTP"),
                "bulk": ("bulk", None)}  # fmt: skip
    versus_peer = {k: v for k, (_, mode) in measures.items()
                   if (v := versus(rows, "bulk" if k == "bulk" else "throughput", mode))}  # fmt: skip
    for r in rows:
        r["p99_interval"] = p99_interval(r)
        r.pop("p99_resampled", None)
    out = {"run_dir": str(run_dir), "engine": cand.id, "params": cand.genome.params, "threads": threads,
           "cores": sorted(cores), "concurrency": a.concurrency, "lengths": a.lengths, "texts": len(texts),
           "duration_s": duration, "rounds": args.rounds, "peer_batch": args.batch, "search_s": seconds, "rows": rows,
           "bulk_texts": len(bulk_texts), "versus_strongest_peer": versus_peer, "skipped": skipped,
           "cpu_caps": CAPS, "not_capped": uncapped, "versions": versions(),
           "engine_numpy": numpy_of(args.engine_python or sys.executable)}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2), file=json_out, flush=True)
        return
    report(out, model.path.name, cand, measures, avx512=has_avx512())


def measure(engines: dict[str, Any], peers: list[Peer], servers: list[HttpServer], texts: list[str],
            tokens: dict[str, int], bulk_texts: list[str], load: dict[str, Any], args: argparse.Namespace,
            skipped: dict[str, str]) -> tuple[dict[str, list[LoadResult]], dict[str, list[float]]]:  # fmt: skip
    """The serving rounds, then the bulk rounds: every contestant once per round, so that a slow spell of the
    machine hits them all alike. A server that fails goes into ``skipped`` and out of the later rounds."""
    runs: dict[str, list[LoadResult]] = {}
    for _ in range(0 if args.bulk_only else args.rounds):
        with paused(servers):
            for name, engine in engines.items():
                engine.start()
                try:
                    runs.setdefault(name, []).append(closed_loop(engine.submit, texts, **load))
                finally:
                    engine.stop()
            for p in peers:
                if p.serve is None:
                    continue
                # the bench's queue, by length class as the engine's own queue does (bucketing="queue")
                with Batcher(lambda items, f=p.serve: list(f(items)), max_batch=args.batch, token_budget=1 << 30,
                             bucketing=True) as b:  # fmt: skip
                    got = closed_loop(lambda t, b=b: b.submit(t, tokens[t]), texts, **load)
                runs.setdefault(p.name, []).append(got)
        for s in [s for s in servers if s.name not in skipped]:
            with paused(x for x in servers if x is not s):
                try:
                    runs.setdefault(s.name, []).append(closed_loop(s.submit, texts, **load))
                except ServerFailed as exc:
                    skipped[s.name] = str(exc)
                finally:
                    s.disconnect()
    bulk_runs: dict[str, list[float]] = {}
    with paused(servers):
        for _ in range(args.rounds if bulk_texts else 0):
            for name, engine in engines.items():
                bulk_runs.setdefault(name, []).append(engine_bulk(engine, bulk_texts))
            for p in peers:
                bulk_runs.setdefault(p.name, []).append(timed(p.bulk, bulk_texts))
    return runs, bulk_runs


def report(out: dict[str, Any], model_name: str, cand: Any, measures: dict[str, tuple[str, str | None]], *,
           avx512: bool) -> None:  # fmt: skip
    def num(v: float | None, spec: str = ".1f", unit: str = "") -> str:
        return "-" if v is None else f"{v:{spec}}{unit}"

    print(f"{model_name} embeddings under {out['concurrency']} closed-loop clients, {out['threads']} thread(s) on "
          f"cores {out['cores']} (clients, engines, peers and servers alike), {out['texts']} texts, lengths "
          f"{dict(out['lengths'])}, {out['duration_s']:g} s each, median throughput of {out['rounds']} rounds, "
          "latency percentiles over their requests pooled")
    print(f"engine {cand.id[:12]}: {' '.join(f'{k}={v}' for k, v in cand.genome.params.items())}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items())
          + f"; our engines and evo serve on numpy {out['engine_numpy']}")
    print(f"| contestant | mode | sentences/s | vs sentence-transformers | p50 ms | p99 ms (95% interval) | bulk "
          f"sentences/s ({out['bulk_texts']} texts) | min cosine to fp32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out["rows"]:
        vs = num(r["vs_sentence_transformers"], ".2f", "x")
        ci = r.get("p99_interval")
        p99 = num(r["p99_ms"]) + (f" ({ci[0]:.1f}-{ci[1]:.1f})" if ci else "")
        print(f"| {r['name']} | {r['mode']} | {num(r['throughput'])} | {vs} | {num(r['p50_ms'])} | "
              f"{p99} | {num(r['bulk'])} | {r['min_cosine']:.5f} |")
    print(f"serving in process: the peers behind the bench's queue, grouped by length class as the engine's own queue "
          f"does, {out['peer_batch']} a batch at most; over HTTP: each server's own batching (Infinity: length-sorted, "
          f"{out['peer_batch']} at most)")
    print("bulk paths:")
    for r in out["rows"]:
        if r["bulk"] is not None:
            print(f"  {r['name']}: {r['bulk_path']}")
    for key, (label, _) in measures.items():
        v = out["versus_strongest_peer"].get(key)
        if v is None:
            print(f"{label}: no comparison (no figure of ours, or no peer at min cosine >= {FLOOR})")
            continue
        line = f"{label}: {v['ours']} is {v['ratio']:.2f}x the strongest peer at min cosine >= {FLOOR} ({v['peer']})"
        if "p99" in v:
            line += f"; p99 {v['ours_p99_ms']:.1f} vs {v['peer_p99_ms']:.1f} ms"
            if v["p99_difference_ms"]:
                lo, hi = v["p99_difference_ms"]
                line += f" (the difference's 95% interval {lo:+.1f} to {hi:+.1f} ms)"
            line += f": {v['p99']}"
        goal = "met" if v["to_goal"] <= 1 else f"{v['to_goal']:.2f}x further"
        print(f"{line}; the goal of {GOAL:g}x: {goal}")
    if out["cpu_caps"]:
        print("CPU capped at AVX2 (EVOFORGE_CPU_ISA=avx2): " + " ".join(f"{k}={v}" for k, v in out["cpu_caps"].items())
              + ("" if avx512 else " (this CPU has no AVX-512: the cap changes nothing here)"))
        for lib, why in out["not_capped"].items():
            names = [r["name"] for r in out["rows"] if r["not_capped"] == why] or [lib]
            print(f"  not fully capped ({', '.join(names)}): {why}")
    for name, why in out["skipped"].items():
        print(f"not run: {name}: {why}")


if __name__ == "__main__":
    main()
