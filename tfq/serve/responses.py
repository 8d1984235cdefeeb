"""OpenAI's Responses API (`POST /v1/responses`) on the chat pipeline: the request becomes a chat (its `input` and
`instructions` the messages, `text.format` the response format, its tools the chat's tools), runs as
`/v1/chat/completions` runs it, and the reply comes back as Responses output items: the thinking as a `reasoning`
item, the answer as a `message`, each call as a `function_call`. So a reply is the chat API's reply for the same
conversation, bit for bit. Streamed, the documented events: response.created, response.in_progress, an item's
added / delta / done events, response.completed.

`previous_response_id` continues a conversation this server answered: its messages and reply are kept in memory,
the most recent STORED responses (older ones are forgotten; a server restart forgets all).
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tfq.engine.stream import Finish, Result

STORED = 1024  # responses kept for previous_response_id


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Union[dict, bool]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class Text(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: Optional[TextFormat] = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ResponsesBody(BaseModel):
    """The fields tfq takes; OpenAI's bookkeeping ones (store, metadata, user, include, truncation) are accepted and
    change nothing."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict]] = None
    parallel_tool_calls: bool = True
    text: Optional[Text] = None
    stream: bool = False
    previous_response_id: Optional[str] = None
    seed: int = Field(0, ge=-(2 ** 63), lt=2 ** 64)  # tfq's own, as the chat API's seed
    structured_outputs: Optional[dict] = None  # vLLM's, as the chat API takes it
    reasoning: Optional[dict] = None  # accepted: a thinking model thinks unless its template is told otherwise
    store: Optional[bool] = None
    metadata: Optional[dict] = None
    user: Optional[str] = None
    include: Optional[list[str]] = None
    truncation: Optional[str] = None


def input_messages(body: ResponsesBody) -> list[dict]:
    """The request's input as chat messages: a string is the user's; items are messages (`developer` a system one),
    the model's earlier function calls, and their outputs; a reasoning item is not shown to the model again."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                texts = [p.get("text") for p in content]
                if not all(isinstance(t, str) and p.get("type") in ("input_text", "output_text")
                           for t, p in zip(texts, content)):
                    raise ValueError(f"input[{i}].content: tfq serves text only; give parts of type input_text")
                content = "".join(texts)
            out.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        elif kind != "reasoning":
            raise ValueError(f"input[{i}]: items of type {kind!r} are not served here; give message, function_call "
                             f"or function_call_output items")
    return out


def chat_fields(body: ResponsesBody, history: list[dict]) -> dict[str, Any]:
    """The chat completions body of the same request (tfq.serve.protocol.ChatBody's fields)."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    fields: dict[str, Any] = {"model": body.model, "messages": messages + input_messages(body),
                              "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                              "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls}
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    if body.structured_outputs is not None:
        fields["structured_outputs"] = body.structured_outputs
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                           for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":  # {"type": "function", "name": N}
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        fields["tool_choice"] = choice
    f = body.text.format if body.text else None
    if f is not None and f.type != "text":
        fields["response_format"] = {"type": f.type} if f.type == "json_object" else {
            "type": "json_schema", "json_schema": {k: v for k, v in (("name", f.name or "output"), (
                "schema", f.schema_ if f.schema_ is not None else True), ("description", f.description),
                ("strict", f.strict)) if v is not None}}
    return fields


class ResponseStore:
    """The most recent responses' conversations (messages, then the reply as messages), for previous_response_id."""

    def __init__(self, most: int = STORED):
        self.most, self.kept = most, OrderedDict()

    def get(self, id_: str) -> list[dict] | None:
        found = self.kept.get(id_)
        if found is not None:
            self.kept.move_to_end(id_)
        return found

    def put(self, id_: str, messages: list[dict]) -> None:
        self.kept[id_] = messages
        while len(self.kept) > self.most:
            self.kept.popitem(last=False)


def reply_messages(message: dict) -> list[dict]:
    """A chat choice's message as the conversation keeps it (calls as tool_calls, thinking left out)."""
    kept = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        kept["tool_calls"] = message["tool_calls"]
    return [kept]


class Builder:
    """One response's output items, built from a chat choice (whole) or its deltas (streamed), with stable ids."""

    def __init__(self, model: str):
        self.id, self.model, self.created = f"resp_{uuid.uuid4().hex}", model, int(time.time())
        self.items: list[dict] = []

    def reasoning(self, text: str) -> dict:
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    def message(self, text: str) -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                "content": [_part(text)]}

    def call(self, c: dict) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}

    def from_choice(self, message: dict) -> list[dict]:
        items = [self.reasoning(message["reasoning_content"])] if message.get("reasoning_content") else []
        if message.get("content") or not message.get("tool_calls"):
            items.append(self.message(message.get("content") or ""))
        return items + [self.call(c) for c in message.get("tool_calls") or []]

    def response(self, body: ResponsesBody, status: str, result: Result | None = None,
                 prompt_tokens: int = 0) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": self.items if status != "in_progress" else [],
               "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
               "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
               "tool_choice": body.tool_choice or "auto", "tools": [t.model_dump(exclude_none=True)
                                                                   for t in body.tools or []],
               "previous_response_id": body.previous_response_id, "error": None, "incomplete_details": None,
               "text": {"format": {"type": "text"}} if body.text is None else body.text.model_dump(
                   exclude_none=True, by_alias=True), "usage": None, "metadata": body.metadata or {}}
        if result is not None:
            if result.finish in (Finish.LENGTH, Finish.WINDOW):
                out.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            out["usage"] = {"input_tokens": prompt_tokens, "output_tokens": len(result.ids),
                            "total_tokens": prompt_tokens + len(result.ids),
                            "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return out


def sse_event(kind: str, number: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **fields})}\n\n"


class Events:
    """The events of one streamed response, item by item: a reasoning item while the model thinks, a message while
    it answers, a function_call item for each call (whole)."""

    def __init__(self, builder: Builder):
        self.builder = builder
        self.open: str | None = None  # the kind of the item now streaming: reasoning, message, or none
        self.text = ""  # that item's text so far
        self.calls: list[dict] = []  # calls, sent as items at the end: after the message, as a whole response has them
        self.answered = False

    @property
    def index(self) -> int:
        return len(self.builder.items) - 1

    def delta(self, kind: str, text: str) -> list[tuple[str, dict]]:
        """A piece of thinking (kind reasoning) or of the answer (message)."""
        events = []
        self.answered |= kind == "message"
        if self.open != kind:
            events += self.close()
            item = self.builder.reasoning("") if kind == "reasoning" else self.builder.message("")
            self.builder.items.append({**item, "content": [], "status": "in_progress"})
            self.open, self.text = kind, ""
            events.append(("response.output_item.added", dict(output_index=self.index, item=dict(item, content=[],
                                                                                                status="in_progress"))))
            if kind == "message":
                events.append(("response.content_part.added", dict(item_id=item["id"], output_index=self.index,
                                                                   content_index=0, part=_part(""))))
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [(name, dict(item_id=self.builder.items[-1]["id"], output_index=self.index, content_index=0,
                                     delta=text, **extra))]

    def call(self, c: dict) -> list[tuple[str, dict]]:
        item = self.builder.call(c)
        events = []
        self.builder.items.append(item)
        i = self.index
        started = {**item, "arguments": "", "status": "in_progress"}
        return events + [
            ("response.output_item.added", dict(output_index=i, item=started)),
            ("response.function_call_arguments.delta", dict(item_id=item["id"], output_index=i,
                                                            delta=item["arguments"])),
            ("response.function_call_arguments.done", dict(item_id=item["id"], output_index=i, name=item["name"],
                                                           arguments=item["arguments"])),
            ("response.output_item.done", dict(output_index=i, item=item))]

    def close(self) -> list[tuple[str, dict]]:
        """The item now streaming, done."""
        if self.open is None:
            return []
        item, i, text = self.builder.items[-1], self.index, self.text
        if self.open == "reasoning":
            item.update(status="completed", content=[{"type": "reasoning_text", "text": text}])
            events = [("response.reasoning_text.done", dict(item_id=item["id"], output_index=i, content_index=0,
                                                            text=text))]
        else:
            item.update(status="completed", content=[_part(text)])
            events = [("response.output_text.done", dict(item_id=item["id"], output_index=i, content_index=0,
                                                         text=text, logprobs=[])),
                      ("response.content_part.done", dict(item_id=item["id"], output_index=i, content_index=0,
                                                          part=_part(text)))]
        self.open = None
        return events + [("response.output_item.done", dict(output_index=i, item=item))]

    def end(self) -> list[tuple[str, dict]]:
        events = self.close()
        if not self.answered and not self.calls:  # an empty answer is still a message
            events += self.delta("message", "") + self.close()
        for c in self.calls:
            events += self.call(c)
        return events


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def stream_events(builder: Builder, body: ResponsesBody, deltas: AsyncIterator[tuple[dict, Result | None]],
                        prompt_tokens: int) -> AsyncIterator[str]:
    """The documented event stream of one response, from its chat choice's deltas (the last with its result)."""
    number = iter(range(1 << 62))
    for kind in ("response.created", "response.in_progress"):
        yield sse_event(kind, next(number), response=builder.response(body, "in_progress"))
    items = Events(builder)
    async for delta, result in deltas:
        events = items.delta("reasoning", delta["reasoning_content"]) if delta.get("reasoning_content") else []
        events += items.delta("message", delta["content"]) if delta.get("content") else []
        items.calls += delta.get("tool_calls") or []
        if result is not None:
            events += items.end()
            events.append(("response.completed", dict(response=builder.response(body, "completed", result,
                                                                                prompt_tokens))))
        for kind, fields in events:
            yield sse_event(kind, next(number), **fields)
