"""What a factory does differently for each kind of model: a BERT sentence encoder (the ``engine`` task, measured
in sentences/s under request load) or a GGUF chat model (the ``chat_engine`` task, tokens/s under streaming
chat load). The rounds themselves (:mod:`evo.factory.run`) are the same for both."""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar

from evo.errors import UserError
from evo.factory.config import FactoryConfig
from evo.factory.kernels import engine_run_config, kernel_run_config
from evo.factory.plan import slot_tasks_for
from runtime.result import EvalResult

__all__ = ["HELD_OUT_SALT", "ChatKind", "EncoderKind", "ModelKind", "kind_of"]

HELD_OUT_SALT = (1 << 62) + 7  # an encoder duel's texts' seed: a search's loads draw theirs at random below 2^63


class ModelKind(abc.ABC):
    """A factory's model kind: its engine task, what its figures are called, and the searches it plans."""

    task: ClassVar[str]  # the engine task's name
    unit: ClassVar[str]
    memory_mb: ClassVar[int] = 4096  # the address space of the engine's worker, its host and the factory's measures

    def __init__(self, config: FactoryConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def check(self) -> None:
        """Raises :class:`UserError` (one line) where the model cannot be read."""

    @abc.abstractmethod
    def shares(self, profile: Mapping[str, Any]) -> dict[str, float]:
        """Each slot's share of the engine's time in ``profile`` (a profile stage's ``metrics["profile"]``), and
        the other parts'."""

    @abc.abstractmethod
    def slot_tasks(self, slot: str, cpu_flags: Collection[str]) -> tuple[list[str], str]:
        """The built-in tasks to search for ``slot`` on a CPU with ``cpu_flags``, or none and why not."""

    @abc.abstractmethod
    def kernel_run_config(self, task: str, max_evals: int) -> dict[str, Any]:
        """The run config of ``task``'s kernel search, at the model's own shapes."""

    @abc.abstractmethod
    def engine_run_config(self, kernel_runs: Mapping[str, Path]) -> dict[str, Any]:
        """The engine search's run config, following ``kernel_runs`` (task -> run directory)."""

    @abc.abstractmethod
    def measure_args(self, *, duel: bool) -> dict[str, Any]:
        """The engine task's arguments for the factory's own measurements (``duel``: against the incumbent, on
        texts the searches never checked), without the kernels."""

    @abc.abstractmethod
    def load_seconds(self) -> float:
        """A generous bound on one load of an engine, for the measurements' time limits."""

    @abc.abstractmethod
    def figures(self, metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        """A duel's figures of one engine (``prefix``: ``rival_`` for the incumbent's) under the names the
        factory stores: ``throughput`` (in :attr:`unit`), ``p99_ms`` (what the budget bounds), the fidelity
        figures and the ``rounds``."""

    def round_throughputs(self, figures: Mapping[str, Any]) -> list[float]:
        """The throughput of each of a duel's rounds, in order, from :meth:`figures`' ``rounds``."""
        return [float(r["throughput"]) for r in figures.get("rounds") or []]

    @property
    @abc.abstractmethod
    def p99_budget_ms(self) -> float:
        """The bound on ``p99_ms`` past which an engine is never promoted."""

    def under_floor(self, result: EvalResult) -> str | None:
        """Why a duel's ``wrong`` candidate fails the fidelity floor, in a line (``None``: it broke another rule,
        which its error says)."""
        return None

    @abc.abstractmethod
    def fidelity_text(self, figures: Mapping[str, Any]) -> str:
        """A promotion's fidelity figures, for its reason."""


class EncoderKind(ModelKind):
    task = "engine"
    unit = "sentences/s"

    def _model(self) -> Any:
        from runtime.engine.model import ModelLoadError, default_model_dir, read_config

        try:
            return read_config(Path(self.config.model_dir) if self.config.model_dir else default_model_dir())
        except (ModelLoadError, RuntimeError) as exc:
            raise UserError(f"model_dir: {exc}") from None

    def check(self) -> None:
        self._model()

    def shares(self, profile: Mapping[str, Any]) -> dict[str, float]:
        from runtime.engine.profile import Profile

        return Profile.from_dict(dict(profile)).shares()

    def slot_tasks(self, slot: str, cpu_flags: Collection[str]) -> tuple[list[str], str]:
        cfg = self._model()
        return slot_tasks_for(slot, sorted(cpu_flags), cfg.hidden, cfg.intermediate)

    def kernel_run_config(self, task: str, max_evals: int) -> dict[str, Any]:
        return kernel_run_config(task, self.config, self._model(), max_evals)

    def engine_run_config(self, kernel_runs: Mapping[str, Path]) -> dict[str, Any]:
        return engine_run_config(self.config, dict(kernel_runs))

    def measure_args(self, *, duel: bool) -> dict[str, Any]:
        c, p = self.config, self.config.promote
        args = {**c.load.model_dump(mode="json"), "similarity_floor": p.similarity_floor, "model_dir": c.model_dir,
                "seed": c.seed}  # fmt: skip
        if duel:
            args.update(seed=HELD_OUT_SALT, duration_s=p.duration_s, duel_rounds=p.rounds,  # type: ignore[union-attr]
                        check_texts=p.held_out_texts, texts=max(c.load.texts, p.held_out_texts))  # type: ignore[union-attr]
        return args

    def load_seconds(self) -> float:
        load = self.config.load
        return load.warmup_s + max(load.duration_s, self.config.promote.duration_s) + 5  # type: ignore[union-attr]

    def figures(self, metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        names = {"similarity": "similarity", "throughput": "throughput", "p99_ms": "p99_ms", "rounds": "rounds"}
        return {ours: metrics[prefix + theirs] for ours, theirs in names.items() if prefix + theirs in metrics}

    @property
    def p99_budget_ms(self) -> float:
        return float(self.config.load.p99_budget_ms)  # type: ignore[union-attr]

    def under_floor(self, result: EvalResult) -> str | None:
        if "similarity" not in result.metrics:
            return None
        floor = self.config.promote.similarity_floor  # type: ignore[union-attr]
        return (f"min cosine {result.metrics['similarity']:.5f} on held-out texts and the check sentences is under "
                f"the floor {floor}")

    def fidelity_text(self, figures: Mapping[str, Any]) -> str:
        return f"min cosine {figures.get('similarity', float('nan')):.5f}"


class ChatKind(ModelKind):
    task = "chat_engine"
    unit = "tokens/s"
    # the model's fp32 weights, each slot's packed copy of them (Gemma 3's tied 262,144 x 640 head alone takes
    # 640 MiB twice) and the KV cache
    memory_mb = 8192

    def _model(self) -> Any:
        from runtime.decoder.gguf_file import GGUFFile, GGUFLoadError, read_config
        from runtime.decoder.models import ModelNotFound, model_file

        try:
            return read_config(GGUFFile(model_file(str(self.config.model))))
        except (ModelNotFound, GGUFLoadError) as exc:
            raise UserError(f"model: {exc}") from None

    def check(self) -> None:
        self._model()

    def shares(self, profile: Mapping[str, Any]) -> dict[str, float]:
        """The decoder profile's parts: its weight GEMMs (each matrix) summed into the ``linear`` slot, the LM head
        (its full logits, or its top list) into ``lm_head``."""
        out: dict[str, float] = {}
        for part, share in dict(profile.get("shares") or {}).items():
            slot = "linear" if part.startswith("linear ") else "lm_head" if part.startswith("lm_head") else part
            out[slot] = out.get(slot, 0.0) + float(share)
        return out

    def slot_tasks(self, slot: str, cpu_flags: Collection[str]) -> tuple[list[str], str]:
        from runtime.decoder.kernels import DecoderKernelError, linear_task

        if slot == "attention":
            return [_ATTENTION_TASKS[kv] for kv in self.config.plan.kv_dtypes], ""
        if slot == "rmsnorm":
            return ["rmsnorm"], ""
        if slot == "lm_head":
            from runtime.tasks.lm_head_topk import head_tasks

            names = head_tasks(cpu_flags)  # each a search: which tile wins on this CPU is measured, not assumed
            return names, "" if names else "the LM head's top list needs AVX2 and FMA"
        if slot != "linear":
            return [], f"a chat engine has no {slot} slot (its slots: linear, attention, rmsnorm, lm_head)"
        tasks, reasons = [], []
        for precision in self.config.plan.precisions:
            try:
                tasks.append(linear_task(precision, cpu_flags))
            except DecoderKernelError as exc:
                reasons.append(str(exc))
        return tasks, "; ".join(reasons)

    def kernel_run_config(self, task: str, max_evals: int) -> dict[str, Any]:
        """Each task at the shapes of the load's steps, on the threads the engine runs it on: a step of ``streams``
        sequences through the gated MLP's up GEMM (the largest), the attention of that many sequences over as many
        positions as the load's longest requests hold (a prompt's chunk of 8 queries in every other one, as steps
        that prefill beside the decoding requests bring), RMSNorm of that many rows, and the LM head's top list of
        that many rows."""
        from runtime.task import load_task_class
        from runtime.tasks._linear import LinearTask

        cfg, load = self._model(), self.config.load
        rows, team = load.streams, load.threads  # type: ignore[union-attr]
        if task in _ATTENTION_TASKS.values():  # on the engine's team of threads, as the engine runs it
            kv = {name: t for t, name in _ATTENTION_TASKS.items()}[task]
            longest = load.prompt_tokens[1] + load.max_tokens  # type: ignore[union-attr]
            args = {"batch": rows, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                    "length": min(longest, cfg.context), "queries": _CHUNK, "window": 0, "cache": kv,
                    "threads": team}  # fmt: skip
            descriptors, bins = ["key_block"], [6]
        elif task == "rmsnorm":  # one thread, as the engine runs it
            args = {"rows": rows, "cols": cfg.hidden, "eps": cfg.eps, "threads": 1}
            descriptors, bins = ["vector_width"], [4]
        elif task.startswith("lm_head_topk"):  # on the engine's team, its top list as long as the engine keeps
            from runtime.decoder.kernels import TOP

            args = {"m": rows, "k": cfg.hidden, "vocab": cfg.vocab, "top": TOP, "threads": team}
            descriptors, bins = ["tile"], [4]
        elif issubclass(cls := load_task_class(task), LinearTask):
            args = {"m": rows, "k": cfg.hidden, "n": 2 * cfg.intermediate, "threads": team}
            descriptors, bins = [cls.block[0]], [4]
        else:
            raise ValueError(f"the factory has no kernel search for task {task!r} of a chat model")
        return {
            "task": {"name": task, "args": args},
            "search": {"seed": self.config.seed, "initial_random": 8,
                       "confirm": {"repeats": self.config.budget.confirm_repeats}},
            "budget": {"max_evals": max_evals},
            # its timings wait for the engine search's loads, which hold the machine a load at a time
            "evaluation": {"sandbox": {"timeout": 120 + 2 * self.load_seconds()}},
            "archive": {"kind": "grid", "descriptors": descriptors, "bins": bins[0]},
            "execution": self.config.execution.model_dump(mode="json"),
        }  # fmt: skip

    def engine_run_config(self, kernel_runs: Mapping[str, Path]) -> dict[str, Any]:
        """The chat engine search under the factory's load, following each kernel run by its slot (its top 2
        elites offered, each new one as it lands)."""
        by_slot: dict[str, list[dict[str, Any]]] = {}
        for task, run_dir in sorted(kernel_runs.items()):
            follow = {"run_dir": str(run_dir), "top": 2, "follow": True, "optional": True}
            by_slot.setdefault(_chat_slot(task), []).append(follow)
        load = self.config.load
        return {
            "task": {"name": "chat_engine", "args": {**self.measure_args(duel=False),
                                                     "precisions": list(self.config.plan.precisions),
                                                     "kernels": {s: r[0] if len(r) == 1 else r
                                                                 for s, r in by_slot.items()}}},
            "search": {"seed": self.config.seed, "initial_random": 4, "workers": 1,  # a load uses every core
                       "confirm": {"repeats": self.config.budget.confirm_repeats}},
            "budget": {"max_evals": self.config.budget.engine_evals},
            "evaluation": {"sandbox": {"timeout": 300 + 3 * self.load_seconds(), "memory_mb": self.memory_mb,
                                       "cpu_seconds": int((300 + 3 * self.load_seconds()) * load.threads)}},
            "archive": {"descriptors": ["itl_p99_ms", "memory_mb"], "bins": [4, 4],
                        "ranges": [[0, load.itl_p99_budget_ms], [0, 4096]]},  # type: ignore[union-attr]
            "execution": self.config.execution.model_dump(mode="json"),
        }  # fmt: skip

    def measure_args(self, *, duel: bool) -> dict[str, Any]:
        from runtime.decoder.engine_task import ChatEngineArgs

        c, p = self.config, self.config.promote
        args = {**c.load.model_dump(mode="json"), "model": c.model, "top1_floor": p.top1_floor,  # type: ignore[union-attr]
                "kl_floor": p.kl_floor, "seed": c.seed}  # type: ignore[union-attr]  # fmt: skip
        if duel:  # texts the searches never check: after theirs
            args.update(check_texts=p.held_out_texts, check_skip=ChatEngineArgs.model_fields["check_texts"].default,
                        duel_rounds=p.rounds)  # fmt: skip
        return args

    def load_seconds(self) -> float:
        load = self.config.load
        return 120.0 + load.streams * load.requests * load.max_tokens / 5.0  # type: ignore[union-attr]  # 5 tok/s

    def figures(self, metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        """Tokens/s, the p99 inter-token latency, and the fidelity as checked: teacher-forced (``top1``,
        ``mean_kl``) for an engine on built-in kernels, on its own answers (``check_top1``, ``check_kl``) for one
        with evolved kernels."""
        m = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
        out = {"throughput": m.get("tokens_per_s"), "p99_ms": m.get("itl_p99_ms"), "ttft_p99_ms": m.get("ttft_p99_ms"),
               "top1": m.get("top1", m.get("check_top1")), "kl": m.get("mean_kl", m.get("check_kl")),
               "rounds": m.get("rounds"), "p99_limit_ms": m.get("itl_p99_limit_ms")}  # fmt: skip
        return {k: v for k, v in out.items() if v is not None}

    def round_throughputs(self, figures: Mapping[str, Any]) -> list[float]:
        return [float(r["tokens_per_s"]) for r in figures.get("rounds") or []]

    @property
    def p99_budget_ms(self) -> float:
        return float(self.config.load.itl_p99_budget_ms)  # type: ignore[union-attr]

    def fidelity_text(self, figures: Mapping[str, Any]) -> str:
        return f"top-1 {figures.get('top1', float('nan')):.4f} and mean KL {figures.get('kl', float('nan')):.5f} nats"


# a prompt's chunk in the attention search's timed step: prefill costs a chat load as much attention as decoding
# (a prompt of n tokens scores ~n^2/2 key-query pairs), and which kernel is fastest differs between the two
_CHUNK = 8

# the attention task whose kernels run over each KV cache type
_ATTENTION_TASKS = {"fp32": "attention_decode", "f16": "attention_decode_f16"}


def _chat_slot(task: str) -> str:
    """The chat engine's slot a built-in task's kernels fill."""
    from runtime.decoder.kernels import precision_of

    if task in _ATTENTION_TASKS.values():
        return "attention"
    if task == "rmsnorm":
        return "rmsnorm"
    if task in ("lm_head_topk", "lm_head_topk_vnni"):
        return "lm_head"
    precision_of(task)  # a linear task of a precision the decoder runs, or a ValueError
    return "linear"


def kind_of(config: FactoryConfig) -> ModelKind:
    return ChatKind(config) if config.chat else EncoderKind(config)
