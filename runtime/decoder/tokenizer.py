"""The decoder's tokenizer and chat template, built from a GGUF file's metadata.

A GGUF file carries no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``, each with a
type: normal, control, user-defined...), the BPE merges, the special token ids, whether to add BOS, the
name of the pre-tokenizer (``tokenizer.ggml.pre``: how text is split before the merges apply) and the
chat template (Jinja). The tokenizer is a BPE of the ``tokenizers`` library: byte-level (``tokenizer.ggml.model``
``gpt2``), or SentencePiece's (``llama``: spaces written "▁", bytes outside the vocabulary as ``<0xNN>`` tokens,
merges recovered from the vocabulary's order, as transformers recovers them). Control tokens are special tokens
and user-defined ones added tokens, both matched whole in the text, as llama.cpp and transformers do. The chat
template renders in a sandboxed Jinja environment with the variables and helpers transformers gives it; a Gemma
file without one gets Gemma's turn format (:data:`GEMMA_CHAT_TEMPLATE`).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from runtime.decoder.gguf_file import GGUFFile, GGUFLoadError

__all__ = ["ChatTemplate", "ChatTemplateError", "Tokenizer"]

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6  # llama.cpp's token types
_SPACE = "\u2581"  # SentencePiece's space

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}{% else %}"
    "{% if m['role'] not in ['user', 'assistant', 'model'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}{{ '<start_of_turn>' + ('model' if m['role'] != 'user' else 'user') + '\n' + ns.system"
    " + (m['content'] | trim) + '<end_of_turn>\n' }}{% set ns.system = '' %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's turns, for a Gemma file that carries no chat template (as llama.cpp's Gemma format writes them: a
system message opens the next user turn; assistant turns are the model's)."""

_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")
"""Control tokens that end a turn; llama.cpp ends a generation at them where the file names no end-of-turn id."""

# tokenizer.ggml.pre -> the regular expression llama.cpp splits text with before byte-level BPE applies
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}  # fmt: skip
# GPT-2's own split (the byte-level pre-tokenizer's regex), with each digit apart for "smollm"
_GPT2_PRE = ("default", "gpt2")


class ChatTemplateError(ValueError):
    """A chat that the model's template cannot render (a template's ``raise_exception``, or no template)."""


def _byte_level_pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip
    if pre not in _GPT2_PRE:
        log.warning("tokenizer.ggml.pre %r is not known: text is split as GPT-2 splits it", pre)
    return byte_level


class Tokenizer:
    """Text to token ids and back, the special ids, and the chat template (``None`` where the file has none)."""

    def __init__(
        self,
        backend: Any,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        end_ids: Sequence[int] = (),
        add_bos: bool = False,
        chat_template: ChatTemplate | None = None,
        pieces: _Pieces | None = None,
    ) -> None:
        self._tok = backend
        self._pieces = pieces
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        ends = {eos_id, *end_ids} - {None}
        self.end_ids: frozenset[int] = frozenset(int(i) for i in ends)  # type: ignore[arg-type]
        """The ids that end a generation: EOS and, where the file names it, end-of-turn."""

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Tokenizer:
        """The tokenizer the metadata of ``f`` describes; :class:`GGUFLoadError` where it describes none the
        decoder builds (byte-level BPE only)."""
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as Backend

        kind = f.get("tokenizer.ggml.model")
        if kind is None or f.get("tokenizer.ggml.tokens") is None:
            raise GGUFLoadError(f"{f.path}: the metadata has no tokenizer (tokenizer.ggml.model and "
                                "tokenizer.ggml.tokens); convert the model with its tokenizer")  # fmt: skip
        if kind not in ("gpt2", "llama"):
            raise GGUFLoadError(f"{f.path}: tokenizer.ggml.model {kind!r}; the decoder builds byte-level BPE "
                                "('gpt2') and SentencePiece BPE ('llama') tokenizers only")  # fmt: skip
        tokens: list[str] = f.require("tokenizer.ggml.tokens")
        types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            alphabet = set(_BYTE_CHARS.values())
            # a token stored in raw text (not the byte alphabet) is respelled, as byte-level BPE looks it up
            spelled = [t if set(t) <= alphabet else "".join(_BYTE_CHARS[b] for b in t.encode()) for t in tokens]
            vocab = {t: i for i, t in enumerate(spelled)}
            pairs = [tuple(m.split(" ", 1)) for m in f.require("tokenizer.ggml.merges")]
            backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
            backend.pre_tokenizer = _byte_level_pre_tokenizer(f.get("tokenizer.ggml.pre", "default"))
            backend.decoder = decoders.ByteLevel()
        else:
            alphabet = None
            backend = _sentencepiece_backend(f, tokens)
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, kind_ in zip(tokens, types, strict=True)
                                    if kind_ == _CONTROL and (alphabet is None or set(t) <= alphabet)])  # fmt: skip
        # a user-defined token the model's vocabulary spells otherwise (Gemma's runs of spaces) would get an id past
        # the vocabulary: those are left to the model's own pieces, as transformers leaves them
        known = backend.get_vocab(with_added_tokens=False)
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, kind_ in zip(tokens, types, strict=True)
                            if kind_ == _USER_DEFINED and t in known])  # fmt: skip

        def token_id(name: str) -> int | None:
            value = f.get(f"tokenizer.ggml.{name}_token_id")
            return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos"), token_id("eos")
        specials = {f"{name}_token": tokens[i] if i is not None else None
                    for name, i in (("bos", bos), ("eos", eos), ("unk", token_id("unknown")),
                                    ("pad", token_id("padding")))}  # fmt: skip
        source = f.get("tokenizer.chat_template")
        if source is None and str(f.get("general.architecture", "")).startswith("gemma"):
            log.info("%s has no chat template: chats are rendered in Gemma's turn format", f.path)
            source = GEMMA_CHAT_TEMPLATE
        template = ChatTemplate(source, specials) if isinstance(source, str) else None
        ends = [i for i in (token_id("eot"), token_id("eom")) if i is not None]
        if not ends:  # as llama.cpp: a control token that closes a turn ends a generation
            ends = [i for i, (t, kind_) in enumerate(zip(tokens, types, strict=True))
                    if kind_ == _CONTROL and t in _END_OF_TURN]  # fmt: skip
        pieces = None if kind == "gpt2" else _Pieces.of(f, tokens, types)
        return cls(backend, bos_id=bos, eos_id=eos, pad_id=token_id("padding"), end_ids=ends,
                   add_bos=bool(f.get("tokenizer.ggml.add_bos_token", False)), chat_template=template,
                   pieces=pieces)  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """The ids of ``text`` (special tokens in it matched whole), BOS first where ``add_bos`` (default: the
        file's ``tokenizer.ggml.add_bos_token``) and the model has one."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of ``ids``; special tokens left out unless ``skip_special`` is false."""
        if self._pieces is not None:
            return self._pieces.decode(ids, skip_special)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @functools.cached_property
    def special(self) -> frozenset[int]:
        """The control tokens' ids (BOS, turn markers...): they stand for no text."""
        if self._pieces is not None:
            return self._pieces.special
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for in the text (a byte-level token's, or a byte token's, may be part of a
        UTF-8 character); b"" for an id the vocabulary does not have."""
        if self._pieces is not None:
            return self._pieces.pieces[token_id] if 0 <= token_id < len(self._pieces.pieces) else b""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_level_table()
        return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``{"role": ..., "content": ...}``) by the model's chat template."""
        if self.chat_template is None:
            raise ChatTemplateError("the model's GGUF file has no tokenizer.chat_template: give a text prompt")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """The ids of the rendered chat; no BOS is added (a template writes it where the model wants it)."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt), add_bos=False)


def _sentencepiece_backend(f: GGUFFile, tokens: list[str]) -> Any:
    """SentencePiece's BPE as a ``tokenizers`` BPE: the merges its scores imply (for Gemma, its order: the scores
    of its whitespace tokens do not follow their merges), byte fallback, spaces written "▁"."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    gemma = str(f.get("general.architecture", "")).startswith("gemma")
    # Gemma stores a token of spaces alone as spaces; it is looked up as "▁"s
    spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if gemma or f.get("tokenizer.ggml.scores") is None:
        rank = {t: -i for t, i in vocab.items()}
    else:
        rank = dict(zip(spelled, (float(s) for s in f.require("tokenizer.ggml.scores")), strict=True))
    unk = f.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=_implied_merges(vocab, rank), fuse_unk=True, byte_fallback=True,
                       unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None)  # fmt: skip
    backend = Backend(model)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if f.get("tokenizer.ggml.add_space_prefix", not gemma):  # "Hi" is "▁Hi", as SentencePiece's default
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence(steps)
    return backend


class _Pieces:
    """A SentencePiece vocabulary's tokens as bytes, to decode ids as llama.cpp does: a byte token is its byte, the
    bytes of all the tokens are joined, then read as UTF-8 (each invalid sequence one U+FFFD). The ``tokenizers``
    byte-fallback decoder turns a whole run of byte tokens into U+FFFDs when any of them is invalid, so text
    already streamed ("44") could become other text ("\ufffd\ufffd") when the next token came."""

    def __init__(self, pieces: list[bytes], special: frozenset[int], strip_space: bool) -> None:
        self.pieces, self.special, self.strip_space = pieces, special, strip_space

    @classmethod
    def of(cls, f: GGUFFile, tokens: list[str], types: list[int]) -> _Pieces:
        pieces = []
        for t, kind in zip(tokens, types, strict=True):
            if kind == _BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                pieces.append(bytes([int(t[3:5], 16)]))
            else:
                pieces.append(t.replace(_SPACE, " ").encode())
        gemma = str(f.get("general.architecture", "")).startswith("gemma")
        special = frozenset(i for i, kind in enumerate(types) if kind == _CONTROL)
        return cls(pieces, special, bool(f.get("tokenizer.ggml.add_space_prefix", not gemma)))

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        size = len(self.pieces)  # an embedding may have rows past the vocabulary: their ids have no text
        data = b"".join(self.pieces[i] for i in ids if 0 <= i < size and not (skip_special and i in self.special))
        text = data.decode("utf-8", errors="replace")
        return text[1:] if self.strip_space and text.startswith(" ") else text


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character of each byte (GPT-2's), mapped back to the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


def _implied_merges(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every split of each token into two tokens of the vocabulary, best-ranked token first (for one token, the
    longer left part first): the merges a BPE needs to rebuild SentencePiece's segmentation."""
    found = []
    for token, score in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, -cut, -len(right), vocab[left], vocab[right], left, right))
    found.sort()
    return [(m[5], m[6]) for m in found]


class ChatTemplate:
    """A Jinja chat template, compiled once in a sandbox (``ImmutableSandboxedEnvironment``), rendered as
    transformers' ``apply_chat_template`` renders it: ``messages``, ``add_generation_prompt``, the special
    tokens (``bos_token``, ``eos_token``...), and the helpers ``raise_exception``, ``strftime_now`` and a
    ``tojson`` that keeps non-ASCII text."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # fmt: skip
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:  # fmt: skip
        import jinja2

        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **extra})  # fmt: skip
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused the chat: {exc}") from None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (printable ASCII and Latin-1 as themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHARS = _bytes_to_unicode()
