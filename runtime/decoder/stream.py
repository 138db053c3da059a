"""One sequence's generated tokens becoming text, token by token: when it ends, and which text is safe to send.

A :class:`TextStream` takes each sampled token and decides whether the sequence has finished: at the model's
end token or a stop string (``"stop"``), or at ``max_tokens`` or the context length (``"length"``). Its
:attr:`~TextStream.text` is the decoded text of the generated tokens (cut before the first stop string), and
:meth:`~TextStream.push` returns the part of it that can no longer change: text that ends in an unfinished
UTF-8 character (a character split across tokens decodes to U+FFFD until its last byte comes) or that could
still be the start of a stop string is held back until it is settled or the sequence ends. The pieces
returned, joined, are the final text exactly.
"""

from __future__ import annotations

from typing import Literal

from runtime.decoder.sampling import SamplingParams
from runtime.decoder.tokenizer import Tokenizer

__all__ = ["FinishReason", "TextStream"]

FinishReason = Literal["stop", "length"]
_REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one generation as its tokens come (``prompt_tokens`` long prompt, ``context`` the model's)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, *, prompt_tokens: int, context: int) -> None:
        self.tokenizer, self.params = tokenizer, params
        self.prompt_tokens, self.context = prompt_tokens, context
        self.generated: list[int] = []  # without the end token; with the tokens of a stop string
        self.text = ""
        self.finish: FinishReason | None = None
        self.sampled = 0  # tokens sampled, the end token included
        self._sent = 0  # characters of text returned by push
        self._hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string's start, not yet whole

    def push(self, token: int) -> str:
        """Adds the sampled ``token``; returns the newly settled text (all that is left once finished)."""
        if self.finish is not None:
            raise ValueError("the generation has finished: it takes no more tokens")
        self.sampled += 1
        if token in self.tokenizer.end_ids:
            self.finish = "stop"
            return self._settled()
        self.generated.append(token)
        previous = len(self.text)
        self.text = self.tokenizer.decode(self.generated)
        if self.params.stop:
            # a stop string ends in the new text; it may begin up to its length before it
            start = max(0, previous - max(len(x) for x in self.params.stop))
            hits = [i for i in (self.text.find(x, start) for x in self.params.stop) if i >= 0]
            if hits:
                self.text, self.finish = self.text[: min(hits)], "stop"
                return self._settled()
        if len(self.generated) >= self.params.max_tokens or self.prompt_tokens + len(self.generated) >= self.context:
            self.finish = "length"
        return self._settled()

    def _settled(self) -> str:
        end = len(self.text)
        if self.finish is None:
            end -= self._hold
            while end > self._sent and self.text[end - 1] == _REPLACEMENT:  # maybe a character not yet whole
                end -= 1
        if end <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent : end], end
        return piece
