"""What is checked of a parsed request, and how its prompts become token ids: the model it names, the lengths of
its stop strings and of its prompts (by characters before tokenizing, by tokens after), and pydantic's
complaints as one line. Also what the routes share: `Served`, and `ApiError`, answered as OpenAI's error body."""
from __future__ import annotations

from dataclasses import dataclass

from tfq.decode.thinking import opened, thinks
from tfq.errors import TfqError
from tfq.receipts.receipt import Issuer
from tfq.serve.guard import Limits
from tfq.serve.loop import EngineLoop
from tfq.serve.metrics import Metrics
from tfq.serve.protocol import ChatBody, Sampling


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 outcome: str = "invalid"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.outcome = status, message, param, kind, outcome


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Served:
    """What the routes need: the engine loop, the tokenizer, the model's name and window."""

    loop: EngineLoop
    tokenizer: object  # tfq.model.tokenizer.Tokenizer
    model: str
    window: int
    vocab: int
    metrics: Metrics
    api_keys: tuple[str, ...] = ()  # any of them opens /v1/ and /metrics; each a tenant when several
    limits: Limits = Limits()
    hosts: frozenset[str] | None = None  # Host names answered (tfq.serve.guard.allowed_hosts); None: any
    log_prompts: bool = False  # log each request's prompt text (off: logs never hold what users wrote)
    issuer: Issuer | None = None  # what a reply's receipt holds besides the reply (tfq/receipts/receipt.py)

    @property
    def prompt_tokens(self) -> int:
        """The most tokens a prompt may have: the limit, and room for one reply token in the window."""
        return min(self.limits.prompt_tokens or self.window - 1, self.window - 1)


def validation_message(errors) -> tuple[str, str | None]:
    """pydantic's first complaint as one line naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "surrogate":  # its message names the field already
        return first["msg"], None
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union's complaint names the branch tried (`str`, `list[int]`): the field is the first part
    field = ".".join(p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float"))
    if first.get("type") == "extra_forbidden":
        return f"unknown field {field!r}; tfq serves OpenAI's fields (GET /openapi.json lists them)", field
    if first.get("type") == "missing":
        return (f"{field} is required" if field else "a JSON body is required"), field or None
    return f"{field or 'body'}: {first['msg']}", field or None


def check_model(served: Served, body: Sampling) -> None:
    if body.model != served.model:
        raise ApiError(400, f"model {body.model!r} is not served here; this server serves {served.model!r} "
                       f"(GET /v1/models)", "model")


def check_resume(served: Served, body: Sampling, prompts: list[list[int]]) -> None:
    """A resumed reply (resume_token_ids: what tfq/ray's ingress sends when a replica dies mid-stream) goes on one
    streamed choice of one prompt, from reply tokens of this model that leave room in the window, without a receipt
    (which would sign tokens this server did not draw)."""
    ids = body.resume_token_ids
    if not ids:
        return
    problem = ("a reply is resumed streamed: set stream to true" if not body.stream else
               "a reply is resumed alone: give one prompt, n = 1 and no echo"
               if body.n != 1 or len(prompts) != 1 or getattr(body, "echo", False) else
               "a resumed reply has no receipt: leave receipt out" if body.receipt else
               f"give token ids in [0, {served.vocab})" if any(not 0 <= t < served.vocab for t in ids) else None)
    if not problem and len(prompts[0]) + len(ids) >= served.window:
        problem = f"{len(prompts[0])} prompt and {len(ids)} reply tokens leave no room in the window of {served.window}"
    if problem:
        raise ApiError(400, f"resume_token_ids: {problem}", "resume_token_ids")


def check_stops(served: Served, body: Sampling) -> None:
    most = served.limits.stop_chars
    for s in body.stops:
        if len(s) > most:
            raise ApiError(400, f"stop: a stop string of {len(s)} characters is over this server's limit of {most}; "
                           f"shorten it (the operator sets --max-stop-chars)", "stop")


def text_prompts(served: Served, prompt, special: bool = False) -> list[list[int]]:
    """Completions' prompt forms: a string, strings, token ids, or lists of token ids. special: a special token
    written in a string prompt is that token (the body's parse_special_tokens); otherwise its characters are text."""
    if isinstance(prompt, str):
        prompts = [encode(served, prompt, "prompt", special)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [encode(served, p, "prompt", special) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    for p in prompts:
        if not p:
            raise ApiError(400, "prompt: empty after tokenizing; give some text", "prompt")
        if any(not 0 <= t < served.vocab for t in p):
            raise ApiError(400, f"prompt: token ids must be in [0, {served.vocab})", "prompt")
        fits(served, len(p), "prompt")
    return prompts


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    # a thinking model's template (tfq/decode/thinking.py): whether the prompt leaves the reply inside its thinking
    # block; None: the template does not think, and the reply is all answer
    inside: bool | None = None


def chat_prompt(served: Served, body: ChatBody) -> ChatPrompt:
    """The chat's ids as the template places its special tokens; the messages' own text is text (tfq.model.tokenizer:
    a message cannot write a special token)."""
    tok = served.tokenizer
    try:
        chat = tok.chat(body.chat(), tools=body.tool_dicts, options=body.chat_template_kwargs)
    except TfqError as e:
        if str(e).startswith("chat_template_kwargs"):
            raise ApiError(400, str(e), "chat_template_kwargs") from None
        raise ApiError(400, f"messages: {e}", "messages") from None
    short_enough(served, chat.text, "messages")
    prompt = tok.ids(chat)
    fits(served, len(prompt), "messages")
    return ChatPrompt(prompt, opened(chat.text) if thinks(tok.chat_template) else None)


def encode(served: Served, text: str, param: str, special: bool = False) -> list[int]:
    """A prompt's ids (special: see text_prompts)."""
    short_enough(served, text, param)
    return served.tokenizer.encode(text, special=True) if special else served.tokenizer.encode(text)


def short_enough(served: Served, text: str, param: str) -> None:
    """A text too long for the limit by its length alone is refused before tokenizing."""
    longest = served.tokenizer.longest_token
    if len(text) > served.prompt_tokens * longest:
        raise ApiError(400, f"{param}: {len(text)} characters are more than this server's limit of "
                       f"{served.prompt_tokens} prompt tokens can hold (a token here is at most {longest} "
                       f"characters); shorten it", param)


def fits(served: Served, tokens: int, param: str) -> None:
    if tokens >= served.window:
        raise ApiError(400, f"{param}: {tokens} tokens leave no room for a reply in the window of {served.window}; "
                       f"shorten it, or serve a plan with a larger window (TFQ_WINDOW)", param)
    if tokens > served.prompt_tokens:
        raise ApiError(400, f"{param}: {tokens} tokens are over this server's limit of {served.prompt_tokens} prompt "
                       f"tokens; shorten it (the operator sets --max-prompt-tokens)", param)
