"""Generative load over HTTP, timed on the client's clock: closed-loop clients streaming chat completions from an
OpenAI-compatible server (``evo serve --gguf``, ``llama-server``), and the prompts they send.

Each client sends its next prompt as soon as its last answer ended, asking for ``max_tokens`` greedy tokens with
``ignore_eos``, so every answer has the same length on every server. A figure is what the client saw: time to
first token from the request sent to the first chunk with text, inter-token latency between successive chunks
with text, output tokens as the server counted them in ``usage`` over the wall time of the whole load.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.decoder.tokenizer import Tokenizer

__all__ = ["Answer", "ChatLoad", "LoadFailed", "chat", "draw_prompts", "run_load"]


class LoadFailed(RuntimeError):
    """A request of the load failed (an HTTP error, a broken stream, a server gone)."""


@dataclass
class Answer:
    """One streamed request as the client saw it."""

    prompt: str
    sent: float
    stamps: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the answer's tokens, where asked for (``ids``)
    reported: list[list[tuple[int, float]]] = field(default_factory=list)  # each token's likeliest (``top``)


def chat(port: int, prompt: str, max_tokens: int, *, ids: bool = False, top: int = 0,
         timeout: float = 600.0) -> Answer:  # fmt: skip
    """One streamed greedy chat request to ``127.0.0.1:port``: its chunks' arrival times, its text and the usage
    the server reported; with ``ids``, its tokens too (``logprobs``, whose entries carry each token's id as
    evoforge's and llama.cpp's servers give it), and with ``top`` each token's ``top`` likeliest tokens and their
    log-probabilities as the server reported them. Raises :class:`LoadFailed`."""
    request: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}  # fmt: skip
    if ids or top:
        request["logprobs"] = True
    if top:
        request["top_logprobs"] = top
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    answer = Answer(prompt, time.perf_counter())
    parts: list[str] = []
    done = False
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(request).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise LoadFailed(f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
        while line := resp.readline():
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                done = True
                break
            now = time.perf_counter()
            event = json.loads(line[6:])
            if "error" in event:
                raise LoadFailed(f"the stream failed: {event['error'].get('message')}")
            choices = event.get("choices") or ()
            text = "".join(c.get("delta", {}).get("content") or "" for c in choices)
            for c in choices if ids or top else ():
                entries = (c.get("logprobs") or {}).get("content") or ()
                answer.token_ids += [int(e["id"]) for e in entries]
                answer.reported += [[(int(t["id"]), float(t["logprob"])) for t in e.get("top_logprobs") or ()]
                                    for e in entries if top]  # fmt: skip
            if text:
                answer.stamps.append(now)
                parts.append(text)
            if usage := event.get("usage"):
                answer.completion_tokens, answer.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise LoadFailed(f"{type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    if not done:
        raise LoadFailed("the stream ended without [DONE]")
    answer.text = "".join(parts)
    return answer


@dataclass(frozen=True)
class ChatLoad:
    """What one load measured, and every answer (for checking what the server generated)."""

    seconds: float  # from the first request sent to the last answer
    tokens: int  # completion tokens, as the server counted them
    prompt_tokens: float  # mean per request
    ttft_s: tuple[float, float]  # p50, p99
    itl_s: tuple[float, float]  # p50, p99
    answers: list[Answer]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def figures(self) -> dict[str, float]:
        return {"tokens_per_s": self.tokens_per_s, "tokens": self.tokens, "requests": len(self.answers),
                "prompt_tokens": self.prompt_tokens, "ttft_p50": self.ttft_s[0], "ttft_p99": self.ttft_s[1],
                "itl_p50": self.itl_s[0], "itl_p99": self.itl_s[1]}  # fmt: skip


def run_load(port: int, prompts: Sequence[str], streams: int, max_tokens: int, *, ids: bool = False, top: int = 0,
             tick: Callable[[], None] | None = None, timeout: float = 600.0) -> ChatLoad:  # fmt: skip
    """``streams`` closed-loop clients over ``prompts`` (client ``i`` sends every ``streams``-th, in order), each
    request as :func:`chat` sends it; ``tick`` is called every 0.2 s while they run (e.g. to sample the server's
    memory). Raises :class:`LoadFailed` with the first failure, after every client has stopped."""
    answers: list[Answer] = []
    errors: list[LoadFailed] = []
    lock = threading.Lock()

    def client(mine: Sequence[str]) -> None:
        for prompt in mine:
            if errors:
                return
            try:
                a = chat(port, prompt, max_tokens, ids=ids, top=top, timeout=timeout)
            except LoadFailed as exc:
                errors.append(exc)
                return
            with lock:
                answers.append(a)

    threads = [threading.Thread(target=client, args=(prompts[i::streams],), daemon=True) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if tick is not None:
            tick()
        for t in threads:
            t.join(0.2 / len(threads))
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if not answers:
        raise LoadFailed("no request was sent: give some prompts")
    ttft = [a.stamps[0] - a.sent for a in answers if a.stamps]
    gaps = [np.diff(a.stamps) for a in answers if len(a.stamps) > 1]
    itl = np.concatenate(gaps) if gaps else np.zeros(1)
    return ChatLoad(seconds=seconds, tokens=sum(a.completion_tokens for a in answers),
                    prompt_tokens=float(np.mean([a.prompt_tokens for a in answers])),
                    ttft_s=(_pct(ttft, 50), _pct(ttft, 99)), itl_s=(_pct(itl, 50), _pct(itl, 99)),
                    answers=answers)  # fmt: skip


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def draw_prompts(tokenizer: Tokenizer, corpus: Sequence[int], count: int, lo: int, hi: int,
                 rng: random.Random, lengths: random.Random | None = None) -> list[str]:  # fmt: skip
    """``count`` user messages cut from the token ids ``corpus``, each about ``lo``..``hi`` tokens once the chat
    template wraps it, each from an offset of its own (drawn by ``rng``; the lengths by ``lengths``, default
    ``rng`` too: loads whose lengths are drawn alike do the same work on other text)."""
    lengths = lengths or rng
    out = []
    for _ in range(count):
        n = max(1, lengths.randint(lo, hi) - 30)  # the chat template's own tokens, about
        start = rng.randrange(0, max(1, len(corpus) - n))
        out.append("Summarise this:\n" + tokenizer.decode(list(corpus[start : start + n])))
    return out
