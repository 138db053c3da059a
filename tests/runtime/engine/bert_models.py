"""Small random-weight BERT sentence encoders of other shapes, built here with transformers (nothing is
downloaded) and saved by sentence-transformers in its own layout."""

from __future__ import annotations

import shutil
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def make_bert(out: Path, *, hidden: int, heads: int, layers: int, intermediate: int, act: str = "gelu",
              pooling: str = "mean", normalize: bool = True, max_seq_length: int = 128,
              seed: int = 0) -> Path:  # fmt: skip
    """Saves a random BERT encoder with these shapes (MiniLM's WordPiece vocabulary) to ``out``."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel

    from runtime.engine.model import default_model_dir

    torch.manual_seed(seed)
    hf = out.with_name(out.name + "-hf")
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
                        intermediate_size=intermediate, hidden_act=act, max_position_embeddings=max_seq_length,
                        layer_norm_eps=1e-12)  # fmt: skip
    BertModel(config).eval().save_pretrained(hf, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(default_model_dir() / name, hf / name)
    encoder = models.Transformer(str(hf), max_seq_length=max_seq_length)
    modules = [encoder, models.Pooling(hidden, pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    shutil.rmtree(hf)
    return out


def encode(model_dir: Path, texts: list[str]):
    """sentence-transformers' embeddings of ``texts`` by the model saved in ``model_dir`` (its own modules)."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    st = SentenceTransformer(str(model_dir), device="cpu")
    return st.encode(texts, batch_size=8, convert_to_numpy=True)
