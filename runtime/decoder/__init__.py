"""The decoder engine: a Llama-family chat model from a GGUF file, on numpy.

:func:`load_decoder` reads the model (every shape from the file's metadata, the weights dequantised to
fp32) and its tokenizer and chat template; :class:`Decoder` generates from text or chat messages,
several sequences together, each over its own KV cache. Every operator of the forward pass is a slot of
:class:`DecoderOps` (numpy defaults). Needs the ``decoder`` extra (gguf, tokenizers, jinja2); torch is
never imported.
"""

from __future__ import annotations

from runtime.decoder.generate import Completion, Decoder, FinishReason, Prompt
from runtime.decoder.gguf_file import ARCHITECTURES, DecoderConfig, GGUFFile, GGUFLoadError, read_config
from runtime.decoder.model import ContextFull, DecoderModel, KVCache, Layer, load_decoder
from runtime.decoder.ops import DECODER_SLOTS, DecoderOps
from runtime.decoder.sampling import SamplingParams, sample
from runtime.decoder.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer

__all__ = [
    "ARCHITECTURES",
    "DECODER_SLOTS",
    "ChatTemplate",
    "ChatTemplateError",
    "Completion",
    "ContextFull",
    "Decoder",
    "DecoderConfig",
    "DecoderModel",
    "DecoderOps",
    "FinishReason",
    "GGUFFile",
    "GGUFLoadError",
    "KVCache",
    "Layer",
    "Prompt",
    "SamplingParams",
    "Tokenizer",
    "load_decoder",
    "read_config",
    "sample",
]
