"""A factory's YAML config: the model, the load it serves, the budget and how it plans, promotes and serves.

Two kinds of model: a BERT sentence encoder (``model_dir``, default the bundled MiniLM), or a GGUF chat model
(``model``: a file, or smollm2 / gemma3). Its kind picks what ``load`` and ``promote`` hold, and the slots planned."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from evo.config import ExecutionConfig
from evo.errors import UserError
from runtime.engine.load import ServingLoad

__all__ = ["FactoryConfig", "load_factory_config"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoadConfig(ServingLoad):
    """The serving load every engine is measured under: the engine task's arguments of the same names."""

    threads: int = Field(2, ge=1, description="cores an engine runs on")
    p99_budget_ms: float = Field(250.0, gt=0, description="an engine over this p99 is never promoted")


class ChatLoadConfig(_Model):
    """The generative load every chat engine is measured under: the chat_engine task's arguments of the same
    names (closed-loop chat clients streaming greedy answers)."""

    threads: int = Field(2, ge=1, description="cores an engine runs on")
    streams: int = Field(8, ge=1, le=256, description="closed-loop chat clients")
    requests: int = Field(2, ge=1, description="requests each client sends per load")
    prompt_tokens: tuple[int, int] = Field((32, 512), description="the prompts' lengths in tokens, drawn uniformly")
    max_tokens: int = Field(128, ge=1, description="tokens each answer runs to")
    itl_p99_budget_ms: float = Field(1000.0, gt=0, description="an engine over this p99 inter-token latency is never "
                                     "promoted")  # fmt: skip
    itl_p99_factor: float | None = Field(None, gt=0, description="nor one over this multiple of the p99 inter-token "
                                         "latency of the engine measured beside it: the default engine in the "
                                         "engine search, the incumbent in a duel (a bound that carries across "
                                         "CPUs)")  # fmt: skip
    ttft_p99_budget_ms: float = Field(60000.0, gt=0, description="nor one over this p99 time to first token")
    kv_cache_mb: float = Field(2048.0, gt=0, description="the KV cache budget of the running requests")


class BudgetConfig(_Model):
    rounds: int = Field(2, ge=1, description="profile -> plan -> searches -> promotion, this many times")
    kernel_evals: int = Field(60, ge=1, description="kernel evaluations per round, shared by the slots' searches")
    engine_evals: int = Field(30, ge=1, description="engine evaluations per round")
    engine_after_kernels: int = Field(5, ge=1, description="of those, how many wait for the round's kernel "
                                      "searches to end (they see every kernel found); the rest run alongside")
    min_evals: int = Field(6, ge=1, description="evaluations a planned kernel search gets at least")
    confirm_repeats: int = Field(3, ge=0, description="fresh evaluations confirming each search's best as it "
                                 "ends (search.confirm.repeats of its runs; 0: none)")

    @model_validator(mode="after")
    def _after_within_engine(self) -> BudgetConfig:
        if self.engine_after_kernels > self.engine_evals:
            raise ValueError(f"engine_after_kernels ({self.engine_after_kernels}) is more than engine_evals "
                             f"({self.engine_evals})")  # fmt: skip
        return self


ENCODER_SLOTS = ["linear", "gelu", "layernorm", "softmax"]
CHAT_SLOTS = ["linear", "attention", "rmsnorm", "lm_head"]


class PlanConfig(_Model):
    min_share: float = Field(0.05, ge=0, lt=1, description="a slot under this share of the time gets no search")
    slots: list[str] | None = Field(None, description="slots the factory may search kernels for (default: every "
                                    f"slot of the model's kind: {', '.join(ENCODER_SLOTS)}; a chat model's "
                                    f"{', '.join(CHAT_SLOTS)})")  # fmt: skip
    precisions: list[str] = Field(default_factory=lambda: ["fp32", "q8"], description="a chat model's GEMM "
                                  "precisions whose kernels the linear slot's searches evolve (those this CPU runs)")
    kv_dtypes: list[Literal["fp32", "f16"]] = Field(
        default_factory=lambda: ["f16"], min_length=1,
        description="a chat model's KV cache types whose kernels the attention slot's searches evolve (an engine "
                    "runs an attention kernel over the cache type it was evolved for)")  # fmt: skip
    stagnation: float = Field(0.02, ge=0, description="a slot whose last search gained less (relative) is "
                                                      "not searched again")  # fmt: skip

    @field_validator("precisions", "kv_dtypes")
    @classmethod
    def _once_each(cls, values: list[str]) -> list[str]:
        if len(set(values)) != len(values):
            raise ValueError(f"{values}: name each one once")
        return values


class _DuelConfig(_Model):
    rounds: int = Field(3, ge=1, description="alternating load rounds of the candidate and the incumbent")
    min_gain: float = Field(0.0, ge=-1, description="promoted only when faster than the incumbent by more than this "
                                                  "(relative; below 0 accepts a loss that small)")
    every_round: bool = Field(True, description="promoted only when ahead of the incumbent by min_gain in every "
                              "round, not only in the median (a lucky round cannot carry the duel)")
    finalists: int = Field(1, ge=1, description="the engine search's best this many, each in a duel against the "
                           "incumbent once the searches are done; of those that win, the one ahead by the most is "
                           "promoted (a search's single loads rank engines closer than their noise)")


class PromoteConfig(_DuelConfig):
    held_out_texts: int = Field(64, ge=8, description="texts the searches never saw, for the similarity check")
    similarity_floor: float = Field(0.99, gt=0, le=1, description="min cosine to the fp32 engine on them")
    duration_s: float = Field(4.0, gt=0, description="measured seconds of each of those rounds")


class ChatPromoteConfig(_DuelConfig):
    held_out_texts: int = Field(8, ge=1, description="texts the searches never check, for the fidelity check")
    top1_floor: float = Field(0.94, gt=0, le=1, description="top-1 agreement with the fp32 engine, at least")
    kl_floor: float = Field(0.01, ge=0, description="mean KL divergence from the fp32 engine (nats), at most")


class FactoryConfig(_Model):
    name: str | None = Field(None, description="factory name (default: the config file's stem); factories/<name>")
    model_dir: str | None = Field(None, description="a BERT sentence encoder's directory (default: the bundled "
                                                    "all-MiniLM-L6-v2)")  # fmt: skip
    model: str | None = Field(None, description="a GGUF chat model: a file, or smollm2 / gemma3 (their packages'); "
                              "the factory then builds a chat engine")
    load: LoadConfig | ChatLoadConfig = Field(default_factory=LoadConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    promote: PromoteConfig | ChatPromoteConfig = Field(default_factory=PromoteConfig)
    execution: ExecutionConfig = Field(
        default_factory=ExecutionConfig, description="where the searches evaluate (kind: ray spreads every search "
        "over the cluster's nodes, and a round's kernel searches then run at once); profiles and duels run here")
    seed: int = Field(0, description="seed of every search")

    @model_validator(mode="before")
    @classmethod
    def _kind(cls, raw: Any) -> Any:
        """``load`` and ``promote`` are the model kind's: a chat model's (``model``) or a sentence encoder's;
        ``model`` and ``model_dir`` exclude each other."""
        if not isinstance(raw, dict):
            return raw
        chat = raw.get("model") is not None
        if chat and raw.get("model_dir") is not None:
            raise ValueError("give model (a GGUF chat model) or model_dir (a sentence encoder), not both")
        out = dict(raw)
        kinds = (("load", ChatLoadConfig), ("promote", ChatPromoteConfig)) if chat else \
            (("load", LoadConfig), ("promote", PromoteConfig))  # fmt: skip
        for key, kind in kinds:
            try:
                out[key] = kind.model_validate(raw.get(key) or {})
            except ValidationError as exc:  # said with its place: this runs before the fields are validated
                first = exc.errors()[0]
                whose = "a chat model's" if chat else "a sentence encoder's (a chat model's: give model)"
                raise ValueError(f"{key}.{'.'.join(str(p) for p in first['loc'])}: {first['msg']} "
                                 f"({whose})") from None  # fmt: skip
        return out

    @property
    def chat(self) -> bool:
        """Whether the factory builds a chat engine (a GGUF model) rather than a sentence encoder's."""
        return self.model is not None

    @property
    def slots(self) -> list[str]:
        return self.plan.slots if self.plan.slots is not None else (CHAT_SLOTS if self.chat else ENCODER_SLOTS)


def load_factory_config(path: Path) -> FactoryConfig:
    """The config at ``path``; a missing file or an invalid key is one :class:`UserError` line."""
    try:
        raw: Any = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path} is not valid YAML: {exc}") from None
    try:
        config = FactoryConfig.model_validate(raw or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:  # a check of the whole config, which names its own place
            raise UserError(f"{path}: {first['msg'].removeprefix('Value error, ')}") from None
        raise UserError(f"{path}: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    if config.model_dir is not None and not Path(config.model_dir).is_absolute():
        config = config.model_copy(update={"model_dir": str(Path(config.model_dir).resolve())})  # as evo run: cwd
    from runtime.decoder.models import MODELS

    if config.model is not None and config.model not in MODELS and not Path(config.model).is_absolute():
        config = config.model_copy(update={"model": str(Path(config.model).resolve())})
    return config
