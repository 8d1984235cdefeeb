"""The Python API for offline use: `LLM(plan=...).generate(prompts, SamplingParams(...))`.

The same engine and the same exactness as the CLI and the server: a prompt's outputs do not depend on the
other prompts of the call, on the plan's pages or drafting, or on the thread count.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Sequence

from tfq.decode import tools as calls
from tfq.decode.grammar import constraint_of
from tfq.decode.penalties import Penalties
from tfq.decode.sampling import TokenLogprob
from tfq.decode.thinking import calls_in, opened, split, thinks
from tfq.decode.tools import ToolCall
from tfq.engine.stream import Request, choices
from tfq.errors import TfqError
from tfq.receipts.receipt import Issuer


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    seed: int = 0  # choice j of n draws with tfq.decode.sampling.choice_seed(seed, j): choice 0 with `seed` itself
    n: int = 1
    stop: Sequence[str] = ()
    logprobs: int | None = None  # each reply token's log-probability and the top k (None: none)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    # on the row before each draw (tfq/decode/penalties.py), as OpenAI's and vLLM's fields of the same names
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # a grammar the reply follows (tfq/decode/grammar.py): one of these at most
    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None  # Lark, llguidance's dialect
    receipt: bool = False  # each completion carries its receipt (tfq/receipts: `tfq replay` checks it)

    def requests(self, prompts: list[list[int]]) -> list[Request]:
        if not isinstance(self.n, int) or self.n < 1:
            raise TfqError(f"n must be a positive integer, got {self.n!r}")
        penalties = Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty,
                              tuple(sorted((self.logit_bias or {}).items())))
        constraint = constraint_of(self.json_schema, self.json_object, self.regex, self.choice, self.grammar)
        return choices(prompts, self.n, self.seed, max_tokens=self.max_tokens, temperature=self.temperature,
                       top_p=self.top_p, stop=tuple(self.stop), logprobs=self.logprobs,
                       prompt_logprobs=self.prompt_logprobs, penalties=penalties, constraint=constraint)


@dataclass
class Completion:
    """One choice of one prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # eos | stop | length | window | error
    logprobs: list[TokenLogprob] | None
    digests: list[str]  # per token, the digest of the logits it was drawn from
    tool_calls: list[ToolCall] | None = None  # LLM.chat with tools: the calls the reply wrote (text: the rest)
    receipt: dict | None = None  # with SamplingParams(receipt=True): what decides its bits, and what they were
    reasoning: str | None = None  # LLM.chat on a thinking model: the thinking (text: the answer after it)


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    outputs: list[Completion] = field(default_factory=list)


class LLM:
    """One model and one engine, built from a plan (file, TFQ_* variables, `sets`) like every tfq command."""

    def __init__(self, model: str | None = None, plan: str | None = None, sets: Sequence[str] = (),
                 quiet: bool = True):
        from tfq.engine.core import Engine
        from tfq.model.load import load_model
        from tfq.plan.resolve import resolve_plan

        self.plan, self.config, self.layout = resolve_plan(plan, model, sets, quiet, None)
        self.loaded = load_model(self.plan.model, progress=not quiet, device=self.layout.device,
                                 weights=self.plan.weights, tp=self.plan.tp)
        self.tokenizer = self.loaded.tokenizer
        self.engine = Engine.from_plan(self.plan, self.layout, self.loaded)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | None = None, parse_special_tokens: bool = False) -> list[RequestOutput]:
        """Raw prompts (text, or token ids), run together; outputs in the prompts' order. parse_special_tokens:
        a special token written in a text prompt (`<|im_end|>`) is that token; otherwise its characters are text
        (as the server's /v1/completions)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.tokenizer.encode(p, special=parse_special_tokens) if isinstance(p, str) else list(p)
               for p in prompts]
        return self._run(texts, ids, params or SamplingParams())

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             params: SamplingParams | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict = "auto", chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Conversations ([{"role": ..., "content": ...}, ...]) through the model's chat template. tools: OpenAI's
        list the template shows the model; each reply's calls are parsed (tfq/decode/tools.py), and tool_choice
        "required" or {"function": {"name": N}} holds the reply to calls (a grammar, as the server's).
        chat_template_kwargs: the template's own variables ({"enable_thinking": False} turns Qwen3's thinking
        off). A thinking model's thinking comes apart in each completion's `reasoning` (tfq/decode/thinking.py)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        chats = [self.tokenizer.chat(list(c), tools=tools, options=chat_template_kwargs) for c in conversations]
        params = params or SamplingParams()
        grammar = calls.constraint(tools, tool_choice, True, self.tokenizer) if tools else None
        inside = [opened(c.text) if thinks(self.tokenizer.chat_template) else None for c in chats]
        return self._run([c.text for c in chats], [self.tokenizer.ids(c) for c in chats], params, grammar,
                         bool(tools) and tool_choice != "none", inside)

    def _run(self, texts: list[str | None], ids: list[list[int]], params: SamplingParams, grammar=None,
             calling: bool = False, inside: list[bool | None] | None = None) -> list[RequestOutput]:
        requests = params.requests(ids)
        if grammar is not None:
            requests = [replace(r, constraint=grammar) for r in requests]
        results = self.engine.generate(requests)
        receipts = [self.issuer.receipt(q, r) if params.receipt and r.error is None else None
                    for q, r in zip(requests, results)]
        outs = []
        for i, (text, prompt) in enumerate(zip(texts, ids)):
            mine = range(i * params.n, (i + 1) * params.n)
            thinking = inside[i] if inside else None
            outs.append(RequestOutput(text, prompt, results[mine[0]].prompt_logprobs, [
                _completion(j, results[k], calling, receipts[k], thinking) for j, k in enumerate(mine)]))
        return outs

    @cached_property
    def issuer(self) -> Issuer:
        """What this LLM's receipts share: its model and arithmetic."""
        return Issuer.of(self.plan, self.layout, self.loaded)


def _completion(index: int, r, calling: bool, receipt: dict | None = None, inside: bool | None = None) -> Completion:
    """One choice's result; a thinking model's reply split into its thinking and its answer (inside: whether the
    prompt left it inside the thinking block; None: no thinking), and one that may call tools into its text and its
    calls (those written in the thinking too)."""
    reasoning, answer = split(r.text, inside) if inside is not None else (None, r.text)
    text, made = calls.parse(answer) if calling else (answer, None)
    if calling and reasoning:
        made = calls_in(reasoning) + made
    return Completion(index, text, r.ids, r.finish, r.logprobs, r.digests, made, receipt, reasoning)
