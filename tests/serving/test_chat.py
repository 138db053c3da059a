"""`evo serve --gguf` end to end on a tiny random Llama (numpy-drawn, no torch): the official openai client, chat and
completions, streamed and whole, against Decoder.generate; continuous batching; cancellation; limits and errors;
the OpenAPI document; metrics; drain."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gguf_models import Shape, train_vocabulary, write_random_gguf
from serve_helpers import KEY, Server, start_server, stop

openai = pytest.importorskip("openai")
pytest.importorskip("gguf")
pytestmark = pytest.mark.xdist_group("chat-tiny")

CONTEXT = 1024
DATA = Path(__file__).resolve().parents[1] / "data"
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "the quick brown fox " * 6}]]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = [s for s in (DATA / "sentences.txt").read_text(encoding="utf-8").splitlines() if s.strip()]
    root = tmp_path_factory.mktemp("chat")
    return write_random_gguf(root / "tiny-chat.gguf", train_vocabulary(lines), shape=Shape(context=CONTEXT))


@pytest.fixture(scope="module")
def decoder(tiny_gguf: Path):
    """The engine the server runs by default, in this process."""
    from runtime.decoder import load_decoder
    from runtime.decoder.engine import ChatEngine, build

    return build(load_decoder(tiny_gguf), ChatEngine())


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[Server]:
    srv = start_server(None, "--gguf", str(tiny_gguf), key=KEY)
    yield srv
    stop(srv)


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _metric(srv: Server, name: str) -> float:
    text = srv.call("GET", "/metrics")[1]
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_openai_client_chat_and_completions_equal_the_decoder(server: Server, decoder) -> None:
    client = _client(server)
    for messages in CHATS:
        want = decoder.generate(messages, max_tokens=12)
        got = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=12, temperature=0)
        assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_tokens, 12)
        assert got.usage.total_tokens == want.prompt_tokens + 12 and got.object == "chat.completion"
        chunks = list(
            client.chat.completions.create(
                model="tiny-chat",
                messages=messages,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert all(c.usage is None for c in chunks[:-1])
    prompt = "The quick brown fox"
    want = decoder.generate(prompt, max_tokens=20)
    got = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20, temperature=0)
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == want.prompt_tokens
    streamed = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20, temperature=0,
                                              stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in streamed)
    # a stop string ends the text before it, in a stream too; seeded sampling repeats itself
    stop_at = want.text[len(want.text) // 2 :][:3]
    cut = decoder.generate(prompt, max_tokens=20, stop=[stop_at])
    for stream in (False, True):
        got = client.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=20, temperature=0, stop=stop_at, stream=stream
        )
        pieces = [c.choices[0] for c in got] if stream else got.choices
        assert "".join(p.text for p in pieces) == cut.text and pieces[-1].finish_reason == "stop"
    settings = dict(max_tokens=16, temperature=0.9, top_p=0.9, seed=5)
    sampled = [
        client.completions.create(model="tiny-chat", prompt=prompt, **settings).choices[0].text for _ in range(2)
    ]
    assert sampled[0] == sampled[1] == decoder.generate(prompt, **settings).text
    assert client.models.list().data[0].id == "tiny-chat"


def test_logprobs_give_each_token_its_id_bytes_and_log_probability(server: Server, decoder) -> None:
    """logprobs (whole and streamed): one entry per generated token, whose ids are Decoder.generate's, whose bytes
    spell the text, greedy's choice first among top_logprobs (likeliest first), each a log-probability; a
    top_logprobs without logprobs is 400."""
    import math

    client = _client(server)
    messages = CHATS[0]
    want = decoder.generate(messages, max_tokens=10)
    got = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=3)  # fmt: skip
    entries = got.choices[0].logprobs.content
    assert [e.model_extra["id"] for e in entries] == want.token_ids
    spelled = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")
    assert spelled == got.choices[0].message.content == want.text
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob == tops[0] <= 0
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-9  # probabilities of distinct tokens
    streamed = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10,
                                                   temperature=0, logprobs=True, stream=True))  # fmt: skip
    ids = [e.model_extra["id"] for c in streamed if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]  # fmt: skip
    assert ids == want.token_ids
    status, body, _ = server.call("POST", CHAT, {"messages": USER, "top_logprobs": 2})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    plain = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


TUNING = {"type": "object", "additionalProperties": False, "required": ["kernel", "unroll", "vectorise"],
          "properties": {"kernel": {"enum": ["naive", "tiled", "packed"]}, "unroll": {"enum": [1, 2, 4, 8]},
                         "vectorise": {"type": "boolean"}}}  # fmt: skip
TUNING_FORMAT = {"type": "json_schema", "json_schema": {"name": "tuning", "schema": TUNING, "strict": True}}


def test_a_json_schema_response_format_holds_a_random_model_to_the_schema(server: Server, decoder) -> None:
    """A random-weight model's answers, held token by token to the schema: JSON with its properties in order,
    ended by the end token, whatever the seed; streamed and whole alike, and as Decoder.generate gives them."""
    from runtime.decoder import SamplingParams
    from runtime.decoder.grammar import json_schema_grammar

    client = _client(server)
    texts = []
    for seed in range(4):
        got = client.chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=96, temperature=1.0,
                                             seed=seed, response_format=TUNING_FORMAT)  # fmt: skip
        answer = json.loads(got.choices[0].message.content)
        assert list(answer) == ["kernel", "unroll", "vectorise"] and got.choices[0].finish_reason == "stop"
        assert answer["kernel"] in ("naive", "tiled", "packed") and answer["unroll"] in (1, 2, 4, 8)
        assert isinstance(answer["vectorise"], bool)
        texts.append(got.choices[0].message.content)
    streamed = client.chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=96, temperature=1.0,
                                              seed=0, response_format=TUNING_FORMAT, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == texts[0]
    grammar = json_schema_grammar(decoder.tokenizer, TUNING)
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=0, grammar=grammar)
    assert decoder.generate(CHATS[0], params).text == texts[0]
    free = client.chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=24, temperature=1.0, seed=0)
    with pytest.raises(ValueError):  # the same model, unheld, writes no such JSON
        json.loads(free.choices[0].message.content)


def test_the_search_clients_parameter_schema_is_enforced_by_the_chat_server(server: Server, monkeypatch) -> None:
    """llm_params' call through evoforge's own client: the matmul space's schema as response_format, answered by a
    random model with a point that names every parameter, in order, each within its domain."""
    from evo.llm.client import LLMClient
    from evo.llm.settings import ModelSettings
    from runtime.tasks.matmul import Matmul

    monkeypatch.setenv("EVO_TEST_CHAT_KEY", KEY)
    space = Matmul({"m": 64, "n": 64, "k": 64}).space()
    client = LLMClient(ModelSettings(base_url=server.url + "/v1", model="tiny-chat", api_key_env="EVO_TEST_CHAT_KEY",
                                     temperature=1.0, max_tokens=400, timeout=60))  # fmt: skip
    for _ in range(2):
        answer = client.chat(CHATS[0], response_format=client.response_format(space.json_schema()))
        values = json.loads(answer.text)
        assert list(values) == list(space.params) and all(space.params[k].contains(v) for k, v in values.items())


TOOLS = [{"type": "function", "function": {"name": "benchmark", "description": "Time a kernel.", "parameters": {
             "type": "object", "properties": {"source": {"type": "string", "maxLength": 40}}, "required": ["source"]}}},
         {"type": "function", "function": {"name": "tile", "parameters": {
             "type": "object", "properties": {"rows": {"enum": [1, 2, 4]}}, "required": ["rows"]}}}]  # fmt: skip


def test_a_required_tool_call_is_one_of_the_offered_functions_with_arguments_of_its_schema(server: Server,
                                                                                           decoder) -> None:
    """tool_choice required: a random-weight model's answer, held token by token, is a call of an offered function
    with arguments of its schema, whole and streamed alike (the official client reads both); a named function is
    the one called. A history with calls and tool results is taken."""
    client = _client(server)
    for seed in range(5):
        got = client.chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=96, temperature=1.0,
                                             seed=seed, tools=TOOLS, tool_choice="required")  # fmt: skip
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.id.startswith("call_") and call.type == "function"
        if call.function.name == "tile":
            assert args["rows"] in (1, 2, 4)
        else:
            assert call.function.name == "benchmark" and isinstance(args["source"], str) and len(args["source"]) <= 40
        if seed == 0:
            first = call
    streamed = list(client.chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=96,
                                                   temperature=1.0, seed=0, tools=TOOLS, tool_choice="required",
                                                   stream=True))  # fmt: skip
    (delta,) = [c.choices[0].delta.tool_calls[0] for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert (delta.function.name, delta.function.arguments) == (first.function.name, first.function.arguments)
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    named = client.chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=96, temperature=1.0,
                                           seed=1, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "tile"}})
    assert named.choices[0].message.tool_calls[0].function.name == "tile"
    history = [*CHATS[0], {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
               {"role": "tool", "tool_call_id": first.id, "content": "42.0 GFLOP/s"}]
    again = client.chat.completions.create(model="tiny-chat", messages=history, max_tokens=96, temperature=1.0, seed=2,
                                           tools=TOOLS, tool_choice="required")  # fmt: skip
    assert again.choices[0].finish_reason == "tool_calls"
    from serving._tools import Tool, tools_prompt

    offer = tools_prompt([Tool.model_validate(t) for t in TOOLS], required=True)
    terse = client.chat.completions.create(model="tiny-chat", messages=CHATS[1], max_tokens=96, temperature=1.0,
                                           seed=3, tools=TOOLS, tool_choice="required")  # fmt: skip
    system, user = CHATS[1]  # the offer joins the request's own system message: templates take one
    merged = [{"role": "system", "content": f"{system['content']}\n\n{offer}"}, user]
    assert terse.usage.prompt_tokens == len(decoder.encode_prompt(merged))
    free = client.chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=24, temperature=1.0, seed=0,
                                          tools=TOOLS)  # fmt: skip
    assert free.choices[0].finish_reason in ("stop", "length") and free.choices[0].message.tool_calls is None


def test_json_mode_answers_an_object(server: Server) -> None:
    got = _client(server).chat.completions.create(model="tiny-chat", messages=CHATS[1], max_tokens=48, temperature=0,
                                                  response_format={"type": "json_object"})  # fmt: skip
    text, finish = got.choices[0].message.content, got.choices[0].finish_reason
    assert text.startswith("{") and finish in ("stop", "length")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)


def test_sixteen_concurrent_streams_each_get_their_tokens_alone(server: Server, decoder) -> None:
    """16 greedy streams of different prompt lengths and lengths, started together: each one's text is the one
    Decoder.generate gives it alone, and the engine ran them in batches."""
    prompts = [[{"role": "user", "content": "tell me about the fox " * (1 + i % 7) + str(i)}] for i in range(16)]
    lengths = [8 + 2 * i for i in range(16)]
    alone = [decoder.generate(p, max_tokens=n).text for p, n in zip(prompts, lengths, strict=True)]
    client, start = _client(server), threading.Barrier(16)
    steps = _metric(server, "evoforge_chat_step_requests_count")

    def stream(i: int) -> str:
        start.wait()
        chunks = client.chat.completions.create(
            model="tiny-chat", messages=prompts[i], max_tokens=lengths[i], temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(stream, range(16)))
    assert together == alone
    ran = _metric(server, "evoforge_chat_step_requests_count") - steps
    assert ran < sum(lengths) / 2, ran  # one at a time would take a step per token: the streams shared steps
    assert _metric(server, 'evoforge_chat_step_requests_bucket{le="4.0"}') < _metric(
        server, "evoforge_chat_step_requests_count"
    )  # some step ran more than 4


def test_a_client_that_disconnects_mid_stream_frees_its_cache(server: Server) -> None:
    client = _client(server)
    out_before = _metric(server, "evoforge_chat_output_tokens_total")
    stream = client.completions.create(
        model="tiny-chat", prompt="a long story", max_tokens=CONTEXT - 16, temperature=0, stream=True
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert _metric(server, "evoforge_chat_kv_cache_bytes") > 0  # held while it streams
    stream.close()
    deadline = time.time() + 10
    while _metric(server, "evoforge_chat_kv_cache_bytes") > 0 and time.time() < deadline:
        time.sleep(0.02)
    assert _metric(server, "evoforge_chat_kv_cache_bytes") == 0
    assert _metric(server, "evoforge_chat_running_requests") == 0
    generated = _metric(server, "evoforge_chat_output_tokens_total") - out_before
    assert generated < CONTEXT - 16, generated  # it stopped: the cache was freed by the cancel, not the end


def test_a_prompt_past_the_context_is_400_naming_the_limit(server: Server) -> None:
    long = "the quick brown fox " * CONTEXT
    for path, body in (("/v1/completions", {"prompt": long}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})):  # fmt: skip
        status, got, _ = server.call("POST", path, body)
        assert status == 400 and got["error"]["code"] == "context_length_exceeded", got
        assert f"context of {CONTEXT}" in got["error"]["message"]
        assert got["error"]["param"] == ("prompt" if "prompt" in body else "messages")


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BAD = [
    ("n of 2", CHAT, {"messages": USER, "n": 2}, "n"),
    ("temperature over 2", CHAT, {"messages": USER, "temperature": 2.5}, "temperature"),
    ("top_p of 0", CHAT, {"messages": USER, "top_p": 0}, "top_p"),
    ("max_tokens of 0", CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("negative seed", CHAT, {"messages": USER, "seed": -1}, "seed"),
    ("five stop strings", CHAT, {"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("empty stop string", CHAT, {"messages": USER, "stop": ""}, "stop"),
    ("no messages", CHAT, {"messages": []}, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("unknown key", CHAT, {"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty"),
    ("stream_options without stream", CHAT, {"messages": USER, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("json_schema without its schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format.json_schema.json_schema"),
    ("unknown response_format", CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, "response_format"),
    ("a schema that cannot be enforced", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
    ("ignore_eos with a response_format", CHAT,
     {"messages": USER, "ignore_eos": True, "response_format": {"type": "json_object"}}, "response_format"),
    ("tool_choice without tools", CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("tool_choice naming no offered function", CHAT,
     {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ("two functions of one name", CHAT, {"messages": USER, "tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ("an empty tools list", CHAT, {"messages": USER, "tools": []}, "tools"),
    ("tools whose call schema is over 16 KB", CHAT,
     {"messages": USER, "tool_choice": "required", "tools": [
         {"type": "function", "function": {"name": f"f{i}", "parameters": {
             "type": "object", "properties": {"x": {"enum": [f"value {j}" for j in range(40)]}}}}}
         for i in range(40)]}, "tools"),
    ("a function whose arguments are no object", CHAT,
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function"),
    ("a required call and a response_format", CHAT,
     {"messages": USER, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("a tool with an unenforceable schema", CHAT,
     {"messages": USER, "tool_choice": "required", "tools": [
         {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}]}, "tools"),
    ("tool_calls on a user turn", CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages.0"),
    ("token-id prompt", "/v1/completions", {"prompt": [1, 2, 3]}, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "path", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_parameters_are_400_in_the_error_body(server: Server, what, path, body, param) -> None:
    status, got, _ = server.call("POST", path, body)
    assert status == 400, got
    assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["message"]
    assert got["error"]["param"] == param, got


def test_malformed_bodies_unknown_models_and_keys(server: Server) -> None:
    status, got, _ = server.call("POST", CHAT, raw=b'{"messages": [')
    assert status == 400 and got["error"]["code"] == "invalid_json"
    status, got, _ = server.call("POST", CHAT, {"messages": USER, "model": "gpt-9"})
    assert status == 404 and got["error"]["code"] == "model_not_found"
    assert server.call("POST", CHAT, {"messages": USER}, key=False)[0] == 401
    assert server.call("POST", "/v1/completions", {"prompt": "hi"}, key="wrong")[0] == 401
    assert server.call("GET", "/v1/models", key=False)[0] == 401
    for path in ("/health", "/ready", "/metrics"):
        assert server.call("GET", path, key=False)[0] == 200
    engine = server.call("GET", "/ready", key=False)[1]["engine"]
    from runtime.decoder.engine import default_linear

    assert engine == {"linear": default_linear(), "slots": "c", "kv_dtype": "fp32", "head": "full", "step_tokens": 64,
                      "max_running": 64, "threads": None, "kernels": {}}  # the defaults
    status, got, _ = server.call("POST", CHAT, {"messages": USER, "max_tokens": 2, "model": "tiny-chat.gguf"})
    assert status == 200 and got["model"] == "tiny-chat.gguf"  # an alias


def test_the_document_lists_every_status_of_the_chat_routes(server: Server) -> None:
    doc = server.call("GET", "/openapi.json")[1]
    ops = {(m.upper(), p): op for p, methods in doc["paths"].items() for m, op in methods.items()}
    for route in ("/v1/chat/completions", "/v1/completions"):
        op = ops[("POST", route)]
        assert set(op["responses"]) == {"200", "400", "401", "404", "413", "429", "503"}, route
        assert {"application/json", "text/event-stream"} <= set(op["responses"]["200"]["content"])
        assert op["security"] == [{"bearer": []}]
        for code in set(op["responses"]) - {"200"}:
            ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
    assert set(ops[("GET", "/v1/models")]["responses"]) == {"200", "401"}
    assert "HTTPValidationError" not in str(doc)
    model = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["anyOf"]
    assert next(a for a in model if a.get("type") == "string")["enum"] == ["tiny-chat", "tiny-chat.gguf"]
    assert "context" in doc["info"]["description"] and "429" in doc["info"]["description"]


def test_metrics_of_the_chat_engine(server: Server) -> None:
    _client(server).completions.create(model="tiny-chat", prompt="hello", max_tokens=5, temperature=0)
    for name in ("evoforge_chat_time_to_first_token_seconds_count", "evoforge_chat_inter_token_seconds_count",
                 "evoforge_chat_output_tokens_total", "evoforge_chat_prompt_tokens_total",
                 "evoforge_chat_output_tokens_per_second"):  # fmt: skip
        assert _metric(server, name) > 0, name
    assert _metric(server, "evoforge_chat_kv_cache_budget_bytes") == 2048 * 2**20
    text = server.call("GET", "/metrics")[1]
    for name in ("evoforge_chat_kv_cache_bytes", "evoforge_chat_kv_cache_usage_ratio",
                 "evoforge_chat_running_requests", "evoforge_chat_waiting_requests"):  # fmt: skip
        assert re.search(rf"^{name} ", text, re.M), name


def test_a_full_kv_budget_and_queue_get_429_then_sigterm_drains(tiny_gguf: Path) -> None:
    """A budget for one request at a time and one waiting place: of 6 long requests sent together, one runs, one
    waits, the others are refused 429; all that were taken finish. Then SIGTERM lets a stream finish, exit 0."""
    srv = start_server(None, "--gguf", str(tiny_gguf), "--kv-cache-mb", "0.75", "--max-waiting", "1")
    try:
        start = threading.Barrier(6)

        def one(_: int) -> tuple[int, dict]:
            start.wait()
            status, body, _ = srv.call("POST", "/v1/completions", {"prompt": "go", "max_tokens": CONTEXT - 8,
                                                                    "temperature": 0})  # fmt: skip
            return status, body

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(one, range(6)))
        statuses = sorted(s for s, _ in got)
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1 and set(statuses) == {200, 429}, statuses
        for status, body in got:
            if status == 429:
                assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
            else:
                assert body["usage"]["completion_tokens"] == CONTEXT - 8
        assert _metric(srv, 'evoforge_rejected_total{reason="queue_full"}') == statuses.count(429)
        status, body, _ = srv.call("POST", "/v1/completions", {"prompt": "go", "max_tokens": 2 * CONTEXT,
                                                               "temperature": 0})  # fmt: skip
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"  # the context ends it

        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(srv.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "go", "max_tokens": 300, "stream": True,
                                                                "ignore_eos": True}),
                     {"content-type": "application/json"})  # fmt: skip
        reply = conn.getresponse()
        first = reply.readline()
        srv.proc.send_signal(signal.SIGTERM)  # in the middle of the stream
        rest = reply.read().decode()
        assert first.startswith(b"data: ") and rest.rstrip().endswith("data: [DONE]")
        assert srv.proc.wait(timeout=60) == 0
        last = json.loads(rest.rstrip().split("\n\n")[-2][len("data: ") :])
        assert last["choices"][0]["finish_reason"] == "length"
    finally:
        stop(srv)


def test_linear_int8_serves_the_int8_engine_and_ignore_eos_fills_max_tokens(tiny_gguf: Path, decoder) -> None:
    """--linear int8 --kv-dtype f16 serves what the int8 kernels decode in process over an f16 cache (the same
    kernels, one thread; the decode steps' attention and RMSNorm in C), and /ready names them; ignore_eos makes an
    answer run to max_tokens."""
    srv = start_server(None, "--gguf", str(tiny_gguf), "--linear", "int8", "--threads", "1", "--slots", "c",
                       "--kv-dtype", "f16", "--max-running", "8")  # fmt: skip
    try:
        engine = srv.call("GET", "/ready")[1]["engine"]
        assert engine == {"linear": "int8", "slots": "c", "kv_dtype": "f16", "head": "full", "step_tokens": 64,
                          "max_running": 8, "threads": 1, "kernels": {}}  # fmt: skip
        int8 = _in_process(decoder.model, engine)
        client = _client(srv)
        for messages in CHATS:
            got = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=24, temperature=0)
            want = int8.generate(messages, max_tokens=24)
            assert got.choices[0].message.content == want.text
        got = client.completions.create(model="tiny-chat", prompt="go", max_tokens=CONTEXT - 8, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert got.usage.completion_tokens == CONTEXT - 8 and got.choices[0].finish_reason == "length"
        status, body, _ = srv.call("POST", "/v1/completions", {"prompt": "go", "ignore_eos": 1})
        assert status == 400 and body["error"]["param"] == "ignore_eos"
    finally:
        stop(srv)


def _in_process(model, engine: dict):
    from runtime.decoder.engine import ChatEngine, build

    return build(model, ChatEngine(**engine))


def test_an_engine_swap_under_streaming_load_fails_no_stream(tmp_path: Path) -> None:
    """POST /admin/engine while long streams run and closed-loop clients keep streaming: every stream ends with
    [DONE] and its whole text; the long ones, still running when the swap returned, finished on the old engine
    (numpy's greedy text); requests after it get the new engine's (int8 kernels, f16 cache). The swap is
    refused without the key, or for a precision that does not exist, and the old engine keeps serving."""
    from runtime.decoder import Decoder, SamplingParams

    lines = [s for s in (DATA / "sentences.txt").read_text(encoding="utf-8").splitlines() if s.strip()]
    # wide enough that a long stream outlasts the swap (a step takes milliseconds)
    shape = Shape(hidden=128, intermediate=512, layers=4, heads=4, kv_heads=2, context=1024)
    path = write_random_gguf(tmp_path / "swap-chat.gguf", train_vocabulary(lines), shape=shape)
    decoder = Decoder.load(path)
    # Steps wide enough that no short prompt is split across steps: a prompt's numbers still depend on how it is
    # chunked (the prefill attention's BLAS), and this test is about the swap.
    new = {"linear": "int8", "slots": "c", "kv_dtype": "f16", "threads": 1, "step_tokens": 512}
    int8 = _in_process(decoder.model, new)  # its kernels compile here, to the cache the server's swap reads
    srv = start_server(None, "--gguf", str(path), "--threads", "1", key=KEY)
    client = _client(srv)
    longs = [f"a long story number {i}" for i in range(4)]
    shorts = [[{"role": "user", "content": f"tell me about the fox {i}"}] for i in range(3)]
    long_tokens = 400
    stop_load, errors = threading.Event(), []
    done_long: dict[int, tuple[str, float]] = {}
    done_short: list[tuple[int, float, str]] = []

    def long_stream(i: int, first: threading.Event) -> None:
        try:
            parts = []
            for c in client.completions.create(model="swap-chat", prompt=longs[i], max_tokens=long_tokens,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
                parts.append(c.choices[0].text)
                first.set()
            done_long[i] = "".join(parts), time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            errors.append(f"long {i}: {exc!r}")
            first.set()

    def closed_loop(i: int) -> None:
        while not stop_load.is_set():
            try:
                t0 = time.perf_counter()
                chunks = list(client.chat.completions.create(model="swap-chat", messages=shorts[i], max_tokens=16,
                                                             temperature=0, stream=True))  # fmt: skip
                assert chunks[-1].choices[0].finish_reason in ("length", "stop")
                done_short.append((i, t0, "".join(c.choices[0].delta.content or "" for c in chunks)))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"short {i}: {exc!r}")

    try:
        assert srv.call("POST", "/admin/engine", new, key=False)[0] == 401
        for bad, field in (({"linear": "int4"}, "linear"), ({"threads": 4096}, "threads"), ({"slots": "gpu"}, "slots"),
                           ({"kernels": {"attention": "7f72cca0"}}, "kernels"),
                           ({"kernels": {"gelu": "1"}}, "kernels")):
            status, body, _ = srv.call("POST", "/admin/engine", bad)
            assert status == 400 and body["error"]["param"] == field, body
        firsts = [threading.Event() for _ in longs]
        threads = [threading.Thread(target=long_stream, args=(i, firsts[i])) for i in range(len(longs))]
        threads += [threading.Thread(target=closed_loop, args=(i,)) for i in range(len(shorts))]
        for t in threads:
            t.start()
        for f in firsts:
            assert f.wait(60)
        status, body, _ = srv.call("POST", "/admin/engine", new)
        swapped = time.perf_counter()
        assert status == 200 and body["engine"]["linear"] == "int8", body
        assert srv.call("GET", "/ready")[1]["engine"]["kv_dtype"] == "f16"
        unfinished = len(longs) - len(done_long)
        time.sleep(0.5)
        stop_load.set()
        for t in threads:
            t.join(120)
    finally:
        stop_load.set()
        stop(srv)
    assert not errors, errors
    assert unfinished > 0, "every long stream ended before the swap did: the test proved nothing"
    greedy = SamplingParams(max_tokens=long_tokens, temperature=0.0, ignore_eos=True)
    on_old = [c.text for c in decoder.generate_batch(longs, greedy)]
    assert [done_long[i][0] for i in range(len(longs))] == on_old
    assert [c.text for c in int8.generate_batch(longs, greedy)] != on_old  # the engines are told apart by text
    want_new = [int8.generate(m, max_tokens=16).text for m in shorts]
    after = [(i, text) for i, t0, text in done_short if t0 > swapped]
    assert after and all(text == want_new[i] for i, text in after), after


def test_a_chat_engine_runs_winner_is_served_from_the_run(tiny_gguf: Path, tmp_path: Path) -> None:
    """`evo serve RUN_DIR` of a chat_engine run serves the run's model on its best engine (as /ready names it)."""
    import subprocess
    import sys

    import yaml

    config = {"task": {"name": "chat_engine", "args": {
                  "model": str(tiny_gguf), "threads": 1, "streams": 2, "requests": 1, "prompt_tokens": [8, 24],
                  "max_tokens": 8, "check_texts": 1, "verified": 1}},
              "search": {"workers": 1, "initial_random": 1, "confirm": {"repeats": 0}}, "budget": {"max_evals": 1},
              "archive": {"descriptors": ["itl_p99_ms"], "bins": [2], "ranges": [[0, 1000]]},
              "memory": {"enabled": False}}  # fmt: skip
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "evo", "run", str(path), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    best = subprocess.run([sys.executable, "-m", "evo", "archive", "best", str(tmp_path / "run"), "--json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    params = json.loads(best.stdout)[0]["params"]
    srv = start_server(tmp_path / "run")
    try:
        assert srv.call("GET", "/ready")[1]["engine"] == {**params, "kernels": {}}
        got = _client(srv).chat.completions.create(model="tiny-chat", messages=CHATS[0], max_tokens=4)
        assert got.usage.completion_tokens == 4
    finally:
        stop(srv)


def test_engine_options_are_refused_where_they_do_not_apply(tiny_gguf: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    def evo(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "evo", "serve", *args], capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    gguf = ("--gguf", str(tiny_gguf))
    refused = [
        ((*gguf, "--elite", "best"), "--elite does not apply to a chat model"),
        ((str(tmp_path), "--linear", "int8"), "--linear applies to --gguf only"),
        ((*gguf, "--linear", "int4"), "no precision 'int4'"),
        ((*gguf, "--linear", "int8:head=fp32"), "'head=fp32' in 'int8:head=fp32'"),
        ((str(tmp_path), "--slots", "numpy"), "--slots applies to --gguf only"),
        ((str(tmp_path), "--kv-dtype", "f16"), "--kv-dtype applies to --gguf only"),
        ((*gguf, "--threads", "0"), "0 is not in the range"),
        ((*gguf, "--threads", "4096"), "--threads 4096: Input should be less than or equal to 1024"),
        ((*gguf, "--threads", "512"), "--threads 512: this process has"),
    ]
    for args, says in refused:
        done = evo(*args)
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


def test_a_gemma3_file_is_served_as_the_decoder_runs_it(tmp_path: Path) -> None:
    """A tiny Gemma 3 (SentencePiece tokenizer, no chat template in the file, sliding windows of 16 positions):
    streamed chat and completions past its window are what the decoder generates in process on the same slots
    (the decode steps' attention and RMSNorm in C, one thread)."""
    pytest.importorskip("transformers")
    from gguf_models import make_hf_model, train_spm_vocabulary, write_gguf

    from runtime.decoder import Decoder, DecoderOps
    from runtime.decoder.kernels import c_attention, c_rmsnorm

    lines = [s for s in (DATA / "sentences.txt").read_text(encoding="utf-8").splitlines() if s.strip()]
    vocab = train_spm_vocabulary(lines)
    path = write_gguf(tmp_path / "tiny-gemma.gguf", make_hf_model("gemma3", len(vocab.tokens), tied=True), vocab,
                      arch="gemma3", add_bos=True)  # fmt: skip
    decoder = Decoder.load(path, ops=DecoderOps(attention=c_attention(), rmsnorm=c_rmsnorm()))
    srv = start_server(None, "--gguf", str(path), "--threads", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for messages in CHATS:
            want = decoder.generate(messages, max_tokens=40)
            chunks = client.chat.completions.create(model="tiny-gemma", messages=messages, max_tokens=40,
                                                    temperature=0, stream=True)  # fmt: skip
            pieces = [c.choices[0] for c in chunks if c.choices]
            assert "".join(p.delta.content or "" for p in pieces) == want.text
            assert pieces[-1].finish_reason == want.finish_reason
        want = decoder.generate("The quick brown fox", max_tokens=40)
        got = client.completions.create(model="tiny-gemma", prompt="The quick brown fox", max_tokens=40, temperature=0)
        assert got.choices[0].text == want.text and got.usage.prompt_tokens == want.prompt_tokens
    finally:
        stop(srv)
