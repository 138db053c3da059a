"""A real OpenAI-compatible HTTP server on 127.0.0.1 with scripted answers, and helpers for LLM tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from genome import Genome
from runtime.tasks._common import load_c_source
from runtime.tasks.matmul import Matmul

SECRET = "sk-test-0123456789-do-not-leak"
KEY_ENV = "EVO_TEST_LLM_KEY"


@dataclass
class Reply:
    """One scripted answer: text and/or tool calls, or an HTTP error, or garbage, after ``delay`` seconds."""

    text: str = ""
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: int = 200
    delay: float = 0.0
    garbage: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    error: str = "scripted error"  # an error status's message


Script = Callable[[dict[str, Any], int], Reply]
"""``(request body, request number) -> Reply``."""


class FakeLLM:
    """Serves ``/v1/chat/completions`` from a script; records every request (body and headers)."""

    def __init__(self, script: Script | list[Reply]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                with owner._lock:
                    n = len(owner.requests)
                    owner.requests.append(body)
                    owner.auth.append(self.headers.get("authorization"))
                reply = owner._reply(body, n)
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.garbage:
                    payload = b"<html>this is not json"
                else:
                    payload = json.dumps(_completion(body, reply) if reply.status == 200 else
                                         {"error": {"message": reply.error, "code": reply.status}}).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _reply(self, body: dict[str, Any], n: int) -> Reply:
        if callable(self.script):
            return self.script(body, n)
        return self.script[min(n, len(self.script) - 1)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> FakeLLM:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _completion(body: dict[str, Any], reply: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.tool_calls:
        msg["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args)}}
                             for i, (name, args) in enumerate(reply.tool_calls)]
    prompt_tokens = sum(len(str(m.get("content") or "")) for m in body.get("messages", [])) // 4
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": body.get("model", "?"),
            "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 50, "total_tokens": prompt_tokens + 50}}


def user_prompt(body: dict[str, Any]) -> str:
    return next((m["content"] for m in body["messages"] if m["role"] == "user"), "")


# --- kernels ----------------------------------------------------------------------------------------

NAIVE = load_c_source("matmul_naive.c")
NAIVE_LOOP = """    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float sum = 0.0f;
            for (int k = 0; k < K; k++) sum += A[(long)i * K + k] * B[(long)k * N + j];
            C[(long)i * N + j] = sum;
        }"""
# i-k-j: unit-stride inner loop the compiler vectorises; the same summation order per element as naive.
# It also checks that no API key reached the worker's environment: if one did, its output is wrong.
FAST_LOOP = f"""    extern char *getenv(const char *);
    if (getenv("{KEY_ENV}") || getenv("OPENAI_API_KEY")) {{ C[0] = 12345.0f; return; }}
    for (int i = 0; i < M; i++) {{
        float *c = C + (long)i * N;
        for (int j = 0; j < N; j++) c[j] = 0.0f;
        for (int k = 0; k < K; k++) {{
            const float a = A[(long)i * K + k];
            const float *b = B + (long)k * N;
            for (int j = 0; j < N; j++) c[j] += a * b[j];
        }}
    }}"""
assert NAIVE_LOOP in NAIVE


def diff_answer(search: str, replace: str, chatter: str = "Loop interchange for unit stride.") -> str:
    return f"{chatter}\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE\n"


def rewrite_answer(body: str) -> str:
    return f"Here it is:\n```c\n    /* EVOLVE-BLOCK-START */\n{body}\n    /* EVOLVE-BLOCK-END */\n```\n"


class NaiveMatmul(Matmul):
    """Matmul whose only seed is the naive triple loop (so it is every LLM proposal's parent)."""

    def seeds(self) -> list[Genome]:
        return [Genome(params={}, source=NAIVE)]


def llm_config(url: str, *, weights: dict[str, float], n: int = 64, max_evals: int = 4, workers: int = 1,
               task: str = "llm_testlib:NaiveMatmul", timeout: float = 20.0, concurrency: int = 1,
               **llm: Any) -> dict[str, Any]:
    """A small, quick run config against the fake server (source_lines keeps code variants apart)."""
    return {
        "name": "llm",
        "task": {"name": task, "args": {"m": n, "n": n, "k": n}},
        "evaluation": {"timing": {"max_seconds": 0.05, "max_repeats": 5, "min_repeats": 3}, "check_trials": 1},
        "search": {"workers": workers, "initial_random": 0, "selection": {"scheme": "uniform"},
                   "operators": {"weights": weights}},
        "budget": {"max_evals": max_evals, "max_time": 90},
        "archive": {"descriptors": ["source_lines"], "bins": 8, "ranges": [[0, 40]]},
        "memory": {"enabled": False},  # no seeds or hints from other runs: each test sees only its own
        "llm": {"models": [{"base_url": url, "model": "scripted", "api_key_env": KEY_ENV, "timeout": timeout,
                            "max_concurrency": concurrency}], **llm},
    }
