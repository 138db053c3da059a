"""The decoder engine: a Llama-family chat model from a GGUF file, on numpy.

:func:`load_decoder` reads the model (every shape from the file's metadata, the weights dequantised to
fp32) and its tokenizer and chat template; :class:`Decoder` generates from text or chat messages,
several sequences together, each over its own KV cache; a :class:`Scheduler` batches requests continuously
on an engine thread and streams each one's text. Every operator of the forward pass is a slot of
:class:`DecoderOps` (numpy defaults); :func:`decoder_ops` fills the GEMMs and the LM head with the linear slot's
C kernels (int8, fp32, bf16), and :func:`fidelity` measures an engine against another (top-1, KL). Needs the
``decoder`` extra (gguf, tokenizers, jinja2); torch is never imported.
"""

from __future__ import annotations

from runtime.decoder.channel import Channel
from runtime.decoder.fidelity import Fidelity, fidelity
from runtime.decoder.generate import Completion, Decoder, FinishReason, Prompt, check_prompt
from runtime.decoder.gguf_file import ARCHITECTURES, DecoderConfig, GGUFFile, GGUFLoadError, read_config
from runtime.decoder.kernels import MATRICES, PRECISIONS, DecoderKernelError, decoder_ops, linear_task
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
    "MATRICES",
    "PRECISIONS",
    "Channel",
    "ChatTemplate",
    "ChatTemplateError",
    "Chunk",
    "Completion",
    "ContextFull",
    "Decoder",
    "DecoderConfig",
    "DecoderKernelError",
    "DecoderModel",
    "DecoderOps",
    "DoesNotFit",
    "Fidelity",
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
    "decoder_ops",
    "fidelity",
    "kv_bytes_per_token",
    "linear_task",
    "load_decoder",
    "read_config",
    "sample",
]
