"""The best evolved engine against its peers, side by side in one run: same machine, same thread count,
same request texts, same closed-loop concurrency. Our engines run as they are served: in host processes
of their own (the sandbox user, the system-call filter), the load and every clock in this process.

    python bench/engine_vs_peers.py --run-dir runs/engine_minilm
    python bench/engine_vs_peers.py --config configs/engine_minilm.yaml   # runs the search first

Peers (each behind the same kind of queue, taking what is queued up to --batch requests):
sentence-transformers (torch, a plain batching loop over ``encode``); sentence-transformers on OpenVINO
(``backend="openvino"``, exported offline from the same model; the CPU backend sentence-transformers
recommends), in fp32 and with int8 weights where its compression runs offline; ONNX Runtime on the
same model exported to ONNX, in fp32 and with dynamic int8 quantisation (per tensor, its default; and
per channel); FastEmbed on that ONNX export (a local model: nothing downloaded). A peer that cannot run
here is listed with the reason. Two measures, side by side in one run: serving (closed-loop clients at
the task's concurrency: sentences/s and p50/p99 latency) and bulk (``--bulk`` texts embedded at once,
each contestant's own batching). Prints each one's minimum cosine to the fp32 reference
(sentence-transformers) too. Needs the ``bench`` and ``engine`` extras, and ``peers`` for OpenVINO
and FastEmbed.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from archive import read_run  # noqa: E402
from runtime.engine import Batcher, LoadResult, closed_loop  # noqa: E402
from runtime.engine.hosted import pin, spawn_elite  # noqa: E402
from runtime.engine.task import EngineTask  # noqa: E402
from runtime.timing import pinned  # noqa: E402

Embed = Callable[[list[str]], np.ndarray]


def run_search(config: Path, run_dir: Path, max_evals: int | None) -> float:
    t0 = time.monotonic()
    extra = ["--max-evals", str(max_evals)] if max_evals else []
    subprocess.run([sys.executable, "-m", "evo", "run", str(config), "--run-dir", str(run_dir), *extra], check=True,
                   cwd=ROOT)
    return time.monotonic() - t0


def min_cosine(got: np.ndarray, reference: np.ndarray) -> float:
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
    return float(np.min(np.sum(got * reference, axis=1) / norms))


def median_figures(runs: Sequence[LoadResult]) -> dict[str, Any]:
    """The median of each figure over the rounds, and each round's throughput (``None``s: no round)."""
    if not runs:
        return {"throughput": None, "p50_ms": None, "p99_ms": None, "completed": 0, "rounds": []}
    return {"throughput": float(np.median([r.throughput for r in runs])),
            "p50_ms": float(np.median([r.p50_ms for r in runs])),
            "p99_ms": float(np.median([r.p99_ms for r in runs])),
            "completed": int(sum(r.completed for r in runs)),
            "rounds": [round(r.throughput, 1) for r in runs]}


def onnx_peers(st: Any, threads: int, tmp: str, tokenizer: Any, pooling: str) -> dict[str, Embed]:
    """ONNX Runtime sessions (fp32, dynamic int8 per tensor, dynamic int8 per channel) of the same model, pooled
    as the model pools (``mean`` or ``cls``)."""
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    class Wrapped(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            # the additive [n, 1, 1, L] mask, made here: transformers' own mask builders do not trace
            additive = (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
            return self.bert(input_ids=ids, attention_mask=additive, token_type_ids=types).last_hidden_state

    fp32 = os.path.join(tmp, "minilm.onnx")
    names = ["input_ids", "attention_mask", "token_type_ids"]
    dummy = tuple(torch.ones((2, 8), dtype=torch.long) for _ in names)
    torch.onnx.export(Wrapped(st[0].auto_model.eval()), dummy, fp32, input_names=names,
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={k: {0: "batch", 1: "tokens"} for k in [*names, "last_hidden_state"]})
    paths = {"onnxruntime fp32": fp32}
    for label, per_channel in (("onnxruntime int8 dynamic", False), ("onnxruntime int8 per-channel", True)):
        out = os.path.join(tmp, f"minilm_int8_{per_channel}.onnx")
        quantize_dynamic(fp32, out, weight_type=QuantType.QInt8, per_channel=per_channel)
        paths[label] = out
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL

    def make(path: str) -> Embed:
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

        def embed(texts: list[str]) -> np.ndarray:
            seqs = tokenizer.encode_batch(texts)
            n, longest = len(seqs), max(len(s) for s in seqs)
            ids = np.zeros((n, longest), np.int64)
            mask = np.zeros((n, longest), np.int64)
            for i, s in enumerate(seqs):
                ids[i, : len(s)], mask[i, : len(s)] = s, 1
            hidden = sess.run(None, {"input_ids": ids, "attention_mask": mask,
                                     "token_type_ids": np.zeros_like(ids)})[0]
            if pooling == "cls":
                pooled = hidden[:, 0]
            else:
                pooled = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
            return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

        return embed

    return {label: make(p) for label, p in paths.items()}


def openvino_peers(model_dir: Path, threads: int, tmp: str) -> tuple[dict[str, Embed], dict[str, str]]:
    """sentence-transformers on OpenVINO, fp32 and int8 weights (exported from a copy of the local model:
    the package's directory may be read-only); and why any of them cannot run."""
    import shutil

    from sentence_transformers import SentenceTransformer

    peers: dict[str, Embed] = {}
    skipped: dict[str, str] = {}
    local = Path(tmp) / "minilm-openvino"
    shutil.copytree(model_dir, local)
    config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY"}
    for label, extra in (("openvino fp32", {}), ("openvino int8 weights", {"load_in_8bit": True})):
        try:
            ov = SentenceTransformer(str(local), device="cpu", backend="openvino",
                                     model_kwargs={"ov_config": config, **extra})  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run offline is reported, not fatal
            skipped[f"sentence-transformers {label}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        peers[f"sentence-transformers {label}"] = (
            lambda batch, m=ov: m.encode(batch, batch_size=len(batch), normalize_embeddings=True,
                                         convert_to_numpy=True))  # fmt: skip
    return peers, skipped


def fastembed_peer(onnx_path: str, model: Any, threads: int, tmp: str) -> tuple[dict[str, Embed], dict[str, str]]:
    """FastEmbed on the ONNX export, registered as a local custom model (its tokenizer files beside it), pooled
    and normalised as the model is."""
    import shutil

    try:
        from fastembed import TextEmbedding
        from fastembed.common.model_description import ModelSource, PoolingType
    except ImportError as exc:
        return {}, {"fastembed": f"not installed ({exc.name}): pip install -c constraints.txt -e '.[peers]'"}
    local = Path(tmp) / "minilm-fastembed"
    local.mkdir()
    shutil.copy(onnx_path, local / "model.onnx")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json", "vocab.txt"):
        if (model.path / name).exists():  # a recent transformers writes no special_tokens_map.json
            shutil.copy(model.path / name, local / name)
    cfg = model.config
    name, pooling = f"local/{model.path.name}", PoolingType.CLS if cfg.pooling == "cls" else PoolingType.MEAN
    try:
        TextEmbedding.add_custom_model(model=name, pooling=pooling,
                                       normalization=cfg.normalize, sources=ModelSource(hf=name), dim=cfg.hidden,
                                       model_file="model.onnx")  # fmt: skip
        fe = TextEmbedding(name, specific_model_path=str(local), threads=threads)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {}, {"fastembed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"fastembed (onnx fp32)": lambda batch: np.stack(list(fe.embed(batch, batch_size=len(batch))))}, {}


def bulk(embed: Embed, texts: list[str], batch: int) -> float:
    """Sentences/s of ``embed`` over all of ``texts``, ``batch`` at a time."""
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        embed(texts[i : i + batch])
    return len(texts) / (time.perf_counter() - t0)


def engine_bulk(engine: Any, texts: list[str]) -> float:
    """Sentences/s of the engine over all of ``texts`` submitted at once to its own batcher and workers."""
    engine.start()
    try:
        t0 = time.perf_counter()
        for fut in [engine.submit(t) for t in texts]:
            fut.result()
        return len(texts) / (time.perf_counter() - t0)
    finally:
        engine.stop()


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
    ap.add_argument("--batch", type=int, default=32, help="peers' max batch size")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each contestant, interleaved")
    ap.add_argument("--bulk", type=int, default=512, help="texts of the bulk measure (0: none)")
    ap.add_argument("--bulk-tokens", type=int, help="every bulk text about this many tokens [default: the load's mix]")
    ap.add_argument("--bulk-only", action="store_true", help="skip the serving rounds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seconds = run_search(args.config, args.out, args.max_evals) if args.config else None
    run_dir = args.out if args.config else args.run_dir
    run = read_run(run_dir)
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
    model = task.model()
    texts = task.texts()
    st = SentenceTransformer(str(model.path), device="cpu")
    reference = st.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)

    def st_embed(batch: list[str]) -> np.ndarray:
        return st.encode(batch, batch_size=len(batch), normalize_embeddings=True, convert_to_numpy=True)

    load = {"concurrency": a.concurrency, "duration_s": duration, "warmup_s": a.warmup_s}
    with tempfile.TemporaryDirectory() as tmp, pinned(None, threads) as cores:
        peers: dict[str, Embed] = {"sentence-transformers": st_embed,
                                   **onnx_peers(st, threads, tmp, model.tokenizer, model.config.pooling)}
        ov, skipped = openvino_peers(model.path, threads, tmp)
        fe, fe_skipped = fastembed_peer(os.path.join(tmp, "minilm.onnx"), model, threads, tmp)
        peers.update({**ov, **fe})
        skipped.update(fe_skipped)
        # the elite as evolved, and with its workers of the other kind: threads vs processes, side by side
        kind = task.engine_config(cand.genome).worker_kind
        other = "process" if kind == "thread" else "thread"
        # ours in hosts of their own (filtered, the sandbox user), as served: the clock stays in this process
        engines = {f"evoforge engine (evolved: {kind} workers)": spawn_elite(run, cand.id, model, runs=read_run),
                   f"evoforge engine ({other} workers)": spawn_elite(run, cand.id, model, runs=read_run,
                                                                     overrides={"worker_kind": other})}
        for extra in args.also:
            engines[f"evoforge engine {run.stored(extra).id[:12]}"] = spawn_elite(run, extra, model, runs=read_run)
        for engine in engines.values():
            pin(engine.process.tree(), cores)  # the peers' cores (a process worker forked later inherits them)
        similarity = {name: min_cosine(e.embed(texts), reference) for name, e in engines.items()}
        for name, embed in peers.items():
            got = np.concatenate([embed(list(texts[i : i + 32])) for i in range(0, len(texts), 32)])
            similarity[name] = min_cosine(got, reference)
        # rounds: every contestant once per round, so a slow spell of the machine hits them all alike
        runs: dict[str, list[LoadResult]] = {name: [] for name in similarity}
        for _ in range(0 if args.bulk_only else args.rounds):
            for name, engine in engines.items():
                engine.start()
                try:
                    runs[name].append(closed_loop(engine.submit, texts, **load))
                finally:
                    engine.stop()
            for name, embed in peers.items():
                with Batcher(lambda items, f=embed: list(f(items)), max_batch=args.batch, token_budget=1 << 30) as b:
                    runs[name].append(closed_loop(b.submit, texts, **load))
        # bulk: many short texts at once, each contestant batching its own way, in interleaved rounds too
        fresh = task.fresh_texts(salt=11)
        if args.bulk_tokens:
            from runtime.engine.task import FreshTexts

            fresh = FreshTexts(model.tokenizer.vocabulary_words(), {args.bulk_tokens: 1.0}, salt=11)
        bulk_texts = [fresh[i] for i in range(args.bulk)]
        bulk_runs: dict[str, list[float]] = {name: [] for name in similarity}
        for _ in range(args.rounds if bulk_texts else 0):
            for name, engine in engines.items():
                bulk_runs[name].append(engine_bulk(engine, bulk_texts))
            for name, embed in peers.items():
                bulk_runs[name].append(bulk(embed, bulk_texts, args.batch))
        for e in engines.values():
            e.close()
    rows = [{"name": name, "min_cosine": similarity[name], **median_figures(rs),
             "bulk": float(np.median(bulk_runs[name])) if bulk_runs[name] else None} for name, rs in runs.items()]
    base = next(r["throughput"] for r in rows if r["name"] == "sentence-transformers")
    for r in rows:
        r["vs_sentence_transformers"] = r["throughput"] / base if base and r["throughput"] else None
    ours = [r for r in rows if r["name"].startswith("evoforge")]
    theirs = [r for r in rows if not r["name"].startswith("evoforge") and r["min_cosine"] >= 0.99]
    versus = {}
    for measure in ("throughput", "bulk"):
        if theirs and ours and all(r[measure] for r in ours + theirs):
            best, peer = max(ours, key=lambda r: r[measure]), max(theirs, key=lambda r: r[measure])
            versus[measure] = {"ours": best["name"], "peer": peer["name"], "ratio": best[measure] / peer[measure]}
    out = {"run_dir": str(run_dir), "engine": cand.id, "params": cand.genome.params, "threads": threads,
           "cores": sorted(cores), "concurrency": a.concurrency, "lengths": a.lengths, "texts": len(texts),
           "duration_s": duration, "rounds": args.rounds, "peer_batch": args.batch, "search_s": seconds, "rows": rows,
           "bulk_texts": len(bulk_texts), "versus_strongest_peer": versus, "skipped": skipped}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{model.path.name} embeddings under {a.concurrency} closed-loop clients, {threads} thread(s) on cores "
          f"{sorted(cores)}, {len(texts)} texts, lengths {dict(a.lengths)}, {duration:g} s each, "
          f"median of {args.rounds} rounds")
    print(f"engine {cand.id[:12]}: {' '.join(f'{k}={v}' for k, v in cand.genome.params.items())}")
    print(f"| engine | sentences/s | vs sentence-transformers | p50 ms | p99 ms | bulk sentences/s ({len(bulk_texts)} "
          "texts) | min cosine to fp32 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    def num(v: float | None, spec: str = ".1f", unit: str = "") -> str:
        return "-" if v is None else f"{v:{spec}}{unit}"

    for r in rows:
        print(f"| {r['name']} | {num(r['throughput'])} | {num(r['vs_sentence_transformers'], '.2f', 'x')} | "
              f"{num(r['p50_ms'])} | {num(r['p99_ms'])} | {num(r['bulk'])} | {r['min_cosine']:.5f} |")
    for measure, v in versus.items():
        print(f"{measure}: {v['ours']} is {v['ratio']:.2f}x the strongest peer at min cosine >= 0.99 ({v['peer']}); "
              f"1.5x is {1.5 / v['ratio']:.2f}x further")
    for name, why in skipped.items():
        print(f"not run: {name}: {why}")


if __name__ == "__main__":
    main()
