"""Engine results as OpenAI response bodies: whole responses, and the chunks of a streamed one.

Log-probabilities are the engine's (tfq/decode/sampling.py: the log-softmax of the exact logits row in float64), so
they carry the same bits alone or under load. Token text is the token decoded alone; `bytes` are the bytes
it stands for (a piece of a character has no text of its own).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from tfq.decode import tools
from tfq.decode.sampling import TokenLogprob
from tfq.decode.thinking import ThinkStream, calls_in, split
from tfq.decode.tools import CLOSE as CALL_CLOSE
from tfq.decode.tools import parse
from tfq.engine.stream import Finish, Request, Result
from tfq.receipts.receipt import Issuer

FINISH = {Finish.EOS: "stop", Finish.STOP: "stop", Finish.LENGTH: "length", Finish.WINDOW: "length",
          Finish.ABORT: "abort", Finish.ERROR: "error"}  # tfq's finish -> OpenAI's finish_reason


@dataclass
class Shape:
    """What every body of one response shares."""

    kind: str  # "chat" or "text"
    model: str
    id: str
    created: int
    return_token_ids: bool = False
    return_digests: bool = False
    tools: bool = False  # a chat's reply is parsed for tool calls
    issuer: Issuer | None = None  # each choice carries its receipt (tfq/receipts), signed by the issuer's key
    # a thinking model's chat (tfq/decode/thinking.py): whether the reply starts inside its thinking block, which
    # goes to reasoning_content; None: no thinking, the reply is all content
    thinking: bool | None = None

    @classmethod
    def new(cls, kind: str, model: str, return_token_ids: bool = False, return_digests: bool = False,
            tools: bool = False, issuer: Issuer | None = None, thinking: bool | None = None) -> "Shape":
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), return_token_ids, return_digests,
                   tools, issuer, thinking)

    def body(self, choices: list[dict], chunk: bool = False, usage: dict | None = None) -> dict:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind]
        out = {"id": self.id, "object": obj + (".chunk" if chunk and self.kind == "chat" else ""),
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            out["usage"] = usage
        return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(result: Result) -> str:
    return FINISH[result.finish]


# -- log-probabilities -------------------------------------------------------------------------------------
def chat_logprobs(tokenizer, scored: list[TokenLogprob]) -> dict:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token: int, lp: float) -> dict:
        return {"token": tokenizer.decode([token]), "logprob": lp, "bytes": list(tokenizer.token_bytes(token))}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                        for s in scored]}


def text_logprobs(tokenizer, tokens: list[int], scored: list[TokenLogprob | None], offset: int) -> dict:
    """Completions' (legacy) shape: parallel lists; a token without a score (the prompt's first) has None."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, s in zip(tokens, scored):
        text = tokenizer.decode([token])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if s is None else s.logprob)
        out["top_logprobs"].append(None if s is None else {tokenizer.decode([t]): lp for t, lp in s.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# -- whole responses ---------------------------------------------------------------------------------------
def extensions(shape: Shape, ids: list[int], digests: list[str]) -> dict:
    """tfq's own fields, when asked: token ids and each token's logits digest (a whole reply's, or a chunk's)."""
    out = {}
    if shape.return_token_ids:
        out["token_ids"] = ids
    if shape.return_digests:
        out["digests"] = digests
    return out


def receipt(shape: Shape, request: Request, result: Result) -> dict:
    """tfq's `receipt` field of a finished choice, when the request asked for it."""
    return {} if shape.issuer is None else {"receipt": shape.issuer.receipt(request, result)}


def chat_choice(shape: Shape, tokenizer, index: int, result: Result) -> dict:
    message, reason = {"role": "assistant", "content": result.text}, finish_reason(result)
    thinking = ""
    if shape.thinking is not None:  # the thinking apart, as vLLM's and llama.cpp's servers give it
        thinking, answer = split(result.text, shape.thinking)
        message = {"role": "assistant", "content": answer, "reasoning_content": thinking or None}
    if shape.tools:
        text, calls = parse(message["content"])
        calls = calls_in(thinking) + calls  # a call written in the thinking is a call too
        if calls:
            message = {**message, "content": text or None, "tool_calls": [c.openai() for c in calls]}
            reason = "tool_calls" if reason == "stop" else reason  # a call cut off by the budget: still length
    return {"index": index, "message": message,
            "logprobs": None if result.logprobs is None else chat_logprobs(tokenizer, result.logprobs),
            "finish_reason": reason, **extensions(shape, result.ids, result.digests)}


def text_choice(shape: Shape, tokenizer, index: int, result: Result, prompt: list[int], echo: bool) -> dict:
    text, logprobs = result.text, None
    prompt_text = tokenizer.decode(prompt) if echo else ""
    if result.logprobs is not None:
        tokens, scored = list(result.ids), list(result.logprobs)
        if echo:
            tokens, scored = list(prompt) + tokens, list(result.prompt_logprobs or [None] * len(prompt)) + scored
        logprobs = text_logprobs(tokenizer, tokens, scored, 0)
    return {"index": index, "text": prompt_text + text, "logprobs": logprobs, "finish_reason": finish_reason(result),
            **extensions(shape, result.ids, result.digests)}


class ChoiceStream:
    """One streamed choice's text as deltas: thinking apart, calls whole."""

    def __init__(self, shape: Shape):
        self.think = ThinkStream(shape.thinking) if shape.thinking is not None else None
        self.split = tools.CallStream() if shape.tools else None
        self.thought = ""  # the thinking so far, where calls are looked for
        self.thought_calls = 0  # calls found in it so far
        self.calls = 0

    def feed(self, piece: str) -> dict:
        thinking, answer = self.think.feed(piece) if self.think else ("", piece)
        return self._delta(thinking, answer, False)

    def finish(self) -> dict:
        thinking, answer = self.think.finish() if self.think else ("", "")
        return self._delta(thinking, answer, True)

    def _delta(self, thinking: str, answer: str, last: bool) -> dict:
        text, made = self.split.feed(answer) if self.split else (answer, [])
        if last and self.split:
            text += self.split.finish()
        if self.split and thinking:
            self.thought += thinking
            if CALL_CLOSE in self.thought[-len(thinking) - len(CALL_CLOSE):]:  # a block closed: look again
                found = calls_in(self.thought)
                made = found[self.thought_calls:] + made
                self.thought_calls = len(found)
        delta: dict = {} if last and not text else {"content": text}
        if thinking:
            delta["reasoning_content"] = thinking
        if made:
            delta["tool_calls"] = [c.openai(self.calls + k) for k, c in enumerate(made)]
            self.calls += len(made)
        return delta
