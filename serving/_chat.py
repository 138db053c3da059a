"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI-compatible), streamed as server-sent events
or whole, and ``GET /v1/models``, over the decoder's continuous-batching scheduler.

A request is checked, tokenised (chat messages through the model's chat template) and submitted; its
tokens come back through the scheduler's channel. A streamed request's client that goes away cancels its
generation (its KV cache is freed); so does the client of a whole one that hangs up before the answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.decoder import ChatTemplateError, ContextFull, DoesNotFit, QueueFull, SamplingParams, SchedulerClosed
from runtime.decoder.grammar import Grammar, GrammarError, json_schema_grammar
from serving._errors import APIError, errors
from serving._http import hung_up
from serving._tools import NamedToolChoice, Tool, ToolCall, ToolChoice, call_text, calls_schema, read_call, tools_prompt

if TYPE_CHECKING:
    from runtime.decoder import Chunk, Generation, Prompt, Tokenizer
    from serving._chat_app import ChatState
    from serving._metrics import ChatMetrics

__all__ = ["ChatCompletionRequest", "CompletionRequest", "router"]

router = APIRouter(tags=["chat"])
_STATUSES = (400, 401, 404, 413, 429, 503)
# each server-sent event (OpenAPI 3.1: the schema of one event, as schemathesis and the SSE registry read it)
_EVENT = {"type": "object", "required": ["data"],
          "properties": {"data": {"type": "string", "description": "a chunk as JSON, then [DONE]"},
                         "event": {"type": "string"}}}  # fmt: skip
_STREAMED = {"text/event-stream": {"schema": _EVENT,
                                   "example": 'data: {"choices": [...]}\n\ndata: [DONE]\n\n'}}  # fmt: skip


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # JSON types as stated (`stream: 0` is no boolean)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="text, or text parts (joined); only an assistant "
                                                 "turn with tool_calls may leave it out")  # fmt: skip
    name: str | None = Field(None, description="accepted and not shown to the model")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's calls (shown to the model as "
                                              "it writes them)")  # fmt: skip
    tool_call_id: str | None = Field(None, description="a tool turn's: the call it answers")

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"a {self.role} message with tool_calls: only an assistant turn makes calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message without content: give its text")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def turn(self) -> dict[str, str]:
        """The message as the chat template takes it: calls as the JSON the model writes, a tool's result as a user
        turn."""
        if self.role == "tool":
            return {"role": "user", "content": f"Tool result: {self.text()}"}
        calls = [call_text(c) for c in self.tool_calls or ()]
        return {"role": self.role, "content": "\n".join(filter(None, [self.text(), *calls]))}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="a last chunk (no choices) carries the usage")


class _GenerationRequest(BaseModel):
    """What both routes take: OpenAI's sampling fields this server honours (others are refused, 400)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model's id (GET /v1/models); default: it")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: the context's "
                                   "rest); the prompt and the completion share the model's context")  # fmt: skip
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, description="the same seed and request give the same tokens")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the text ends before the first")
    n: int = Field(1, description="choices per request: 1 only (400 otherwise)")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    user: str | None = None
    ignore_eos: bool = Field(False, description="an extension (as llama.cpp's and vLLM's servers take it): never "
                             "end at the model's end token, only at max_tokens or a stop string")  # fmt: skip


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="rendered by the model's chat template")
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name")
    logprobs: bool = Field(False, description="each answer token's log-probability (under the model's distribution), "
                           "its bytes and, as llama.cpp's server gives it, its id")  # fmt: skip
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the likeliest tokens at each "
                                     "position too")  # fmt: skip
    response_format: ResponseFormat | None = Field(None, description="structured output, enforced token by token: "
                                                   "the answer is JSON of the format, ended by the model's end token "
                                                   "(or cut at max_tokens)")  # fmt: skip
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128, description="functions the model may "
                                     "call (described to it in a system message)")  # fmt: skip
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools: a call where the "
                                           "answer is one), required (a call of one of them, enforced token by "
                                           "token), or a function named (a call of it, enforced)")  # fmt: skip
    parallel_tool_calls: bool | None = Field(None, description="accepted: an answer makes one call at most")


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the format's name")
    description: str | None = Field(None, description="accepted and not shown to the model")
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the answer follows (its properties "
                                    "in the order given)")  # fmt: skip
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_object"] = Field(description="a JSON object whose values are strings, numbers, booleans, "
                                         "null or arrays of them (a json_schema states deeper objects)")  # fmt: skip


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class CompletionRequest(_GenerationRequest):
    prompt: str = Field(min_length=1, description="one text prompt")
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate at most (OpenAI's default: 16)")


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


@dataclass
class _Reply:
    """One request's answer in OpenAI's shapes: whole, or chunk by chunk (``tokenizer``: where log-probabilities
    were asked for, what spells their tokens)."""

    chat: bool
    model: str
    prompt_tokens: int
    include_usage: bool = False
    tokenizer: Tokenizer | None = None
    tools: list[Tool] | None = None  # offered: an answer that is a call of one of them is sent as the call

    def logprob(self, chunk: Chunk) -> dict[str, Any]:
        """``chunk``'s token in OpenAI's ``logprobs.content`` shape."""
        assert chunk.logprob is not None and self.tokenizer is not None
        logprob, best = chunk.logprob
        return {**self._token(chunk.token), "logprob": logprob,
                "top_logprobs": [{**self._token(i), "logprob": lp} for i, lp in best]}  # fmt: skip

    def _token(self, token_id: int) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(token_id)  # type: ignore[union-attr]
        return {"id": token_id, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}

    def _logprobs(self, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        return {"content": entries or []} if self.tokenizer is not None else None

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}  # fmt: skip

    def call(self, text: str, finish: str) -> ToolCall | None:
        """The tool call a whole answer is, where tools were offered and it ended as one."""
        return read_call(text, self.tools) if self.tools and finish == "stop" else None

    def whole(self, text: str, finish: str, completion_tokens: int,
              logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
        if self.chat:
            call = self.call(text, finish)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if call is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
                finish = "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice], "usage": self.usage(completion_tokens)}

    def chunk(self, text: str = "", finish: str | None = None, *, role: bool = False,
              logprobs: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None if role else self._logprobs(logprobs),
                      "finish_reason": finish}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)

    def call_chunk(self, call: ToolCall) -> str:
        """The streamed chunk of a whole call (its arguments in one piece), finishing the answer."""
        delta = {"tool_calls": [{"index": 0, **call.model_dump()}]}
        body = {**self._head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": "tool_calls"}]}
        if self.include_usage:
            body["usage"] = None
        return _sse(body)

    def usage_chunk(self, completion_tokens: int) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse({**self._head(kind), "choices": [], "usage": self.usage(completion_tokens)})


class _Clock:
    """Observes a request's time to first token and its inter-token latencies, from the engine's stamps."""

    def __init__(self, metrics: ChatMetrics, arrived: float) -> None:
        self.metrics, self.last, self.first = metrics, arrived, True

    def tick(self, chunk: Chunk) -> None:
        (self.metrics.ttft if self.first else self.metrics.inter_token).observe(max(0.0, chunk.t - self.last))
        self.metrics.output_tokens.inc()
        self.first, self.last = False, chunk.t


async def _events(gen: Generation, reply: _Reply, clock: _Clock) -> AsyncIterator[str]:
    tokens = 0
    try:
        if reply.chat:
            yield reply.chunk(role=True)
        pending: list[dict[str, Any]] = []  # log-probabilities of tokens whose text is not settled yet
        try:
            if reply.tools:  # a call is known only once the answer is whole: it comes in one chunk
                text, finish, tokens, logprobs = await _collect(gen, reply, clock)
                call = reply.call(text, finish)
                if call is not None:
                    yield reply.call_chunk(call)
                else:
                    yield reply.chunk(text, logprobs=logprobs)
                    yield reply.chunk(finish=finish)
            else:
                async for chunk in gen:
                    clock.tick(chunk)
                    tokens = chunk.tokens
                    if chunk.logprob is not None:
                        pending.append(reply.logprob(chunk))
                    if chunk.text:
                        yield reply.chunk(chunk.text, logprobs=pending)
                        pending = []
                    if chunk.finish_reason is not None:
                        yield reply.chunk(finish=chunk.finish_reason, logprobs=pending)
        except RuntimeError as exc:  # the engine failed this generation: the status is sent already
            yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            return
        if reply.include_usage:
            yield reply.usage_chunk(tokens)
        yield "data: [DONE]\n\n"
    finally:
        gen.cancel()  # a client gone mid-stream: its cache is freed (nothing to do once it has finished)


async def _collect(gen: Generation, reply: _Reply, clock: _Clock) -> tuple[str, str, int, list[dict[str, Any]]]:
    parts, finish, tokens, logprobs = [], "length", 0, []
    async for chunk in gen:
        clock.tick(chunk)
        parts.append(chunk.text)
        finish, tokens = chunk.finish_reason or finish, chunk.tokens
        if chunk.logprob is not None:
            logprobs.append(reply.logprob(chunk))
    return "".join(parts), finish, tokens, logprobs


async def _whole(request: Request, gen: Generation, reply: _Reply, clock: _Clock) -> Response:
    gone = asyncio.create_task(hung_up(request))
    work = asyncio.create_task(_collect(gen, reply, clock))
    try:
        await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # nobody waits for the answer: stop generating it
            work.cancel()
            return Response(status_code=499)
        try:
            text, finish, tokens, logprobs = work.result()
        except RuntimeError as exc:
            raise APIError(500, str(exc), type="server_error") from None
        return JSONResponse(reply.whole(text, finish, tokens, logprobs))
    finally:
        gone.cancel()
        gen.cancel()


def _submit(state: ChatState, ids: list[int], params: SamplingParams) -> Generation:
    """Submits to the engine serving now: one swapped out between reading it and submitting (it refuses, as it is
    closing) is passed over for the one that replaced it."""
    while True:
        scheduler = state.scheduler
        try:
            return scheduler.submit(ids, params)
        except SchedulerClosed:
            if state.scheduler is scheduler:  # the server itself is shutting down
                raise


async def _generate(request: Request, body: _GenerationRequest, prompt: Prompt, max_tokens: int | None, *,
                    chat: bool, logprobs: int | None = None, grammar: Grammar | None = None,
                    tools: list[Tool] | None = None) -> Response:  # fmt: skip
    state: ChatState = request.app.state.serving
    arrived = time.perf_counter()
    where = "messages" if chat else "prompt"
    if body.model is not None and body.model not in state.model_ids:
        raise APIError(404, f"model {body.model!r} is not served (GET /v1/models)", param="model",
                       code="model_not_found")  # fmt: skip
    if body.n != 1:
        raise APIError(400, f"n is {body.n}: this server generates one choice per request (n=1)", param="n")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stop) > 4 or not all(stop):
        raise APIError(400, f"stop has {len(stop)} strings{', one empty' if not all(stop) else ''}: give up to 4, "
                       "each at least one character", param="stop")  # fmt: skip
    decoder = state.scheduler.decoder
    try:
        ids = await asyncio.to_thread(decoder.encode_prompt, prompt)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=where) from None
    context = decoder.model.config.context
    try:
        params = SamplingParams(max_tokens=max_tokens or max(1, context - len(ids)), temperature=body.temperature,
                                top_p=body.top_p, seed=body.seed, stop=tuple(stop),
                                ignore_eos=body.ignore_eos, logprobs=logprobs, grammar=grammar)  # fmt: skip
        gen = _submit(state, ids, params)
    except ContextFull as exc:
        raise APIError(400, f"{exc}: shorten the prompt", param=where, code="context_length_exceeded") from None
    except DoesNotFit as exc:
        raise APIError(400, str(exc), param="max_tokens", code="kv_cache_budget_exceeded") from None
    except QueueFull as exc:
        state.metrics.rejected.labels("queue_full").inc()
        raise APIError(429, str(exc), code="queue_full") from None
    except SchedulerClosed as exc:
        raise APIError(503, str(exc), code="shutting_down") from None
    except ValueError as exc:
        raise APIError(400, str(exc), param=where) from None
    state.metrics.prompt_tokens.inc(len(ids))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    reply = _Reply(chat, body.model or state.model_ids[0], len(ids), include_usage,
                   decoder.tokenizer if logprobs is not None else None, tools)  # fmt: skip
    clock = _Clock(state.metrics, arrived)
    if body.stream:
        return StreamingResponse(_events(gen, reply, clock), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})  # fmt: skip
    return await _whole(request, gen, reply, clock)


@router.post("/v1/chat/completions", responses={200: {"content": _STREAMED}, **errors(*_STATUSES)})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """The assistant's reply to ``messages``: whole, or with ``stream: true`` as server-sent events (chunks, then
    ``data: [DONE]``)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    tools, required = _offered(body)
    messages = [m.turn() for m in body.messages]
    if tools:  # in the system message (templates take one, first), or as one
        offer = tools_prompt(tools, required=required)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{offer}"}
        else:
            messages.insert(0, {"role": "system", "content": offer})
    structured = not isinstance(body.response_format, TextFormat | None)
    if body.ignore_eos and (structured or required):
        raise APIError(400, "ignore_eos with a structured response_format or a required tool call: a structured "
                       "answer ends at the model's end token", param="response_format" if structured else "tool_choice")
    state = request.app.state.serving
    if required:
        if structured:
            raise APIError(400, "a required tool call and a response_format: an answer is one or the other",
                           param="tool_choice")  # fmt: skip
        grammar = await _grammar(state, calls_schema(tools), "tools")
    else:
        fmt = body.response_format
        schema = fmt.json_schema.schema_ if isinstance(fmt, JsonSchemaFormat) else None
        grammar = await _grammar(state, schema, "response_format") if structured else None
    return await _generate(request, body, messages, body.max_completion_tokens or body.max_tokens, chat=True,
                           logprobs=(body.top_logprobs or 0) if body.logprobs else None, grammar=grammar,
                           tools=tools)  # fmt: skip


def _offered(body: ChatCompletionRequest) -> tuple[list[Tool], bool]:
    """The tools the model may call (none under ``tool_choice: none``), and whether it must call one."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice without tools: offer the functions in tools", param="tool_choice")
        return [], False
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two functions share a name", param="tools")
    if choice == "none":
        return [], False
    if isinstance(choice, NamedToolChoice):
        named = [t for t in body.tools if t.function.name == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which tools does not offer",
                           param="tool_choice")  # fmt: skip
        return named, True
    return list(body.tools), choice == "required"


_COMPILE_WAIT_S = 60.0
"""How long a request waits for its schema to compile (one at a time, server-wide) before it gets 503."""
_COMPILER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evoforge-grammar")


async def _grammar(state: ChatState, schema: dict[str, Any] | None, param: str) -> Grammar:
    """The compiled grammar of JSON of ``schema`` (None: any JSON object), for the request's field ``param``.
    Schemas compile one at a time, so requests with new schemas cannot take every core from generation."""
    work = asyncio.get_running_loop().run_in_executor(
        _COMPILER, json_schema_grammar, state.scheduler.decoder.tokenizer, schema)
    try:
        return await asyncio.wait_for(asyncio.shield(work), _COMPILE_WAIT_S)
    except GrammarError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    except TimeoutError:
        raise APIError(503, f"{param}: the schema did not compile within {_COMPILE_WAIT_S:g} s (it goes on "
                       "compiling; the same schema is ready later)", code="schema_compiling") from None


@router.post("/v1/completions", responses={200: {"content": _STREAMED}, **errors(*_STATUSES)})
async def completions(body: CompletionRequest, request: Request) -> Response:
    """The continuation of ``prompt`` (tokenised as it is): whole, or with ``stream: true`` as server-sent
    events."""
    return await _generate(request, body, body.prompt, body.max_tokens, chat=False)


@router.get("/v1/models", responses=errors(401))
async def models(request: Request) -> dict[str, Any]:
    """The served model (aliases accepted as ``model`` are listed in ``aliases``)."""
    state: ChatState = request.app.state.serving
    cfg = state.scheduler.decoder.model.config
    model = {
        "id": state.model_ids[0],
        "object": "model",
        "created": int(state.started),
        "owned_by": "evoforge",
        "aliases": list(state.model_ids[1:]),
        "context_length": cfg.context,
        "architecture": cfg.architecture,
    }
    return {"object": "list", "data": [model]}
