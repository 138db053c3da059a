"""The ``engine`` task: an engine configuration is the genome, fitness is sentences/s under load.

A candidate (max batch, max wait, token budget, bucketing, packing, workers x BLAS threads, precision,
a kernel per slot) is built into an :class:`Engine`, checked against the fp32 numpy engine (minimum
cosine over the load's texts must reach ``similarity_floor``), then driven by ``concurrency``
closed-loop clients. Fitness is the throughput; a candidate whose p99 latency exceeds
``p99_budget_ms`` ends ``ok`` with its figures and ``over_budget: true`` but no fitness, so it is
stored and never an elite. The evaluation itself is :mod:`runtime.backends.engine`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from genome import ChoiceParam, Genome, IntParam, ParamSpace, Pow2Param, SpaceError
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.kernel_runs import KernelSource, RunNotFound, build_ops, compile_kernels, kernel_offer
from runtime.engine.load import ServingLoad
from runtime.engine.model import Model, Precision
from runtime.engine.ops import SLOTS, numpy_ops, tasks_of_slot
from runtime.followed_runs import FollowsRuns, OpenRun
from runtime.settings import CompilerSettings
from runtime.task import Descriptor, Task, TaskArgs
from runtime.toolchain.cc import CompileResult

__all__ = ["EngineArgs", "EngineTask", "KernelRun", "cosines"]

log = logging.getLogger(__name__)


class OfferedKernel(BaseModel):
    """A kernel elite a run offers, as read when the task was resolved: what the engine compiles."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    flags: list[str] = Field(default_factory=list)
    task: str = ""


class KernelRun(BaseModel):
    """Where a slot's kernel choices come from: the ``top`` elites of a kernel run (or the listed ``ids``).

    ``offered`` and ``unreadable`` are filled when the task is resolved (:meth:`EngineTask.resolve_args`),
    not written by hand: the elites the run offered then, or why it could not be read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_dir: str = Field(description="the kernel run's directory (relative: to where `evo run` runs)")
    top: int = Field(3, ge=1, description="the fittest elites offered as choices")
    ids: list[str] | None = Field(None, description="offer exactly these elite ids instead of the top ones")
    optional: bool = Field(False, description="no such run (or no ok elite in it) leaves the slot to numpy "
                           "instead of being an error")
    follow: bool = Field(False, description="offer each new elite of the run's top ones as it lands during the "
                         "search (read every `follow_every_s`), not only those there when the search started")
    offered: dict[str, OfferedKernel] | None = Field(None, description="elite id -> its kernel, as read")
    unreadable: str | None = Field(None, description="why the run could not be read when the task was resolved")

    @field_validator("run_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        # a config's relative paths were made absolute when it was loaded (EngineTask.resolve_args)
        return os.path.abspath(v)


class EngineArgs(TaskArgs, ServingLoad):
    """The load an engine is measured under (:class:`ServingLoad`), its budgets, and what its genome may
    choose from."""

    threads: int = Field(1, ge=1, description="cores the engine may use: workers * blas_threads <= threads")
    similarity_floor: float = Field(0.99, gt=0, le=1, description="min cosine to the fp32 engine on the texts")
    reference_every_s: float = Field(
        300.0, ge=0, description="re-measure the default engine (vs_reference's base) once its figures are older "
        "than this; 0: before every candidate, side by side")
    precisions: list[Precision] = Field(default_factory=lambda: ["fp32"], description="precisions to choose from")
    max_batch: int = Field(64, ge=1, description="largest max_batch the space offers (a power of two)")
    kernels: dict[str, KernelRun | list[KernelRun]] = Field(
        default_factory=dict, description="slot -> the kernel run(s) offering choices (a list: several runs, "
        "e.g. bf16 and int8 kernels for the linear slot)")

    def kernel_runs(self, slot: str) -> list[KernelRun]:
        runs = self.kernels.get(slot, [])
        return runs if isinstance(runs, list) else [runs]
    seed: int = Field(0, description="seed of the request texts")
    check_texts: int = Field(32, ge=1, description="texts the similarity check compares with the fp32 engine (the "
                             "first fixed texts: at most `texts`)")
    duel_rounds: int = Field(2, ge=1, description="load rounds of each engine in a duel, alternating")
    follow_every_s: float = Field(10.0, gt=0, description="how often the kernel runs marked `follow` are read "
                                  "for new elites during the search")
    model_dir: str | None = Field(None, description="a BERT sentence encoder's directory, in the sentence-transformers "
                                  "layout (default: the bundled all-MiniLM-L6-v2)")


class EngineTask(Task, FollowsRuns):
    """Evolves an :class:`EngineConfig` for a BERT sentence encoder (default: the bundled MiniLM) under load
    (the ``engine`` backend)."""

    name = "engine"
    unit = "sentences/s"
    description = "BERT sentence-embedding engine under closed-loop load, p99-latency bounded"
    signature = "(an engine configuration)"
    backend = "engine"
    Args = EngineArgs
    args: EngineArgs

    def __init__(self, args: Mapping[str, Any] | None = None) -> None:
        super().__init__(args)
        self._choices: dict[str, list[str]] | None = None
        self._model: Model | None = None
        self._texts: list[str] | None = None
        self._reference: np.ndarray | None = None
        self._sources: dict[tuple[str, str], KernelSource] = {}  # (slot, offered id) -> its kernel

    @classmethod
    def resolve_args(cls, args: Mapping[str, Any], cwd: str) -> dict[str, Any]:
        """The kernel runs' and the model's directories made absolute against ``cwd``."""
        out = dict(args)

        def absolute(kr: Any) -> Any:
            if isinstance(kr, Mapping) and isinstance(kr.get("run_dir"), str):
                return {**kr, "run_dir": os.path.join(cwd, kr["run_dir"])}
            return [absolute(k) for k in kr] if isinstance(kr, list) else kr

        kernels = out.get("kernels")
        if isinstance(kernels, Mapping):
            out["kernels"] = {slot: absolute(kr) for slot, kr in kernels.items()}
        if isinstance(out.get("model_dir"), str):
            out["model_dir"] = os.path.join(cwd, out["model_dir"])
        return out

    @classmethod
    def read_runs(cls, args: Mapping[str, Any], runs: OpenRun) -> dict[str, Any]:
        """Each kernel run read once (``runs``: ``archive.Run.open``): its ``top`` elites frozen into its
        ``ids`` and their rendered sources into ``offered``, or why it could not be read into ``unreadable``
        (a resumed run, a worker, a Ray node or a server then offers exactly these kernels, even when that
        kernel run went on evolving)."""

        def read(kr: Any, slot: str) -> Any:
            if isinstance(kr, Mapping) and isinstance(kr.get("run_dir"), str):
                return _read(dict(kr), slot, runs)
            return [read(k, slot) for k in kr] if isinstance(kr, list) else kr

        out = dict(args)
        kernels = out.get("kernels")
        if isinstance(kernels, Mapping):
            out["kernels"] = {slot: read(kr, slot) for slot, kr in kernels.items()}
        return out

    def offers_every_s(self) -> float:
        followed = any(kr.follow for slot in self.args.kernels for kr in self.args.kernel_runs(slot))
        return self.args.follow_every_s if followed else 0.0

    @classmethod
    def new_offers(cls, args: Mapping[str, Any], runs: OpenRun) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """Each followed kernel run's top elites that it did not offer yet added to its offer (a run not
        there yet, or with no ok elite, is read again next time)."""
        added: list[dict[str, Any]] = []

        def grow(kr: Any, slot: str) -> Any:
            if isinstance(kr, list):
                return [grow(k, slot) for k in kr]
            if not (isinstance(kr, Mapping) and kr.get("follow")):
                return kr
            got = _read({k: v for k, v in kr.items() if k not in ("ids", "offered", "unreadable")}, slot, runs)
            offered = dict(kr.get("offered") or {})
            new = {cid: k for cid, k in (got.get("offered") or {}).items() if cid not in offered}
            if not new:
                return kr
            added.extend({"slot": slot, "run_dir": kr["run_dir"], "id": cid, "task": k["task"]}
                         for cid, k in new.items())  # fmt: skip
            rest = {k: v for k, v in kr.items() if k != "unreadable"}
            return {**rest, "ids": [*(kr.get("ids") or []), *new], "offered": {**offered, **new}}

        kernels = args.get("kernels")
        if not isinstance(kernels, Mapping):
            return None
        grown = {slot: grow(kr, slot) for slot, kr in kernels.items()}
        return ({**args, "kernels": grown}, added) if added else None

    def offer_seeds(self, base: Genome | None, added: Sequence[Mapping[str, Any]]) -> list[Genome]:
        """``base`` (else the default engine) with the newest kernel of every slot that has one (kernels found
        for different slots are tried together: each alone may not lift an engine another slot holds back),
        then with each new kernel alone in its slot."""
        start = dict(base.params) if base is not None else dict(self.seeds()[0].params)
        newest = {f"kernel_{slot}": ids[-1] for slot, ids in self.kernel_choices().items() if ids}
        for a in reversed(added):  # a slot's new kernels come fittest first: its fittest goes in together
            newest[f"kernel_{a['slot']}"] = a["id"][:16]
        together = Genome(params={**start, **newest})
        alone = [Genome(params={**start, f"kernel_{a['slot']}": a["id"][:16]}) for a in added]
        return [together, *(g for g in alone if g.id != together.id)]

    # --- the genome -----------------------------------------------------------------------------

    @property
    def cores(self) -> int:
        return max(1, min(self.args.threads, len(os.sched_getaffinity(0))))

    def kernel_choices(self) -> dict[str, list[str]]:
        """Slot -> elite ids offered (unique prefixes, as the genome names them)."""
        if self._choices is None:
            choices = {}
            for slot in self.args.kernels:
                if slot not in SLOTS:
                    raise SpaceError(f"task.args.kernels: unknown slot {slot!r} (slots: {', '.join(SLOTS)})")
                ids: list[str] = []
                followed = False
                for kr in self.args.kernel_runs(slot):
                    followed = followed or kr.follow
                    if not kr.offered:
                        why = kr.unreadable or f"{kr.run_dir} was not read (the task's args were not resolved)"
                        if kr.optional:
                            log.info("task.args.kernels.%s: %s: not offered (yet)", slot, why)
                            continue
                        raise SpaceError(f"task.args.kernels.{slot}: {why}: evolve the kernels first, "
                                         f"or drop the slot (or mark it optional: true)")
                    for cid, kernel in kr.offered.items():
                        short = cid[:16]  # a unique prefix keeps params readable
                        if short not in ids:
                            self._sources[(slot, short)] = KernelSource(slot, cid, kernel.source, tuple(kernel.flags),
                                                                        kernel.task)  # fmt: skip
                            ids.append(short)
                if ids or followed:  # a followed run offers nothing yet: the slot's gene is there, numpy only
                    choices[slot] = ids
            self._choices = choices
        return self._choices

    def complete_space(self, space: ParamSpace) -> ParamSpace:
        """A config's engine space plus a ``kernel_<slot>`` choice for each configured kernel run it does not
        name itself (the elite ids are known only once the runs are read)."""
        extra = {f"kernel_{slot}": ChoiceParam(type="choice", values=("numpy", *ids))
                 for slot, ids in self.kernel_choices().items() if f"kernel_{slot}" not in space.names()}
        if not extra:
            return space
        return ParamSpace({**space.params, **extra}, [c.text for c in space.constraints])

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
        for slot, ids in self.kernel_choices().items():
            params[f"kernel_{slot}"] = ChoiceParam(type="choice", values=("numpy", *ids))
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
        for slot, ids in self.kernel_choices().items():
            for cid in ids:
                self._kernel_source(slot, cid)

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

    def _reference_embeddings(self) -> np.ndarray:
        if self._reference is None:
            self._reference = self.reference_embed(self.texts()[: self.args.check_texts])
        return self._reference

    def reference_embed(self, texts: Sequence[str]) -> np.ndarray:
        """The fp32 numpy engine's embeddings of ``texts``, computed in this process."""
        return Engine(self.model(), numpy_ops(), EngineConfig()).embed(list(texts))

    def _kernel_source(self, slot: str, cid: str) -> KernelSource:
        self.kernel_choices()
        found = self._sources.get((slot, cid)) or next(
            (k for (sl, _), k in self._sources.items() if sl == slot and k.id.startswith(cid)), None)
        if found is None:
            raise RunNotFound(f"no kernel run of the {slot} slot offers a kernel {cid!r}")
        return found

    def kernel_sources(self, config: EngineConfig, built: Mapping[str, str] | None = None) -> dict[str, KernelSource]:
        """The source of each kernel ``config`` names, by slot; with ``built`` (slot -> library hash, what its
        compile produced or a result recorded), each must load as that library."""
        found = {slot: self._kernel_source(slot, cid) for slot, cid in config.kernels.items()}
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
        """Minimum cosine between ``engine``'s embeddings and the fp32 numpy engine's, over the check texts."""
        got = engine.embed(self.texts()[: self.args.check_texts])
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


def _read(kr: dict[str, Any], slot: str, runs: OpenRun) -> dict[str, Any]:
    """A kernel run entry of ``slot`` with what the run offers read into it (as given when it was read
    already)."""
    if kr.get("offered") is not None or kr.get("unreadable") is not None:
        return kr  # read once already: a resumed run offers what it did (a followed run grows by new_offers)
    try:
        run = runs(kr["run_dir"])
        try:
            ids = kr.get("ids")
            offer = kernel_offer(run, slot, list(ids) if ids is not None else None,
                                 int(kr.get("top", KernelRun.model_fields["top"].default)))  # fmt: skip
        finally:
            run.close()
    except (RunNotFound, ValueError, TypeError) as exc:
        return {**{k: v for k, v in kr.items() if k != "unreadable"}, "unreadable": str(exc)}
    return {**{k: v for k, v in kr.items() if k != "unreadable"}, "ids": [k.id for k in offer],
            "offered": {k.id: {"source": k.source, "flags": list(k.flags), "task": k.task} for k in offer}}


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
