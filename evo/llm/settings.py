"""The ``llm:`` section of a job config: which models, how to call them, prompts and agent budgets.

Secrets never live here: ``api_key_env`` names an environment variable that is read at call time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AgenticSettings", "LLMSettings", "ModelSettings", "PromptSettings"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSettings(_Model):
    """One OpenAI-compatible endpoint and model (vLLM, SGLang, Ollama, llama.cpp server, hosted APIs)."""

    base_url: str = Field(description="the endpoint's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="model name as the endpoint knows it")
    api_key_env: str | None = Field(
        None, description="NAME of the environment variable holding the API key (read at call time; null: no key)"
    )
    weight: float = Field(1.0, gt=0, description="relative share of calls this model gets")
    temperature: float = Field(0.7, ge=0, le=2, description="sampling temperature")
    max_tokens: int = Field(4096, ge=16, description="most tokens one answer may have")
    timeout: float = Field(120.0, gt=0, description="seconds one call may take, retries and backoff included")
    max_concurrency: int = Field(2, ge=1, description="calls in flight to this model at once")
    structured_output: Literal["auto", "on", "off"] = Field(
        "auto", description="ask for JSON answers (llm_params) with a response_format JSON schema the endpoint "
        "enforces: auto sends it until the endpoint refuses one, then asks in the prompt alone; on always; off never")


class PromptSettings(_Model):
    """Prompt templates (files with ``{placeholders}``; null keeps the built-in one) and the size bound."""

    system: Path | None = Field(None, description="template of the system message of every operator")
    diff: Path | None = Field(None, description="template of llm_diff's request")
    rewrite: Path | None = Field(None, description="template of llm_rewrite's request")
    params: Path | None = Field(None, description="template of llm_params's request")
    agentic: Path | None = Field(None, description="template of the agentic operator's first request")
    max_chars: int = Field(
        24000, ge=2000, description="prompt size bound: inspirations, hints and history are cut first, never a source"
    )


class AgenticSettings(_Model):
    """Budgets of one agentic proposal; the loop ends at commit or when any of them runs out."""

    max_steps: int = Field(8, ge=1, description="model turns per agentic proposal")
    max_seconds: float = Field(300.0, gt=0, description="wall seconds per agentic proposal, tools included")
    max_tokens: int = Field(60000, ge=100, description="tokens (in + out) per agentic proposal")


class LLMSettings(_Model):
    """Language models as variation operators (weights in ``search.operators.weights``)."""

    models: list[ModelSettings] = Field(min_length=1, description="models to call, chosen by weight")
    token_budget: int | None = Field(
        None, ge=1, description="tokens (in + out) the whole run may pay for; then LLM operators stop"
    )
    retry_rejected: bool = Field(True, description="a rejected diff or answer is retried once, showing the error")
    repair_params: bool = Field(True, description="an llm_params point that breaks only the space's constraints is "
                                "repaired (the parameters of the failing constraints redrawn, the rest kept) and "
                                "recorded as applied, with what was changed")
    cooldown: float = Field(30.0, gt=0, description="seconds a failing endpoint rests before it is tried again")
    failures_to_trip: int = Field(2, ge=1, description="failed calls in a row that make an endpoint rest")
    prompts: PromptSettings = Field(default_factory=PromptSettings)
    agentic: AgenticSettings = Field(default_factory=AgenticSettings)
