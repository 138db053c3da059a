"""Tool calls on the chat route (OpenAI's ``tools`` and ``tool_choice``), for any chat model, small ones included.

The tools a request offers are described to the model in a system message: what each does, the JSON schema of its
arguments, and that a call is one JSON object ``{"name": ..., "arguments": {...}}``. Where the request requires a
call (``tool_choice: "required"``, or a function named), that object is enforced token by token, as a
``response_format`` is: the answer can only be a call of an offered function with arguments of its schema. Under
``"auto"`` (the default when tools are given) the answer is free, and read as a call where it is one such object.
Earlier calls in the history are shown to the model as the objects it wrote, and tool results as user turns (every
chat template takes those roles).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["FunctionCall", "NamedToolChoice", "Tool", "ToolCall", "ToolChoice", "call_text", "calls_schema",
           "read_call", "tools_prompt"]  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, description="shown to the model")
    parameters: dict[str, Any] | None = Field(None, description="the JSON schema of its arguments (an object)")
    strict: bool | None = Field(None, description="accepted: a required call's arguments always follow the schema")

    @model_validator(mode="after")
    def _object(self) -> FunctionDef:
        if self.parameters is not None and self.parameters.get("type", "object") != "object":
            raise ValueError(f"parameters of {self.name!r}: a call's arguments are a JSON object: give a schema of "
                             f'"type": "object"')  # fmt: skip
        return self


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON object's text")


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


def _arguments(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def calls_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON schema of one call of one of ``tools``: its name, then arguments of its schema."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t.function.name}, "arguments": _arguments(t)}} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_prompt(tools: list[Tool], *, required: bool) -> str:
    """The system message that offers ``tools`` to the model."""
    lines = ["You can call these functions:"]
    for t in tools:
        what = f": {t.function.description}" if t.function.description else ""
        lines.append(f"- {t.function.name}{what}. Arguments (JSON schema): {json.dumps(_arguments(t))}")
    how = ('To call one, answer with only a JSON object: {"name": "<function name>", "arguments": {<its '
           "arguments>}}.")  # fmt: skip
    lines.append(how if required else how + " Otherwise answer in plain text.")
    return "\n".join(lines)


def read_call(text: str, tools: list[Tool]) -> ToolCall | None:
    """The call ``text`` is, where it is exactly one JSON object naming an offered function with an object of
    arguments (else None: it is text)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    names = {t.function.name for t in tools}
    if not (isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments"), dict)):
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                    function=FunctionCall(name=value["name"], arguments=json.dumps(value["arguments"])))


def call_text(call: ToolCall) -> str:
    """A call in the history as the model writes one."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return json.dumps({"name": call.function.name, "arguments": arguments})
