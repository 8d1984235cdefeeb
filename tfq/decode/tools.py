"""Tool calls in Qwen's format: the chat template lists the tools, the model writes each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and the reply's text is parsed into calls.

`tool_choice` "required" or a named function becomes a grammar (tfq/decode/grammar.py) that allows only such blocks,
each call's JSON held to its function's parameters; "auto" lets the model choose and parses what it wrote;
"none" parses nothing. Parsing is a function of the reply's text, so the calls are as exact as the text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tfq.decode.grammar import JSON_STYLE, Constraint
from tfq.errors import TfqError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def block_call(block: str) -> ToolCall | None:
    """One block's call, or None when it is not `{"name": str, "arguments": object}`."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)
            and isinstance(value.get("arguments", {}), dict)):
        return None
    return ToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False),
                    f"call_{uuid.uuid4().hex[:24]}")


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls). A block cut off at the reply's end (its budget ran out), and
    blank lines after the last call, are dropped; a reply with any other text after its first call, or a block that
    does not parse, is all text."""
    if OPEN not in text:
        return text, []
    split = CallStream()
    head, calls = split.feed(text)  # one piece: the whole reply
    if split.finish() or not calls:
        return text, []
    return head, calls


def held_prefix(text: str, tag: str) -> int:
    """Characters at the end of `text` that may begin `tag` (a streamed split holds them until the next piece)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class CallStream:
    """A streamed reply's text split as it comes: text before the first call goes out at once (except what may
    begin `<tool_call>`); from there on, text is held and each call goes out whole when its block closes."""

    def __init__(self):
        self.held = ""
        self.calling = False

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.held += piece
        if not self.calling:
            start = self.held.find(OPEN)
            if start < 0:
                keep = held_prefix(self.held, OPEN)
                text, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return text, []
            self.calling = True
            text, self.held = self.held[:start], self.held[start:]
            return text, self._closed()
        return "", self._closed()

    def _closed(self) -> list[ToolCall]:
        out = []
        while True:
            rest = self.held.lstrip()
            end = rest.find(CLOSE)
            if not rest.startswith(OPEN) or end < 0:
                return out
            call = block_call(rest[len(OPEN):end].strip())
            if call is None:
                return out
            out.append(call)
            self.held = rest[end + len(CLOSE):]

    def finish(self) -> str:
        """What is left as text at the end: a held prefix of `<tool_call>`, or text after the calls that is not
        a call; a block cut off (it opened and never closed), and blank lines after the calls, are dropped."""
        left, self.held = self.held, ""
        if self.calling and (not left.strip() or left.lstrip().startswith(OPEN) and CLOSE not in left):
            return ""
        return left


def constraint(tools: list[dict], choice, parallel: bool, tokenizer) -> Constraint | None:
    """The grammar of `tool_choice` "required" or {"type": "function", "function": {"name": N}}: "required", a
    call of any of the tools (or several, when parallel); a name, one call of that tool; nothing else. None for
    "auto" and "none"."""
    if choice in (None, "auto", "none"):
        return None
    named = {t["function"]["name"]: t["function"] for t in tools}
    if choice == "required":
        chosen = list(named)
    else:
        name = choice["function"]["name"]
        if name not in named:
            raise TfqError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(named)})")
        chosen = [name]
    bodies = []
    for name in chosen:
        parameters = named[name].get("parameters") or {"type": "object", "properties": {}}
        schema = {"x-guidance": JSON_STYLE, "type": "object", "properties": {"name": {"const": name},
                  "arguments": parameters}, "required": ["name", "arguments"], "additionalProperties": False}
        bodies.append(f"%json {json.dumps(schema)}")
    open_, close = (_token(tokenizer, OPEN), _token(tokenizer, CLOSE))
    lark = "\n".join([
        "start: call" + (' ("\\n" call)*' if parallel and choice == "required" else ""),
        f'call: {open_} "\\n" body "\\n" {close}',
        "body: " + " | ".join(f"body{i}" for i in range(len(bodies))),
        *(f"body{i}: {b}" for i, b in enumerate(bodies))])
    return Constraint("lark", lark)


def _token(tokenizer, text: str) -> str:
    """The grammar's name for `text`: the tokenizer's own token where it has one (the model writes that token,
    not the letters), else the letters."""
    return text if tokenizer.backend.token_to_id(text) is not None else json.dumps(text)
