"""The language-model operators' funnel with a real small model: SmolLM2-135M-Instruct served by `evo serve --gguf`
on this machine, driving short matmul searches. Each arm is its own `evo run`; the table is each operator's
funnel from `evo archive stats` (proposals, applied, compiled, correct, improved, tokens).

Arms (all on configs/matmul_cpu_selfhosted.yaml, at a smaller matmul so evaluations stay short):
- ``params-structured``: llm_params alone, the space's JSON schema sent as ``response_format`` (the server
  enforces it token by token);
- ``params-prompt``: llm_params alone, JSON asked for in the prompt only (``structured_output: off``);
- ``diff-structured``: llm_diff alone, its line-range edits' JSON schema sent as ``response_format`` (from and to
  can only be lines the parent has);
- ``diff-prompt``: llm_diff alone, SEARCH/REPLACE blocks asked for in the prompt only;
- ``rewrite``: llm_rewrite alone (one fenced block of code);
- ``agentic``: the agentic loop alone, every turn a tool call the server enforces (``--agentic-steps`` turns at
  most per proposal);
- ``params-scripted``: llm_params against a scripted endpoint that answers a random valid point of the space
  (what the pipeline gives a perfect answerer);
- ``classical``: mutate, crossover and random with the same number of evaluations as ``params-structured``.

This is not a claim about what a 135M model finds; it shows whether the prompts, parsers and the structured
output hold up against a real model's answers.

    python bench/llm_funnel.py --proposals 60 --code-proposals 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.decoder.models import model_file  # noqa: E402
from runtime.hardware import fingerprint  # noqa: E402

CONFIG = ROOT / "configs" / "matmul_cpu_selfhosted.yaml"
CLASSICAL = {"mutate": 0.6, "crossover": 0.3, "random": 0.1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def scripted(seed: int, task: str) -> Iterator[str]:
    """An OpenAI-compatible endpoint that answers every chat completion with a random point of ``task``'s space
    that holds its constraints, as JSON; yields its base URL."""
    from runtime.task import load_task_class

    space, rng = load_task_class(task)().space(), np.random.default_rng(seed)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers.get("content-length", 0)))
            text = json.dumps(space.sample(rng))
            body = json.dumps({"id": "scripted", "object": "chat.completion", "created": 0, "model": "scripted",
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": text}}],
                               "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def served(model: Path, threads: int, log: Path) -> Iterator[str]:
    """`evo serve --gguf model` on a free port; yields its base URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "evo", "serve", "--gguf", str(model), "--port", str(port), "--threads", str(threads)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"evo serve exited with {proc.returncode}: see {log}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise SystemExit(f"evo serve was not ready within 300 s: see {log}")
            time.sleep(0.5)
        yield url + "/v1"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()


SLOT_TASKS = {"attention_decode": "key_block", "attention_decode_f16": "key_block", "rmsnorm": "vector_width"}
"""Slot kernels the funnel runs on (``--task``), and the descriptor each is binned by."""

CODE_ARMS = {"diff-structured": "llm_diff", "diff-prompt": "llm_diff", "rewrite": "llm_rewrite"}
"""The code arms: llm_diff with its line-range schema enforced, llm_diff asked for SEARCH/REPLACE blocks in the
prompt alone, llm_rewrite (a fenced block: no schema)."""


def arm_config(url: str, model_id: str, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = yaml.safe_load(CONFIG.read_text())
    if args.task == "matmul":
        cfg["task"]["args"] = {"m": args.n, "n": args.n, "k": args.n, "threads": 1}
    else:  # a slot kernel at its own timed case, binned by its own descriptor
        cfg["task"] = {"name": args.task, "args": {}}
        cfg["archive"] = {"kind": "grid", "descriptors": [SLOT_TASKS[args.task]], "bins": 8}
    cfg["evaluation"]["timing"] = {"warmup": 1, "min_repeats": 3, "max_repeats": 10, "max_seconds": 0.2}
    search = cfg["search"]
    search.update(seed=args.seed, workers=1, initial_random=0, confirm={"repeats": 0})
    (model,) = cfg["llm"]["models"]
    model.update(base_url=url, model=model_id, max_tokens=args.max_tokens, temperature=0.7, timeout=600,
                 max_concurrency=1)  # fmt: skip
    cfg["llm"]["prompts"] = {"max_chars": args.max_chars}
    cfg["memory"] = {"enabled": False}
    if arm == "classical":
        search["operators"] = {"weights": CLASSICAL}
        del cfg["llm"]
        cfg["budget"] = {"max_evals": args.proposals + 2, "max_time": args.max_time}
        return cfg
    if arm == "agentic":
        search["operators"] = {"weights": {"agentic": 1.0}}
        model["max_tokens"] = args.code_max_tokens
        cfg["llm"]["agentic"] = {"max_steps": args.agentic_steps, "max_seconds": args.max_time, "max_tokens": 200000}
        cfg["budget"] = {"max_evals": args.agentic_proposals + 2, "max_time": args.max_time}
        return cfg
    if arm in CODE_ARMS:
        search["operators"] = {"weights": {CODE_ARMS[arm]: 1.0}}
        model["max_tokens"] = args.code_max_tokens
        model["structured_output"] = "off" if arm == "diff-prompt" else "on"
        proposals = args.code_proposals
    else:
        search["operators"] = {"weights": {"llm_params": 1.0}}
        model["structured_output"] = "on" if arm == "params-structured" else "off"
        proposals = args.proposals
    cfg["llm"]["retry_rejected"] = False  # one call per proposal: the funnel counts answers as they came
    cfg["budget"] = {"max_evals": proposals + 2, "max_time": args.max_time}  # the seeds, then one per proposal
    return cfg


def run_arm(arm: str, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    path = work / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = work / arm
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(run_dir), "--no-confirm"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"{arm}: evo run failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    stats = subprocess.run([sys.executable, "-m", "evo", "archive", "stats", str(run_dir), "--json"], cwd=ROOT,
                           capture_output=True, text=True, check=True)  # fmt: skip
    return {"wall_s": wall, "stats": json.loads(stats.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposals", type=int, default=60, help="llm_params proposals per params arm")
    ap.add_argument("--code-proposals", type=int, default=20, help="evaluations of each code arm at most")
    ap.add_argument("--agentic-proposals", type=int, default=5, help="proposals of the agentic arm")
    ap.add_argument("--agentic-steps", type=int, default=4, help="turns per agentic proposal at most")
    ap.add_argument("--max-time", type=float, default=900.0, help="seconds per arm at most")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per llm_params answer at most")
    ap.add_argument("--code-max-tokens", type=int, default=768, help="tokens per llm_diff/llm_rewrite answer at most")
    ap.add_argument("--max-chars", type=int, default=6000, help="the prompts' size bound (llm.prompts.max_chars)")
    ap.add_argument("--n", type=int, default=256, help="the matmul's size (m = n = k)")
    ap.add_argument("--task", choices=("matmul", *SLOT_TASKS), default="matmul",
                    help="the task searched: the default matmul, or a slot kernel at its own timed case")
    ap.add_argument("--threads", type=int, default=2, help="the server's threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", nargs="+", default=["params-structured", "params-prompt", "params-scripted",
                                                  *CODE_ARMS, "agentic", "classical"])  # fmt: skip
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    model = Path(model_file("smollm2"))
    model_id = model.stem
    work = args.work or Path(tempfile.mkdtemp(prefix="evoforge-funnel-"))
    work.mkdir(parents=True, exist_ok=True)
    hw = fingerprint()
    print(f"model {model.name}; runs in {work}; CPU {hw.get('cpu_model')}, {hw.get('cores')} cores", flush=True)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        url = None
        for arm in args.arms:
            print(f"== {arm}", flush=True)
            if arm == "params-scripted":
                arm_url = stack.enter_context(scripted(args.seed, args.task))
            else:
                url = url or stack.enter_context(served(model, args.threads, work / "serve.log"))
                arm_url = url
            results[arm] = run_arm(arm, arm_config(arm_url, model_id, arm, args), work)
            _print_arm(results[arm])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def _print_arm(result: dict[str, Any]) -> None:
    ops = result["stats"].get("by_operator_detail", {})
    print(f"  {'operator':<12} {'proposals':>9} {'applied':>8} {'compiled':>8} {'correct':>8} {'improved':>8}"
          f" {'tokens':>8}   ({result['wall_s']:.0f} s)")  # fmt: skip
    for name, row in sorted(ops.items()):
        print(f"  {name:<12} {row['proposals']:>9} {row['applied']:>8} {row['compiled']:>8} {row['correct']:>8}"
              f" {row['improved']:>8} {row['tokens']:>8}")  # fmt: skip


if __name__ == "__main__":
    main()
