"""The request bodies of the OpenAI API that tfq serves, as pydantic models, and how each becomes engine requests.

Unknown fields are refused (a typo must not pass silently); fields OpenAI defines that would change the reply
in ways tfq does not implement (suffix, best_of) are refused unless left at their neutral value. Penalties,
logit_bias (tfq/decode/penalties.py) and response_format (tfq/decode/grammar.py) act on each stream's own logits row;
vLLM's `repetition_penalty` and `structured_outputs` (regex, choice, grammar, json) are taken too.
Defaults are OpenAI's (temperature 1, top_p 1), with one difference: a request without `seed` uses seed 0, so
a reply is always a function of the request.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tfq.decode.grammar import Constraint, constraint_of
from tfq.decode.penalties import LEAST_REPETITION, MOST_BIAS, MOST_BIASED, MOST_PENALTY, MOST_REPETITION, Penalties
from tfq.engine.stream import MOST_TOP_LOGPROBS, Request, choices

MOST_CHOICES = 16
MOST_STOPS = 4
MOST_TOOLS = 128
TOKEN_ID = re.compile(r"[0-9]{1,9}")  # a logit_bias key: ASCII digits, short enough to be a vocabulary's id


def lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string holding a lone surrogate (key or value), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and lone_surrogate(key) is not None:
            return f"{path}.{key!r}" if path else repr(key)
        where = lone_surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if where is not None:
            return where
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "yes" is not a bool, "10" not a count
    include_usage: bool = False


class JsonSchema(BaseModel):
    """response_format.json_schema: OpenAI's shape. tfq always holds a reply to its schema, strict or not."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    schema_: Union[dict, bool] = Field(True, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("give json_schema exactly when type is json_schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of a JSON schema, a regex, a choice of strings, a Lark grammar."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: Optional[Union[dict, bool]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None


class Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "yes" is not a bool, "10" not a count

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MOST_CHOICES)
    seed: int = Field(0, ge=-(2 ** 63), lt=2 ** 64)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted and ignored, as OpenAI's
    presence_penalty: float = Field(0.0, ge=-MOST_PENALTY, le=MOST_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MOST_PENALTY, le=MOST_PENALTY)
    repetition_penalty: float = Field(1.0, ge=LEAST_REPETITION, le=MOST_REPETITION)  # vLLM's
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MOST_BIASED)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None  # vLLM's
    # tfq's own: each choice's token ids, and the digest of the logits each token was drawn from
    return_token_ids: bool = False
    return_digests: bool = False
    receipt: bool = False  # each choice's receipt (tfq/receipts): in its body, or its last chunk when streamed
    # the reply's tokens already sent (by a replica that died: tfq/ray/ingress.py); the reply goes on after them
    resume_token_ids: Optional[list[int]] = None

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, raw):
        """JSON may carry a lone surrogate (`"\\ud800"`): valid JSON, but no text a tokenizer can take."""
        where = lone_surrogate(raw)
        if where is not None:
            raise PydanticCustomError("surrogate", f"{where or 'body'}: a lone UTF-16 surrogate is not text; send "
                                      f"whole characters (a surrogate pair, or the character itself)")
        return raw

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        tokens: dict[int, str] = {}
        for key, value in (v or {}).items():
            if not TOKEN_ID.fullmatch(key):  # "²".isdigit() is true, and int() of 5,000 digits raises
                raise ValueError(f"keys are token ids written as ASCII digits (\"1234\"), got {key[:20]!r}")
            if int(key) in tokens:
                raise ValueError(f"{tokens[int(key)]!r} and {key!r} name the same token; give it once")
            tokens[int(key)] = key
            if not (math.isfinite(value) and -MOST_BIAS <= value <= MOST_BIAS):
                raise ValueError(f"token {key}: a bias is in [-{MOST_BIAS:g}, {MOST_BIAS:g}], got {value!r}")
        return v

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            raise ValueError("response_format and structured_outputs: give one of them")
        return self

    @property
    def penalties(self) -> Penalties:
        bias = tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items()))
        return Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, bias)

    @property
    def constraint(self) -> Constraint | None:
        """The grammar the reply follows, or None (a malformed one raises TfqError)."""
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return constraint_of(so.json_, False, so.regex, so.choice, so.grammar)
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return constraint_of(json_object=True)
        return constraint_of(self.response_format.json_schema.schema_)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MOST_STOPS or any(not s for s in stops):
            raise ValueError(f"give at most {MOST_STOPS} non-empty stop strings")
        return v

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requests(self, prompts: list[list[int]], window: int, max_tokens: Optional[int], logprobs: Optional[int],
                 prompt_logprobs: Optional[int] = None, constraint: Constraint | None = None) -> list[Request]:
        """One engine request per (prompt, choice); without max_tokens a reply may fill the window. constraint:
        a grammar of the server's own (tool calls), else the body's."""
        return [replace(r, max_tokens=max_tokens or max(window - len(r.prompt), 1),
                        resumed=tuple(self.resume_token_ids or ()))
                for r in choices(prompts, self.n, self.seed, temperature=self.temperature, top_p=self.top_p,
                                 stop=self.stops, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 penalties=self.penalties, constraint=constraint or self.constraint)]


class CompletionBody(Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MOST_TOP_LOGPROBS)
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    # tfq's own: a special token written in a string prompt (`<|im_end|>`) is that token, as llama.cpp's
    # parse_special; off, its characters are text like any other (a chat's messages always are)
    parse_special_tokens: bool = False

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, (str, list)) and not p for p in v)):
            raise ValueError("give a non-empty prompt (a string, strings, token ids, or lists of token ids)")
        if isinstance(v, str) and not v:
            raise ValueError("give a non-empty prompt")
        return v

    @model_validator(mode="after")
    def _supported(self):
        if self.suffix:
            raise ValueError("suffix: tfq does not insert suffixes; leave it out")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: tfq returns every choice it draws; leave best_of out or equal to n")
        return self


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "yes" is not a bool, "10" not a count
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def _content_given(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        self.rendered()  # its text parts and its calls' arguments
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("content: tfq serves text only; give parts of type 'text'")
            parts.append(part["text"])
        return "".join(parts)

    def rendered(self) -> dict:
        """As the chat template takes it: OpenAI's `developer` is a system message; a call's arguments an object."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise ValueError(f"tool_calls: the arguments of {call.function.name!r} are not a JSON object")
                calls.append({"type": "function", "function": {"name": call.function.name, "arguments": arguments}})
            out["tool_calls"] = calls
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON schema of the arguments
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MOST_TOP_LOGPROBS)
    tools: Optional[list[Tool]] = Field(None, max_length=MOST_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    # vLLM's: the chat template's own variables (Qwen3's enable_thinking); scalars, by name
    chat_template_kwargs: Optional[dict[str, Union[bool, int, float, str, None]]] = Field(None, max_length=16)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: set logprobs to true as well")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: give the tools it chooses from")
        if self.calling and (self.response_format is not None and self.response_format.type != "text"
                             or self.structured_outputs is not None):
            raise ValueError("tools with response_format or structured_outputs: give one of them")
        bad = next((k for k in self.chat_template_kwargs or {} if not k.isidentifier()
                    or k in ("messages", "tools", "add_generation_prompt")), None)
        if bad is not None:
            raise ValueError(f"chat_template_kwargs: {bad!r} is not a template variable a request may set")
        return self

    @property
    def calling(self) -> bool:
        """Whether the reply is parsed for tool calls (tools given, and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def reply_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict]:
        """The messages as the chat template takes them."""
        return [m.rendered() for m in self.messages]
