"""Generation: prompts (text or chat messages) in, completions out, several sequences stepped together.

:meth:`Decoder.generate_batch` prefills every prompt in one forward pass (each into its own KV cache),
then decodes all unfinished sequences one token each per forward pass, until each one ends: at the
model's end token or a stop string (finish reason ``"stop"``), or at ``max_tokens`` or the context length
(``"length"``). Each sequence samples with its own parameters and generator, so it gets the same tokens
in a batch as alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.decoder.grammar import GrammarState
from runtime.decoder.model import ContextFull, DecoderModel, KVCache, load_decoder
from runtime.decoder.ops import DecoderOps
from runtime.decoder.sampling import SamplingParams, sample
from runtime.decoder.stream import FinishReason, TextStream
from runtime.decoder.tokenizer import Tokenizer

__all__ = ["Completion", "Decoder", "FinishReason", "Prompt", "check_prompt"]

Prompt = str | Sequence[Mapping[str, Any]]
"""A text prompt (tokenized as it is, BOS first where the model adds one) or chat messages (rendered by the
model's chat template, with the assistant's turn opened)."""


@dataclass(frozen=True)
class Completion:
    """A finished generation: the text (without the end token or the stop string), the generated ids (without
    the end token; with the tokens of a stop string), the prompt's length in tokens and why it ended."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: FinishReason


def check_prompt(ids: Sequence[int], context: int) -> None:
    """Raises ``ValueError`` for a prompt of no tokens, :class:`ContextFull` for one that leaves no room to
    generate in the ``context``."""
    if not ids:
        raise ValueError("the prompt has no tokens (and the model adds no BOS): give some text")
    if len(ids) >= context:
        raise ContextFull(f"the prompt's {len(ids)} tokens leave no room in the context of {context}")


@dataclass
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    rng: np.random.Generator
    cache: KVCache
    stream: TextStream
    grammar: GrammarState | None = None


class Decoder:
    """A loaded model and the operators it runs on; :meth:`generate` answers one prompt. With ``top``, the
    scheduler's steps whose sampling needs no more than each row's ``top`` likeliest tokens run the LM head's top
    list (``ops.lm_head_topk``) in place of the full logits."""

    def __init__(self, model: DecoderModel, *, ops: DecoderOps | None = None, top: int = 0) -> None:
        self.model = model
        self.ops = ops or DecoderOps()
        self.top = top

    @classmethod
    def load(cls, path: str | Path, *, ops: DecoderOps | None = None) -> Decoder:
        """The decoder of the GGUF file ``path`` (see :func:`runtime.decoder.load_decoder`)."""
        return cls(load_decoder(path), ops=ops)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """The token ids of ``prompt`` (see :data:`Prompt`)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return self.tokenizer.encode_chat(prompt)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **settings: Any) -> Completion:
        """The completion of ``prompt``; ``settings`` are :class:`SamplingParams` fields (e.g. ``max_tokens=16``,
        ``temperature=0.7, seed=1``) over ``params``."""
        if settings:
            params = SamplingParams(**{**vars(params or SamplingParams()), **settings})
        return self.generate_batch([prompt], params)[0]

    def generate_batch(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """The completions of ``prompts``, generated together; ``params`` is one for all or one per prompt."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling parameters for {len(prompts)} prompts: give one or one each")
        context = self.model.config.context
        seqs = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = self.encode_prompt(prompt)
            check_prompt(ids, context)
            stream = TextStream(self.tokenizer, p, prompt_tokens=len(ids), context=context)
            seqs.append(_Sequence(ids, p, p.rng(), self.model.new_cache(len(ids) + min(p.max_tokens, 256)), stream,
                                  p.grammar.start() if p.grammar is not None else None))
        if not seqs:
            return []
        logits = self.model.forward([s.prompt for s in seqs], [s.cache for s in seqs], self.ops)
        active = seqs
        while True:
            for s, row in zip(active, logits, strict=True):
                s.stream.push(sample(row, s.params, s.rng, self.tokenizer.end_ids, s.grammar))
            active = [s for s in active if s.stream.finish is None]
            if not active:
                break
            logits = self.model.forward([[s.stream.generated[-1]] for s in active], [s.cache for s in active],
                                        self.ops)  # fmt: skip
        return [Completion(text=s.stream.text, token_ids=s.stream.generated, prompt_tokens=len(s.prompt),
                           finish_reason=s.stream.finish or "length") for s in seqs]  # fmt: skip
