"""Structured output: a JSON schema the server enforces token by token.

A schema is compiled once (outlines-core: the schema to a regular expression, the expression over the
model's vocabulary to an index of the tokens allowed in each state), in a process of its own under memory and
time limits (a schema comes from a request), and kept per tokenizer. Each request
walks it with a :class:`GrammarState` of its own: before a token is sampled, every token that would leave
the language gets no probability; once the text is complete only the end token is left. Special tokens
never stand for text, so none is ever allowed inside it.
"""

from __future__ import annotations

import functools
import json
import struct
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from runtime.decoder.tokenizer import Tokenizer

__all__ = ["Grammar", "GrammarError", "GrammarState", "json_schema_grammar"]

MAX_SCHEMA_CHARS = 16_384
"""A bigger schema is refused: its index takes memory and time to build for every distinct schema."""

# JSON mode's object: values are scalars or arrays of them. A generic nested object compiles ~50 times slower
# (seconds for a 49k-token vocabulary); a schema states whatever nesting it needs.
_SCALAR: dict[str, Any] = {"type": ["string", "number", "boolean", "null"]}
_ANY_OBJECT: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}]},
}


class GrammarError(ValueError):
    """A schema that cannot be enforced (malformed, unsupported, too big), or no library to enforce it."""


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled schema over one tokenizer's vocabulary; ``pattern`` is the regular expression it became."""

    index: Any  # outlines_core.Index
    pattern: str
    end_id: int

    def start(self) -> GrammarState:
        from outlines_core import Guide

        return GrammarState(Guide(self.index), self.end_id)


class GrammarState:
    """Where one generation stands in its grammar: the tokens allowed next, and the walk forward."""

    def __init__(self, guide: Any, end_id: int) -> None:
        self._guide, self.end_id = guide, end_id
        self._words: np.ndarray | None = None

    def mask(self, logits: np.ndarray) -> None:
        """Sets every token the grammar does not allow next to -inf, in place (``logits`` ``[vocab]``)."""
        n = logits.shape[-1]
        words = (n + 31) // 32
        if self._words is None or self._words.size != words:
            self._words = np.zeros(words, np.int32)
        self._guide.write_mask_into(self._words.ctypes.data, words, 4)
        allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:n].astype(bool)
        logits[~allowed] = -np.inf

    def advance(self, token: int) -> None:
        """Moves past ``token`` (one the mask allowed); the end token is accepted once the text is complete."""
        if token == self.end_id and self._guide.is_finished():
            return
        self._guide.advance(token)

    @property
    def complete(self) -> bool:
        return bool(self._guide.is_finished())


def json_schema_grammar(tokenizer: Tokenizer, schema: dict[str, Any] | None) -> Grammar:
    """The grammar of JSON text matching ``schema`` (``None``: a JSON object of scalars and arrays of them, the
    "JSON mode" of OpenAI's ``response_format: {"type": "json_object"}``), compiled for ``tokenizer``'s
    vocabulary; the same schema is compiled once per tokenizer (and refused once). :class:`GrammarError` says why
    it cannot be."""
    text = json.dumps(_ANY_OBJECT if schema is None else schema)  # key order is the order the text must follow
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"the schema has {len(text)} characters: this server compiles schemas of up to "
                           f"{MAX_SCHEMA_CHARS}")  # fmt: skip
    _check_bounds(schema)
    got = _compiled(tokenizer)(text)
    if isinstance(got, GrammarError):
        raise got
    return got


MAX_BOUND = 4096
_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _check_bounds(node: Any) -> None:
    """Refuses at once a length or count bound no answer could be held to (each allowed length is a state)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, int | float) and value > MAX_BOUND:
                raise GrammarError(f"{key} is {value}: this server enforces length and count bounds of up to "
                                   f"{MAX_BOUND}")  # fmt: skip
            _check_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _check_bounds(value)


_PER_TOKENIZER: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _compiled(tokenizer: Tokenizer) -> Any:
    """``tokenizer``'s cache of compiled schemas (by their JSON text), made on first use."""
    with _LOCK:
        found = _PER_TOKENIZER.get(tokenizer)
        if found is None:
            found = _PER_TOKENIZER[tokenizer] = functools.lru_cache(maxsize=32)(
                functools.partial(_compile, _Vocabulary(tokenizer))
            )
        return found


class _Vocabulary:
    """outlines-core's view of a tokenizer: each text token's bytes, and the end token (built on first use)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = weakref.ref(tokenizer)  # weak: the cache it sits in is keyed by the tokenizer, weakly
        self._built: tuple[Any, int] | None = None
        self._lock = threading.Lock()

    def get(self) -> tuple[Any, int]:
        with self._lock:
            if self._built is None:
                tokenizer = self._tokenizer()
                if tokenizer is None:
                    raise GrammarError("the model's tokenizer is gone")
                self._built = _outlines_vocabulary(tokenizer)
            return self._built


def _outlines_vocabulary(tokenizer: Tokenizer) -> tuple[Any, int]:
    try:
        from outlines_core import Vocabulary
    except ImportError:
        raise GrammarError("structured output needs outlines-core: pip install 'evoforge[decoder]'") from None
    ends = tokenizer.end_ids
    if not ends:
        raise GrammarError("the model names no end token: a structured answer could not end")
    end = tokenizer.eos_id if tokenizer.eos_id in ends else min(ends)
    special = tokenizer.special
    words: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        if i in special or i in ends:
            continue
        piece = tokenizer.token_bytes(i)
        if piece:
            words.setdefault(piece, []).append(i)
    return Vocabulary(end, words), end


COMPILE_TIMEOUT_S = 30.0
COMPILE_MEMORY_MB = 2048
"""A schema is compiled in a process of its own under these limits: a schema is a request's, and some (a string
of at least 10^8 characters, an array of 10^5 items) would take the server's memory or time with them."""

# The compiling process: reads the vocabulary (outlines-core's own serialisation) and the schema, writes the
# regular expression and the index. It imports outlines-core alone; its limits are set before it reads a byte.
_CHILD = """
import resource, struct, sys
limit = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
resource.setrlimit(resource.RLIMIT_CPU, (int(sys.argv[2]), int(sys.argv[2])))
from outlines_core import Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema
data = sys.stdin.buffer.read()
(n,) = struct.unpack("<Q", data[:8])
vocab, schema = Vocabulary.from_binary(data[8 : 8 + n]), data[8 + n :].decode()
try:
    pattern = build_regex_from_schema(schema)
    index = Index(pattern, vocab)
except Exception as exc:
    sys.stderr.write(str(exc)[:500])
    sys.exit(3)
out = pattern.encode()
sys.stdout.buffer.write(struct.pack("<Q", len(out)) + out + index.__reduce__()[1][0])
"""


def _compile(vocabulary: _Vocabulary, schema_text: str) -> Grammar | GrammarError:
    """The grammar, or the error that refuses it (kept like a grammar: a refused schema is not compiled again)."""
    try:
        return _compile_in_child(vocabulary, schema_text)
    except GrammarError as exc:
        return exc


def _compile_in_child(vocabulary: _Vocabulary, schema_text: str) -> Grammar:
    from outlines_core import Index

    vocab, end = vocabulary.get()
    payload = vocab.__reduce__()[1][0]
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _CHILD, str(COMPILE_MEMORY_MB), str(int(COMPILE_TIMEOUT_S) + 1)],
            input=struct.pack("<Q", len(payload)) + payload + schema_text.encode(), capture_output=True,
            timeout=COMPILE_TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise GrammarError(f"the schema did not compile within {COMPILE_TIMEOUT_S:g} s: make it smaller (shorter "
                           "length and item bounds, fewer alternatives)") from None  # fmt: skip
    if done.returncode == 3:
        raise GrammarError(f"the schema cannot be enforced: {done.stderr.decode(errors='replace').strip()}")
    if done.returncode != 0:
        raise GrammarError(f"the schema did not compile within {COMPILE_MEMORY_MB} MB and {COMPILE_TIMEOUT_S:g} s "
                           "(its length or item bounds are too large to enforce token by token)")  # fmt: skip
    (n,) = struct.unpack("<Q", done.stdout[:8])
    pattern = done.stdout[8 : 8 + n].decode()
    return Grammar(index=Index.from_binary(done.stdout[8 + n :]), pattern=pattern, end_id=end)
