"""The in-process peers of ``bench/engine_vs_peers.py``: each library embedding the model at its best.

A :class:`Peer` has two ways in. ``serve`` embeds one batch: the bench's serving load calls it from a queue
that groups requests by length class, as the engine's own queue does. ``bulk`` embeds a whole list by the
library's own bulk path: ``SentenceTransformer.encode(texts, batch_size=...)`` for torch and OpenVINO (it sorts
by length); FastEmbed's ``embed(texts, batch_size=...)`` (it batches in arrival order, so it is measured a
second time through :func:`length_sorted`); ONNX Runtime, which has no bulk path, through :func:`length_sorted`.

:func:`cap_cpu` caps the libraries at AVX2 under ``EVOFORGE_CPU_ISA=avx2``: through the CPUID mask where the CPU can
fault CPUID (:func:`runtime.isa.cpuid_mask_environ`: every library), and each library's own setting besides;
:func:`not_capped` says which ones stay uncapped, and why.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from runtime import isa  # first: under EVOFORGE_CPU_ISA, importing runtime caps the BLAS before numpy loads

# isort: split
import numpy as np

__all__ = ["ISA_CAP", "Peer", "build_peers", "cap_cpu", "has_avx512", "length_sorted", "not_capped", "versions"]

Embed = Callable[[list[str]], Any]  # texts -> [n, dim] embeddings

# What caps the peers' libraries beyond what evoforge caps for itself (runtime.isa: OpenBLAS, oneDNN, ATen).
_PEER_CAPS = {
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # PyTorch's GEMMs run in MKL
    "OV_CPU_MAX_ISA": "AVX2",  # OpenVINO's own kernels (read by debug-caps builds only, see ISA_CAP)
}

ISA_CAP: dict[str, str | None] = {
    # library -> None where its own settings cap it, else why not (fully): what stays uncapped without the CPUID mask
    "evoforge": None,
    "torch": None,  # ATen (ATEN_CPU_CAPABILITY), MKL (MKL_ENABLE_INSTRUCTIONS), oneDNN (ONEDNN_MAX_CPU_ISA)
    "openvino": "partly: its oneDNN primitives honour ONEDNN_MAX_CPU_ISA, its own JIT kernels do not (OV_CPU_MAX_ISA "
                "works in debug-caps builds only, openvinotoolkit/openvino#36980; release builds: #38257, open), and "
                "nodes whose two caps disagree can compute wrong results (#38189): see its min cosine",
    "onnxruntime": "no: MLAS picks its kernels from the CPU at run time and has no cap (microsoft/onnxruntime#12479; "
                   "#20215 proposes a build-time switch only)",
    "fastembed": "no: it runs on ONNX Runtime, whose MLAS has no cap",
}


def cap_cpu() -> dict[str, str]:
    """Under ``EVOFORGE_CPU_ISA=avx2``, sets in this process's environment the variables that cap the libraries
    at AVX2 (each only where unset), and returns what it set; ``{}`` otherwise. Where the CPU can fault CPUID, it
    first starts the program again with its CPUID masked (:func:`runtime.isa.exec_masked`). Call it before torch,
    ONNX Runtime or OpenVINO load; the servers the bench starts inherit the environment and the mask."""
    if isa.level() == "native":  # raises IsaError for a value evoforge does not know
        return {}
    isa.exec_masked()
    isa.cap_libraries()
    for name, value in _PEER_CAPS.items():
        os.environ.setdefault(name, value)
    names = ("OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
             "NPY_DISABLE_CPU_FEATURES", *_PEER_CAPS)  # fmt: skip
    caps = {n: os.environ[n] for n in names if n in os.environ}
    if isa.cpuid_masked():
        caps["CPUID"] = "AVX2+FMA"
    return caps


def not_capped() -> dict[str, str]:
    """Library -> why it is not (fully) capped at AVX2 in this process: none under the CPUID mask."""
    if isa.cpuid_masked():
        return {}
    why = {lib: reason for lib, reason in ISA_CAP.items() if reason}
    fault = "; this CPU cannot fault CPUID, which would cap it" if not isa.cpuid_faulting() else ""
    return {lib: reason + fault for lib, reason in why.items()}


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 at all (without it, an AVX2 cap changes nothing)."""
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def versions() -> dict[str, str]:
    """The installed versions of the libraries the bench compares."""
    out = {}
    for dist in ("torch", "sentence-transformers", "openvino", "optimum-intel", "onnxruntime", "fastembed",
                 "infinity-emb"):  # fmt: skip
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def length_sorted(embed: Embed, texts: Sequence[str], batch: int) -> np.ndarray:
    """``embed`` over ``texts`` in batches of ``batch``, longest texts first, as ``SentenceTransformer.encode``
    orders them (by characters); the embeddings come back in the order of ``texts``. For a peer whose library
    has no bulk path of its own, or one that batches in arrival order."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out: np.ndarray | None = None
    for i in range(0, len(order), batch):
        idx = order[i : i + batch]
        got = np.asarray(embed([texts[j] for j in idx]))
        if out is None:
            out = np.empty((len(texts), got.shape[1]), np.float32)
        out[idx] = got
    return out if out is not None else np.empty((0, 0), np.float32)


@dataclass(frozen=True)
class Peer:
    """A library embedding the model in this process."""

    name: str
    library: str  # a key of ISA_CAP
    serve: Embed | None  # one batch, from the bench's length-bucketing queue (None: measured in bulk only)
    bulk: Embed  # a whole list, by the library's own bulk path
    bulk_path: str  # how ``bulk`` batches, as the output says it


def build_peers(st: Any, model: Any, threads: int, batch: int, tmp: str) -> tuple[list[Peer], dict[str, str]]:
    """The peers that run here (``st``: the fp32 sentence-transformers model, the reference), and why each of
    the others cannot."""

    def encode(m: Any) -> tuple[Embed, Embed]:
        return (lambda texts: m.encode(texts, batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True),
                lambda texts: m.encode(texts, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True))

    st_path = f"SentenceTransformer.encode(batch_size={batch}): sorts by length"
    peers = [Peer("sentence-transformers", "torch", *encode(st), st_path)]
    skipped: dict[str, str] = {}
    onnx_path = os.path.join(tmp, "minilm.onnx")
    try:
        for name, embed in _onnx_sessions(st, threads, tmp, onnx_path, model.tokenizer, model.config.pooling).items():
            peers.append(Peer(name, "onnxruntime", embed, lambda t, e=embed: length_sorted(e, t, batch),
                              f"no bulk path of its own: sorted by length, {batch} at a time, by the bench"))
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        skipped["onnxruntime"] = _why(exc)
    for name, m in _openvino_models(model.path, threads, tmp, skipped).items():
        peers.append(Peer(name, "openvino", *encode(m), st_path))
    if os.path.exists(onnx_path):
        fe = _fastembed(onnx_path, model, threads, tmp, skipped)
        if fe is not None:
            one = lambda texts: list(fe.embed(texts, batch_size=len(texts)))  # noqa: E731
            peers += [Peer("fastembed (onnx fp32)", "fastembed", one,
                           lambda texts: list(fe.embed(texts, batch_size=batch)),
                           f"embed(batch_size={batch}): arrival order, it does not sort"),
                      Peer("fastembed (onnx fp32), sorted by the bench", "fastembed", None,
                           lambda texts: length_sorted(one, texts, batch),
                           f"sorted by length by the bench, {batch} at a time (its embed does not sort)")]  # fmt: skip
    else:
        skipped.setdefault("fastembed", "needs the ONNX export, which failed (see onnxruntime)")
    return peers, skipped


def _why(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"not installed ({exc.name}): pip install -c constraints.txt -e '.[peers]'"
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def _onnx_sessions(st: Any, threads: int, tmp: str, fp32: str, tokenizer: Any, pooling: str) -> dict[str, Embed]:
    """ONNX Runtime sessions (fp32, dynamic int8 per tensor, dynamic int8 per channel) of the same model, exported
    to ``fp32``, pooled as the model pools (``mean`` or ``cls``)."""
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    additive = int(version("transformers").split(".")[0]) >= 5

    class Wrapped(torch.nn.Module):
        def __init__(self, bert: torch.nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            if additive:  # transformers 5: an additive [n, 1, 1, L] mask made here (its mask builders do not trace)
                m = (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
            else:  # transformers 4 takes no 4-d mask: a [n, 1, L] one of 0/1, which it extends with plain tensor ops
                m = mask[:, None, :]
            return self.bert(input_ids=ids, attention_mask=m, token_type_ids=types).last_hidden_state

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
            hidden = sess.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})[0]
            if pooling == "cls":
                pooled = hidden[:, 0]
            else:
                pooled = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
            return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

        return embed

    return {label: make(p) for label, p in paths.items()}


def _openvino_models(model_dir: Path, threads: int, tmp: str, skipped: dict[str, str]) -> dict[str, Any]:
    """sentence-transformers on OpenVINO, fp32 and int8 weights, exported from a copy of the local model (the
    package's directory may be read-only); why any of them cannot run goes into ``skipped``."""
    from sentence_transformers import SentenceTransformer

    local = Path(tmp) / "minilm-openvino"
    shutil.copytree(model_dir, local)
    config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY"}
    models = {}
    for label, extra in (("openvino fp32", {}), ("openvino int8 weights", {"load_in_8bit": True})):
        try:
            models[f"sentence-transformers {label}"] = SentenceTransformer(
                str(local), device="cpu", backend="openvino", model_kwargs={"ov_config": config, **extra})
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run offline is reported, not fatal
            skipped[f"sentence-transformers {label}"] = _why(exc)
    return models


def _fastembed(onnx_path: str, model: Any, threads: int, tmp: str, skipped: dict[str, str]) -> Any:
    """FastEmbed on the ONNX export, registered as a local custom model (its tokenizer files beside it), pooled
    and normalised as the model is; None (and the reason in ``skipped``) where it cannot run."""
    try:
        from fastembed import TextEmbedding
        from fastembed.common.model_description import ModelSource, PoolingType
    except ImportError as exc:
        skipped["fastembed"] = _why(exc)
        return None
    local = Path(tmp) / "minilm-fastembed"
    local.mkdir()
    shutil.copy(onnx_path, local / "model.onnx")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json", "vocab.txt"):
        if (model.path / name).exists():  # a recent transformers writes no special_tokens_map.json
            shutil.copy(model.path / name, local / name)
    cfg = model.config
    name, pooling = f"local/{model.path.name}", PoolingType.CLS if cfg.pooling == "cls" else PoolingType.MEAN
    try:
        TextEmbedding.add_custom_model(model=name, pooling=pooling, normalization=cfg.normalize,
                                       sources=ModelSource(hf=name), dim=cfg.hidden, model_file="model.onnx")
        return TextEmbedding(name, specific_model_path=str(local), threads=threads)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        skipped["fastembed"] = _why(exc)
        return None
