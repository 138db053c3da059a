"""The decoder engine: a Llama-family chat model from a GGUF file, on numpy.

:func:`load_decoder` reads the model (every shape from the file's metadata, the weights dequantised to
fp32) and its tokenizer and chat template; :class:`Decoder` generates from text or chat messages,
several sequences together, each over its own KV cache; a :class:`Scheduler` batches requests continuously
on an engine thread and streams each one's text. Every operator of the forward pass is a slot of
:class:`DecoderOps` (numpy defaults). Needs the ``decoder`` extra (gguf, tokenizers, jinja2); torch is
never imported.
"""

from __future__ import annotations

from runtime.decoder.channel import Channel
from runtime.decoder.generate import Completion, Decoder, FinishReason, Prompt, check_prompt
from runtime.decoder.gguf_file import ARCHITECTURES, DecoderConfig, GGUFFile, GGUFLoadError, read_config
from runtime.decoder.model import ContextFull, DecoderModel, KVCache, Layer, load_decoder
from runtime.decoder.ops import DECODER_SLOTS, DecoderOps
from runtime.decoder.sampling import SamplingParams, sample
from runtime.decoder.scheduler import (
    Chunk,
    DoesNotFit,
    Generation,
    QueueFull,
    Scheduler,
    SchedulerClosed,
    SchedulerConfig,
    kv_bytes_per_token,
)
from runtime.decoder.stream import TextStream
from runtime.decoder.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer

__all__ = [
    "ARCHITECTURES",
    "DECODER_SLOTS",
    "Channel",
    "ChatTemplate",
    "ChatTemplateError",
    "Chunk",
    "Completion",
    "ContextFull",
    "Decoder",
    "DecoderConfig",
    "DecoderModel",
    "DecoderOps",
    "DoesNotFit",
    "FinishReason",
    "GGUFFile",
    "GGUFLoadError",
    "Generation",
    "KVCache",
    "Layer",
    "Prompt",
    "QueueFull",
    "SamplingParams",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "TextStream",
    "Tokenizer",
    "check_prompt",
    "kv_bytes_per_token",
    "load_decoder",
    "read_config",
    "sample",
]
