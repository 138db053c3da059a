"""`evo serve` under HTTP load vs sentence-transformers behind a plain FastAPI endpoint, side by side.

Both servers run on this machine with the same thread count; an aiohttp client drives each with
closed-loop concurrency 1, 4, 16, 64 and an open-loop Poisson rate, after a warm-up, and reports
p50/p90/p99, achieved rate and goodput (requests/s within the latency budget). Prints ratios
(evo serve / baseline) and writes JSON.

    python bench/serve_load.py RUN_DIR [--duration 5] [--rate 20] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TEXTS = [s for s in (Path(__file__).resolve().parents[1] / "tests/data/sentences.txt").read_text().splitlines() if s]


def _baseline_app(threads: int) -> Any:
    """sentence-transformers (torch) behind one FastAPI endpoint, OpenAI-shaped, one request at a time."""
    import torch
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    from runtime.engine.model import default_model_dir

    torch.set_num_threads(threads)
    model = SentenceTransformer(str(default_model_dir()), device="cpu")
    app = FastAPI()

    @app.post("/v1/embeddings")
    def embed(body: dict[str, Any]) -> dict[str, Any]:  # a sync endpoint: FastAPI's thread pool
        texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
        vecs = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
        return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                                           for i, v in enumerate(vecs)]}

    @app.get("/ready")
    def ready() -> dict[str, str]:
        return {"status": "ready"}

    return app


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    import aiohttp

    deadline = time.time() + timeout
    async with aiohttp.ClientSession() as s:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("server not ready in time")


def _summary(lat: list[float], errors: int, seconds: float, budget_ms: float) -> dict[str, Any]:
    a = np.array(lat) * 1000 if lat else np.array([np.nan])
    return {"completed": len(lat), "errors": errors, "rate": len(lat) / seconds,
            "p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "goodput": float((a <= budget_ms).sum()) / seconds}


async def _one(session: Any, url: str, text: str) -> bool:
    async with session.post(url + "/v1/embeddings", json={"input": text, "model": "all-MiniLM-L6-v2",
                                                           "encoding_format": "float"}) as r:
        await r.read()
        return r.status == 200


async def closed_loop(url: str, concurrency: int, warmup: float, duration: float, budget_ms: float) -> dict[str, Any]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    t_start = time.perf_counter()
    window = (t_start + warmup, t_start + warmup + duration)

    async def client(i: int) -> None:
        nonlocal errors
        k = i
        while time.perf_counter() < window[1]:
            t0 = time.perf_counter()
            ok = await _one(session, url, TEXTS[k % len(TEXTS)])
            k += concurrency
            t1 = time.perf_counter()
            if window[0] <= t1 <= window[1]:
                lat.append(t1 - t0) if ok else None
                errors += 0 if ok else 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return _summary(lat, errors, duration, budget_ms)


async def open_loop(url: str, rate: float, warmup: float, duration: float, budget_ms: float) -> dict[str, Any]:
    """Poisson arrivals at ``rate``/s regardless of answers (latency includes any queueing)."""
    import aiohttp

    rng = random.Random(0)
    lat: list[float] = []
    errors = 0
    t_start = time.perf_counter()

    async def fire(i: int, t_sched: float) -> None:
        nonlocal errors
        ok = await _one(session, url, TEXTS[i % len(TEXTS)])
        t1 = time.perf_counter()
        if t_sched >= t_start + warmup:
            lat.append(t1 - t_sched) if ok else None
            errors += 0 if ok else 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, t, i = [], t_start, 0
        while t < t_start + warmup + duration:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(fire(i, t)))
            i += 1
        await asyncio.gather(*tasks)
    return _summary(lat, errors, duration, budget_ms)


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in args.concurrency:
        out[f"closed_c{c}"] = await closed_loop(url, c, args.warmup, args.duration, args.budget_ms)
    out[f"open_{args.rate:g}rps"] = await open_loop(url, args.rate, args.warmup, args.duration, args.budget_ms)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per load level")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each level")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rate", type=float, default=20.0, help="open-loop Poisson arrivals per second")
    ap.add_argument("--budget-ms", type=float, default=250.0, help="latency budget for goodput")
    ap.add_argument("--threads", type=int, default=2, help="threads of each server (torch / engine)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--baseline-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_server:
        import uvicorn

        uvicorn.run(_baseline_app(args.threads), host="127.0.0.1", port=args.baseline_server, log_level="warning")
        return
    if not args.run_dir:
        ap.error("RUN_DIR is required")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    results: dict[str, Any] = {"threads": args.threads, "budget_ms": args.budget_ms, "cores": os.cpu_count()}
    servers = {
        "evo_serve": [sys.executable, "-m", "evo", "serve", args.run_dir, "--elite", "best", "--max-in-flight", "1024"],
        "sentence_transformers": [sys.executable, __file__, "--baseline-server", "{port}", "--threads",
                                  str(args.threads)],
    }
    for name, cmd in servers.items():  # one server at a time: they never compete for the cores
        port = _port()
        cmd = [c.replace("{port}", str(port)) for c in cmd] + (["--port", str(port)] if name == "evo_serve" else [])
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(_wait_ready(url, proc))
            results[name] = asyncio.run(measure(url, args))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    ratios = {k: {"rate": results["evo_serve"][k]["rate"] / max(results["sentence_transformers"][k]["rate"], 1e-9),
                  "p99": results["evo_serve"][k]["p99_ms"] / results["sentence_transformers"][k]["p99_ms"]}
              for k in results["evo_serve"]}
    results["ratios_evo_over_st"] = ratios
    print("level            rate ratio   p99 ratio  (evo serve / sentence-transformers)")
    for k, r in ratios.items():
        print(f"{k:16s} {r['rate']:8.2f}x  {r['p99']:8.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
