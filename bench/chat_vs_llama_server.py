"""Chat serving under concurrency: ``evo serve --gguf`` against llama.cpp's ``llama-server`` on the same GGUF file,
the same cores, the same load, side by side in one run.

    python bench/chat_vs_llama_server.py --llama-server /path/to/llama-server      # SmolLM2-135M-Instruct
    python bench/chat_vs_llama_server.py --streams 8 --requests 3 --threads 2 --linear numpy int8

The load: ``--streams`` closed-loop clients, each sending streamed chat requests (OpenAI's API, ``stream: true``)
one after another, ``--requests`` each. Every prompt is fresh: a user message cut from this repository's docs at
its own offset, its length drawn from ``--prompt-tokens`` (32-512 by default), the same sequence of prompts for
every contestant. Each asks for ``--max-tokens`` (128) with ``ignore_eos``, greedy, so every answer has the same
length on every server. Each server runs on its own, one after another, each round in turn, after one warm-up
request.

Reported per contestant (median over the rounds): aggregate output tokens/s (completion tokens the servers
counted, over the wall time from the first request to the last answer), TTFT p50/p99 (request sent to first
token), ITL p50/p99 (gap between successive streamed tokens), the server's peak resident memory (its processes
together), and the ratios to llama-server (> 1: ours more tokens/s; < 1: ours a shorter p99 ITL).

Contestants: ``evo serve --gguf`` once per ``--linear`` (numpy: fp32 weights on BLAS; int8: the linear slot's C
kernel; see ``evo serve --help``) and per ``--ours`` (its flags as given), ``evo serve`` of each ``--served`` run
or factory (e.g. ``follow:factories/factory_smollm2``: its promoted engine, evolved kernels in a confined
process, on the threads its engine was searched with; ``promotions:FACTORY_DIR``: each engine the factory has
promoted, so that the served engine's tokens/s against time is re-measured side by side), and ``llama-server`` with
``--parallel`` equal to the streams (continuous batching, its default), the file's own quantised types, a
context of the streams' sum, and its threads set to the same count. Build llama-server from the
``llama-cpp-python`` sdist's vendored llama.cpp with ``bench/build_llama_server.sh``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _models import gguf_model  # noqa: E402 - beside this script

from runtime.decoder.chat_load import LoadFailed, chat, draw_prompts, run_load  # noqa: E402

LLAMA = "llama-server"


def prompts(model: Path, count: int, lo: int, hi: int, seed: int) -> list[str]:
    """``count`` user messages cut from the repository's docs, each ``lo``..``hi`` tokens long (the model's own
    tokenizer counts them), each from another offset."""
    from runtime.decoder.gguf_file import GGUFFile
    from runtime.decoder.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile(model))
    corpus = tokenizer.encode("\n".join((ROOT / n).read_text(encoding="utf-8") for n in ("README.md", "BENCHMARKS.md")))
    return draw_prompts(tokenizer, corpus, count, lo, hi, random.Random(seed))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and its children."""
    from runtime.sandbox.hosted_engine import process_tree

    total = 0
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


class ServerFailed(RuntimeError):
    """A server exited or was not ready in time."""


class Server:
    """One contestant's server process on a loopback port, ready once ``GET /health`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.port, self.log = name, port, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)  # fmt: skip
        self.peak_rss = 0
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                failed = ServerFailed(f"{name} exited with {self.proc.returncode}: "
                                      f"{log.read_text(errors='replace')[-800:]}")  # fmt: skip
                failed.code = self.proc.returncode  # type: ignore[attr-defined]
                raise failed
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            time.sleep(0.5)
        self.close()
        raise ServerFailed(f"{name} not ready after 600 s: {log.read_text(errors='replace')[-800:]}")

    def sample_rss(self) -> None:
        self.peak_rss = max(self.peak_rss, _tree_rss(self.proc.pid))

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def load(server: Server, texts: list[str], streams: int, max_tokens: int) -> dict[str, float]:
    """``streams`` closed-loop clients over ``texts`` (client ``i`` takes every ``streams``-th); the figures."""
    try:
        measured = run_load(server.port, texts, streams, max_tokens, tick=server.sample_rss)
    except LoadFailed as exc:
        sys.exit(f"error: {server.name}: {exc}")
    return {**measured.figures(), "rss_mb": server.peak_rss / 2**20}


NOTES: dict[str, str] = {}
OURS: dict[str, list[str]] = {}  # each evo serve contestant's name: its flags
SERVED: dict[str, list[str]] = {}  # each evo serve contestant of a run or a factory: what evo serve is given
SINCE: dict[str, float] = {}  # a factory's promoted contestant: minutes from the factory's start to its promotion


def served_args(what: str) -> list[str]:
    """``evo serve``'s arguments for a ``--served`` contestant: ``RUN_DIR``, ``RUN_DIR:ELITE`` or
    ``follow:FACTORY_DIR``."""
    if what.startswith("follow:"):
        return ["--follow", what.removeprefix("follow:")]
    run_dir, _, elite = what.partition(":")
    return [run_dir, *(["--elite", elite] if elite else [])]


def add_served(what: str) -> None:
    """``--served WHAT`` as contestants: one, or each promotion of a factory for ``promotions:FACTORY_DIR``."""
    if not what.startswith("promotions:"):
        SERVED[f"evo serve {what}"] = served_args(what)
        return
    from archive import FactoryDir

    factory = FactoryDir(Path(what.removeprefix("promotions:")))
    promotions = factory.promotions()
    if not promotions:
        sys.exit(f"error: {factory.path} has promoted no engine yet: run evo factory on it first")
    started = min(e["at"] for e in factory.events())
    for p in promotions:
        name = f"evo serve round {p['round']} ({p['elite'][:12]})"
        SERVED[name] = [p["run_dir"], "--elite", p["elite"]]
        SINCE[name] = (p["at"] - started) / 60


def start(name: str, args: argparse.Namespace, log_dir: Path) -> Server:
    """``name``'s server, ready. llama-server's repacked weights (its AMX path on such a CPU) fault under some
    hypervisors: where it dies of a signal, it is started again with ``--no-repack``, and the report says so."""
    try:
        return _start(name, args, log_dir, no_repack=name in NOTES)
    except ServerFailed as exc:
        if name != LLAMA or name in NOTES or (getattr(exc, "code", 0) or 0) >= 0:
            sys.exit(f"error: {exc}")
        NOTES[name] = f"(its repacked weights died of signal {-exc.code}: run with --no-repack)"
        return _start(name, args, log_dir, no_repack=True)


def _start(name: str, args: argparse.Namespace, log_dir: Path, *, no_repack: bool) -> Server:
    port, threads = _free_port(), str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if name == LLAMA:
        ctx = args.streams * (args.prompt_tokens[1] + args.max_tokens + 64)
        cmd = [args.llama_server, "-m", str(args.model), "--port", str(port), "--host", "127.0.0.1", "-t", threads,
               "-tb", threads, "--parallel", str(args.streams), "-c", str(ctx), "--no-webui"]  # fmt: skip
        cmd += ["--no-repack"] if no_repack else []
    elif name in SERVED:  # its engine's own settings (its threads among them): nothing added
        cmd = [sys.executable, "-m", "evo", "serve", *SERVED[name], "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "evo", "serve", "--gguf", str(args.model), "--port", str(port), "--threads",
               threads, *OURS[name]]  # fmt: skip
        cmd += ["--step-tokens", str(args.step_tokens)] if args.step_tokens else []
        cmd += ["--kv-dtype", args.kv_dtype] if args.kv_dtype else []
    return Server(name, cmd, port, env, log_dir / f"{name.split()[0]}-{port}.log")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 or gemma3 (their packages' files)")
    ap.add_argument("--llama-server", default=shutil.which("llama-server") or os.environ.get("LLAMA_SERVER"),
                    help="llama-server's binary (default: on PATH, or $LLAMA_SERVER)")  # fmt: skip
    ap.add_argument("--linear", nargs="*", default=["numpy", "int8"],
                    help="evo serve contestants, by --linear (none: only those of --ours)")
    ap.add_argument("--ours", nargs="+", default=[], metavar="FLAGS",
                    help="more evo serve contestants, each by its flags (e.g. '--linear int8 --kv-dtype f16')")
    ap.add_argument("--served", nargs="+", default=[], metavar="WHAT",
                    help="more evo serve contestants, each what evo serve serves: a run directory (its best "
                         "engine), RUN_DIR:ELITE, or follow:FACTORY_DIR (its latest promotion)")  # fmt: skip
    ap.add_argument("--step-tokens", type=int, default=None, help="evo serve's --step-tokens (default: its own)")
    ap.add_argument("--kv-dtype", default=None, help="evo serve's --kv-dtype (default: its own)")
    ap.add_argument("--streams", type=int, default=8, help="concurrent chat clients")
    ap.add_argument("--requests", type=int, default=3, help="requests per client per round")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of every request")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads of every server")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per contestant (the median is reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.model = gguf_model(args.model)
    if not args.llama_server or not Path(args.llama_server).exists():
        sys.exit("error: no llama-server: build it with bench/build_llama_server.sh and give --llama-server PATH")
    for flags in [f"--linear {x}" for x in args.linear] + args.ours:
        OURS[f"evo serve ({flags})"] = flags.split()
    for what in args.served:
        add_served(what)
    names = [*OURS, *SERVED, LLAMA]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "chat_vs_llama_server"
    log_dir.mkdir(exist_ok=True)
    per_round = args.streams * args.requests
    texts = prompts(args.model, per_round * args.rounds + 1, *args.prompt_tokens, args.seed)
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        batch = texts[1 + r * per_round : 1 + (r + 1) * per_round]  # fresh prompts each round, the same for all
        for name in names:
            server = start(name, args, log_dir)
            try:
                chat(server.port, texts[0], 8)  # warm-up
                results[name].append(load(server, batch, args.streams, args.max_tokens))
            finally:
                server.close()
            got = results[name][-1]
            print(f"  round {r + 1} {name}: {got['tokens_per_s']:.1f} tok/s, ITL p99 {got['itl_p99'] * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
    print(f"{args.model.name}: {args.streams} streams, {args.requests} requests each per round, prompts "
          f"{args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, {args.max_tokens} output tokens, {args.threads} "
          f"threads, median of {args.rounds} rounds")  # fmt: skip
    med = {n: {k: median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    ref = med[LLAMA]
    for name, m in med.items():
        ms = {k: m[k] * 1e3 for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
        line = (f"  {name:24s} {m['tokens_per_s']:7.1f} tok/s   TTFT p50 {ms['ttft_p50']:6.0f} p99 "
                f"{ms['ttft_p99']:6.0f} ms   ITL p50 {ms['itl_p50']:5.1f} p99 {ms['itl_p99']:6.1f} ms   "
                f"RSS {m['rss_mb']:5.0f} MiB   ({m['tokens']:.0f} tokens, prompts {m['prompt_tokens']:.0f} on average)")
        if name != LLAMA:
            x = {k: m[k] / ref[k] for k in ("tokens_per_s", "itl_p99", "ttft_p99")}
            line += (f"\n  {'':24s} vs llama-server: tokens/s x{x['tokens_per_s']:.2f}, ITL p99 x{x['itl_p99']:.2f}, "
                     f"TTFT p99 x{x['ttft_p99']:.2f}")
        line += f"\n  {'':24s} served from {SINCE[name]:.0f} min after the factory started" if name in SINCE else ""
        print(line + (f"\n  {'':24s} {NOTES[name]}" if name in NOTES else ""))


if __name__ == "__main__":
    main()
