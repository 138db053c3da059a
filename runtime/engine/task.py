"""The ``engine`` task: an engine configuration is the genome, fitness is sentences/s under load.

A candidate (max batch, max wait, token budget, bucketing, packing, workers x BLAS threads, precision,
a kernel per slot) is built into an :class:`Engine`, checked against the fp32 numpy engine (minimum
cosine over the first load texts and the real sentences shipped for the check must reach ``similarity_floor``),
then driven by ``concurrency``
closed-loop clients. Fitness is the throughput; a candidate whose p99 latency exceeds
``p99_budget_ms`` ends ``ok`` with its figures and ``over_budget: true`` but no fitness, so it is
stored and never an elite. The evaluation itself is :mod:`runtime.backends.engine`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import Field

from genome import ChoiceParam, Genome, IntParam, ParamSpace, Pow2Param
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.kernel_runs import KernelSource, build_ops, compile_kernels
from runtime.engine.load import ServingLoad
from runtime.engine.model import Model, Precision
from runtime.engine.ops import SLOTS, numpy_ops, slot_task, tasks_of_slot
from runtime.kernel_offers import KernelOfferArgs, KernelOffers, absolute_runs
from runtime.settings import CompilerSettings
from runtime.task import Descriptor, Task, TaskArgs
from runtime.toolchain.cc import CompileResult

__all__ = ["EngineArgs", "EngineTask", "check_sentences", "cosines"]

log = logging.getLogger(__name__)


class EngineArgs(TaskArgs, ServingLoad, KernelOfferArgs):
    """The load an engine is measured under (:class:`ServingLoad`), its budgets, and what its genome may
    choose from."""

    threads: int = Field(1, ge=1, description="cores the engine may use: workers * blas_threads <= threads")
    similarity_floor: float = Field(0.99, gt=0, le=1, description="min cosine to the fp32 engine on the texts")
    reference_every_s: float = Field(
        300.0, ge=0, description="re-measure the default engine (vs_reference's base) once its figures are older "
        "than this; 0: before every candidate, side by side")
    precisions: list[Precision] = Field(default_factory=lambda: ["fp32"], description="precisions to choose from")
    max_batch: int = Field(64, ge=1, description="largest max_batch the space offers (a power of two)")
    seed: int = Field(0, description="seed of the request texts")
    check_texts: int = Field(32, ge=1, description="request texts the similarity check compares with the fp32 engine "
                             "(the first fixed texts: at most `texts`), beside the sentences shipped for it")
    duel_rounds: int = Field(2, ge=1, description="load rounds of each engine in a duel, alternating")
    model_dir: str | None = Field(None, description="a BERT sentence encoder's directory, in the sentence-transformers "
                                  "layout (default: the bundled all-MiniLM-L6-v2)")


class EngineTask(Task, KernelOffers):
    """Evolves an :class:`EngineConfig` for a BERT sentence encoder (default: the bundled MiniLM) under load
    (the ``engine`` backend)."""

    name = "engine"
    unit = "sentences/s"
    description = "BERT sentence-embedding engine under closed-loop load, p99-latency bounded"
    signature = "(an engine configuration)"
    backend = "engine"
    Args = EngineArgs
    args: EngineArgs
    kernel_slots = SLOTS

    def __init__(self, args: Mapping[str, Any] | None = None) -> None:
        super().__init__(args)
        self._model: Model | None = None
        self._texts: list[str] | None = None
        self._check: list[str] | None = None
        self._reference: np.ndarray | None = None

    @classmethod
    def resolve_args(cls, args: Mapping[str, Any], cwd: str) -> dict[str, Any]:
        """The kernel runs' and the model's directories made absolute against ``cwd``."""
        out = absolute_runs(args, cwd)
        if isinstance(out.get("model_dir"), str):
            out["model_dir"] = os.path.join(cwd, out["model_dir"])
        return out

    @classmethod
    def check_fills(cls, slot: str, task: str) -> None:
        if slot not in SLOTS:
            raise ValueError(f"unknown slot {slot!r} (slots: {', '.join(SLOTS)})")
        slot_task(slot, task)

    # --- the genome -----------------------------------------------------------------------------

    @property
    def cores(self) -> int:
        return max(1, min(self.args.threads, len(os.sched_getaffinity(0))))

    def space(self) -> ParamSpace:
        c = self.cores
        params: dict[str, Any] = {
            "max_batch": Pow2Param(type="pow2", low=1, high=1 << (self.args.max_batch.bit_length() - 1)),
            "max_wait_ms": ChoiceParam(type="choice", values=(0, 1, 2, 5)),
            "token_budget": Pow2Param(type="pow2", low=256, high=8192),
            "bucketing": ChoiceParam(type="choice", values=("none", "split", "queue")),
            "pack": ChoiceParam(type="choice", values=(False, True)),
            "workers": IntParam(type="int", low=1, high=c),
            "worker_kind": ChoiceParam(type="choice", values=("thread", "process")),
            "blas_threads": IntParam(type="int", low=1, high=c),
            "precision": ChoiceParam(type="choice", values=tuple(self.args.precisions)),
        }
        params.update(self.kernel_genes())
        return ParamSpace(params, [f"workers * blas_threads <= {c}"])

    def seeds(self) -> list[Genome]:
        """The default engine (one worker, one BLAS thread), one worker per core, and, when kernel runs
        are configured, the default engine with each slot's fittest kernel."""
        choices = self.kernel_choices()
        base = {"max_batch": min(32, self.args.max_batch), "max_wait_ms": 0, "token_budget": 4096,
                "bucketing": "split", "pack": True, "workers": 1, "worker_kind": "thread", "blas_threads": 1,
                "precision": self.args.precisions[0], **{f"kernel_{s}": "numpy" for s in choices}}
        seeds = [base]
        if self.cores > 1:
            seeds += [{**base, "workers": self.cores}, {**base, "workers": self.cores, "worker_kind": "process"}]
        if any(choices.values()):
            seeds.append({**base, **{f"kernel_{s}": ids[0] for s, ids in choices.items() if ids}})
        return [Genome(params=p) for p in seeds]

    def engine_config(self, genome: Genome) -> EngineConfig:
        """The engine a genome describes (raises ValueError for a genome outside the space)."""
        p = dict(genome.params)
        kernels = {k.removeprefix("kernel_"): p.pop(k) for k in list(p) if k.startswith("kernel_")}
        return EngineConfig(**p, kernels={s: v for s, v in kernels.items() if v != "numpy"})

    def render(self, genome: Genome) -> str:
        """The engine configuration as YAML (what ``evo archive show`` and ``export`` print)."""
        cfg = self.engine_config(genome).model_dump(mode="json")
        return f"# engine configuration ({self.name} task)\n" + yaml.safe_dump(cfg, sort_keys=False)

    # --- building and measuring (in the worker) -------------------------------------------------

    def prime(self) -> None:
        """Loads the model, the request texts and the kernel sources (a worker calls this before dropping
        privileges: later it may not read these files). Not the reference embeddings: the engines' template
        process is forked after this, and nothing a candidate could copy may exist in it."""
        self.model()
        self.texts()
        self.check_texts()
        for slot, ids in self.kernel_choices().items():
            for cid in ids:
                self.kernel_source(slot, cid)

    def share_model(self, model: Model) -> None:
        """Uses already loaded fp32 weights instead of loading them again."""
        self._model = model

    def model(self) -> Model:
        if self._model is None:
            from runtime.engine.model import load_model

            self._model = load_model(self.args.model_dir)
        return self._model

    def texts(self) -> list[str]:
        """The fixed texts: words drawn from the model's vocabulary, with lengths from ``lengths``; the
        first ones are the similarity check's."""
        if self._texts is None:
            self._texts = request_texts(self.model(), self.args.lengths, self.args.texts, self.args.seed)
        return self._texts

    def fresh_texts(self, salt: int) -> FreshTexts:
        """An endless sequence of new texts like :meth:`texts` (a load never sends an engine one twice)."""
        return FreshTexts(self.model().tokenizer.vocabulary_words(), self.args.lengths, salt)

    def check_texts(self) -> list[str]:
        """The similarity check's texts: the first ``check_texts`` request texts, then :func:`check_sentences`
        (real language, longer than most request texts: an error the random words do not stir shows there)."""
        if self._check is None:
            self._check = [*self.texts()[: self.args.check_texts], *check_sentences()]
        return self._check

    def _reference_embeddings(self) -> np.ndarray:
        if self._reference is None:
            self._reference = self.reference_embed(self.check_texts())
        return self._reference

    def reference_embed(self, texts: Sequence[str]) -> np.ndarray:
        """The fp32 numpy engine's embeddings of ``texts``, computed in this process."""
        return Engine(self.model(), numpy_ops(), EngineConfig()).embed(list(texts))

    def kernel_sources(self, config: EngineConfig, built: Mapping[str, str] | None = None) -> dict[str, KernelSource]:
        """The source of each kernel ``config`` names, by slot; with ``built`` (slot -> library hash, what its
        compile produced or a result recorded), each must load as that library."""
        found = {slot: self.kernel_source(slot, cid) for slot, cid in config.kernels.items()}
        return {slot: dataclasses.replace(ks, sha256=(built or {}).get(slot, "")) for slot, ks in found.items()}

    def compile_kernels(self, config: EngineConfig, *, compiler: CompilerSettings, cache_dir: str,
                        work_dir: str | None = None) -> dict[str, CompileResult]:
        """Compiles ``config``'s kernels into the cache without loading them: each slot's library and its hash."""
        return compile_kernels(self.kernel_sources(config), compiler=compiler, cache_dir=cache_dir, work_dir=work_dir)

    def build(self, config: EngineConfig, *, compiler: CompilerSettings, cache_dir: str, work_dir: str | None = None,
              built: Mapping[str, str] | None = None) -> Engine:  # fmt: skip
        """The engine of ``config``: the model in its precision, its kernels compiled (cached) and loaded (each
        the library ``built`` names, when given)."""
        ops = build_ops(self.kernel_sources(config, built), compiler=compiler, cache_dir=cache_dir,
                        work_dir=work_dir)  # fmt: skip
        return Engine(self.model().with_precision(config.precision), ops, config)

    def similarity(self, engine: Engine) -> float:
        """Minimum cosine between ``engine``'s embeddings and the fp32 numpy engine's, over :meth:`check_texts`."""
        got = engine.embed(self.check_texts())
        return float(np.min(cosines(got, self._reference_embeddings())))

    def fallbacks(self, config: EngineConfig) -> dict[str, str]:
        """Slot -> why the kernel ``config`` puts there cannot serve this model (those operators run in numpy)."""
        out = {}
        for slot, ks in self.kernel_sources(config).items():
            reason = self.model().misfit(slot, ks.task or tasks_of_slot(slot)[0])
            if reason:
                out[slot] = reason
        return out

    def descriptors(self) -> dict[str, Descriptor]:
        budget = self.args.p99_budget_ms
        return {
            "p99_ms": Descriptor("p99_ms", "p99 request latency under the load (ms)",
                                 lambda g, m: float(m.get("p99_ms", budget)), 0.0, budget),
            "memory_mb": Descriptor("memory_mb", "resident memory of the engine's processes after the load (MB)",
                                    lambda g, m: float(m.get("memory_mb", 0.0)), 0.0, 2048.0),
            "max_batch": Descriptor("max_batch", "the genome's max batch size",
                                    lambda g, m: float(g.params.get("max_batch", 1)), 0.0, 64.0),
        }


class FreshTexts(Sequence[str]):
    """Text ``k`` of an endless sequence, drawn from ``(salt, k)`` like :func:`request_texts` (lengths from
    ``lengths``, +-25%): an engine under load never sees a text twice, so remembering answers gains nothing."""

    def __init__(self, vocab: Sequence[str], lengths: Mapping[int, float], salt: int) -> None:
        self._vocab, self._salt = vocab, salt
        self._targets = np.array(list(lengths), dtype=np.int64)
        weights = np.array(list(lengths.values()), dtype=np.float64)
        self._p = weights / weights.sum()

    def __len__(self) -> int:
        return 1 << 62

    def __getitem__(self, k: int) -> str:  # type: ignore[override]
        rng = np.random.default_rng([self._salt, k])
        t = rng.choice(self._targets, p=self._p)
        words = max(1, int(round(t * rng.uniform(0.75, 1.25))) - 2)  # [CLS] and [SEP] are tokens too
        return " ".join(self._vocab[i] for i in rng.integers(0, len(self._vocab), words))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two ``[n, dim]`` arrays (embeddings of a model that does not normalise too)."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.sum(a * b, axis=1) / np.maximum(norms, 1e-30)


CHECK_SENTENCES = Path(__file__).with_name("check_sentences.txt")


def check_sentences() -> list[str]:
    """Real English sentences and paragraphs (9 to 103 MiniLM tokens) every similarity check embeds too: a
    quantised engine that keeps random vocabulary words near the fp32 answer can still drift on real text."""
    return [line for line in CHECK_SENTENCES.read_text(encoding="utf-8").splitlines() if line.strip()]


def request_texts(model: Model, lengths: Mapping[int, float], n: int, seed: int) -> list[str]:
    """``n`` texts of whole-word vocabulary entries whose token counts follow ``lengths`` (+-25%)."""
    vocab = model.tokenizer.vocabulary_words()
    rng = np.random.default_rng(seed)
    targets = np.array(list(lengths), dtype=np.int64)
    weights = np.array(list(lengths.values()), dtype=np.float64)
    picks = rng.choice(targets, size=n, p=weights / weights.sum())
    texts = []
    for t in picks:
        words = max(1, int(round(t * rng.uniform(0.75, 1.25))) - 2)  # [CLS] and [SEP] are tokens too
        texts.append(" ".join(vocab[i] for i in rng.integers(0, len(vocab), words)))
    return texts
