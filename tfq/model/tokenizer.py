"""Text to ids and back, from a checkpoint folder's tokenizer.json and its chat template.

Special tokens (`<|im_start|>`, `<|im_end|>`: those tokenizer.json marks special) come only from the chat
template: written in a message, or in a document quoted in one, their characters are text like any other, so a
user's text cannot close its turn and open a system one. A raw prompt takes them only when asked
(`encode(text, special=True)`). Added tokens not marked special (Qwen's `<tool_call>`, `<think>`) are read as
HF reads them: Qwen's templates look for them in a message's content.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Iterable

from tfq.errors import TfqError

# Tokens that end a reply in Qwen models, besides the configured eos.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
_PLANE_15 = re.compile("[\U000F0000-\U000FFFFD]")  # private use: where the stand-ins of special tokens come from


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise TfqError(f"{path.parent}: no {path.name} there; the checkpoint folder lacks its tokenizer")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TfqError(f"{path}: not readable JSON ({e})") from None


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    """A tokenizers.Tokenizer plus the chat template and stop tokens of one checkpoint."""

    def __init__(self, backend, chat_template: str | None, special: dict[str, str | None], eos_ids: tuple[int, ...]):
        self.backend = backend
        self.chat_template = chat_template
        self.special = special  # bos_token, eos_token, ... as text (for the template)
        self.eos_ids = eos_ids
        self._template = None
        self._byte_of: dict[str, int] | None = None  # GPT-2's byte alphabet, reversed (token_bytes)
        self._added: set[int] = set()
        self._longest: int | None = None
        added = backend.get_added_tokens_decoder()
        # the special tokens' texts, longest first (a regex then matches as tokenizers does: leftmost-longest)
        self._specials = {t.content: i for i, t in sorted(added.items(), key=lambda a: -len(a[1].content))
                          if t.special}
        self._special_re = re.compile("|".join(map(re.escape, self._specials))) if self._specials else None
        self._plain = None  # a second backend that reads special tokens' characters as text (built on first need)
        self._plain_once = threading.Lock()

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TfqError(f"{folder}: no tokenizer.json there; tfq needs an HF checkpoint folder with its tokenizer")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise TfqError(f"{path}: not a readable tokenizer.json ({e})") from None
        cfg = _read_json(folder / "tokenizer_config.json", required=False)
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos: list[int] = []
        if special["eos_token"] is not None and backend.token_to_id(special["eos_token"]) is not None:
            eos.append(backend.token_to_id(special["eos_token"]))
        eos += _as_ids(_read_json(folder / "generation_config.json", required=False).get("eos_token_id"))
        eos += _as_ids(_read_json(folder / "config.json", required=False).get("eos_token_id"))
        eos += [i for i in map(backend.token_to_id, _STOP_TOKENS) if i is not None]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # several named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(backend, template, special, tuple(dict.fromkeys(eos)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Ids of `text`, none added. special: a special token written in it is that token, as HF's encode reads
        it; otherwise (the default) its characters are text like any other."""
        return self._encode([text], special)[0]

    def _encode(self, texts: list[str], special: bool) -> list[list[int]]:
        """Through encode_batch, which lets go of the GIL while it works (encode holds it: a megabyte of text
        stalled every other thread for a second). A text without a special token's characters reads the same
        either way: the backend that would match them is needed only when some are there."""
        backend = self.backend if special or not any(map(self._holds_special, texts)) else self._plain_backend()
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    def _holds_special(self, text: str) -> bool:
        return any(s in text for s in self._specials)

    def _plain_backend(self):
        """The backend with tokenizers' encode_special_tokens set: special tokens' characters are text to it."""
        with self._plain_once:
            if self._plain is None:
                from tokenizers import Tokenizer as Backend

                plain = Backend.from_str(self.backend.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
        return self._plain

    @property
    def longest_token(self) -> int:
        """At least the characters any one token stands for (its byte-level piece has a symbol per byte), so a
        text of C characters has at least C / longest_token tokens: a bound known before tokenizing."""
        if self._longest is None:
            self._longest = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._longest

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level piece may be part of a character; added tokens as UTF-8."""
        if self._byte_of is None:
            from tfq.model.gguf_tokenizer import bytes_to_unicode

            self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
            self._added = set(self.backend.get_added_tokens_decoder())
        piece = self.backend.id_to_token(int(token_id)) or ""
        if token_id in self._added or not all(c in self._byte_of for c in piece):
            return piece.encode("utf-8")
        return bytes(self._byte_of[c] for c in piece)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    options: dict | None = None) -> str:
        """The chat template rendered the way HF transformers' apply_chat_template renders it (tools: OpenAI's
        list of {"type": "function", "function": {...}}, for a template that lists them; options: the template's own
        variables)."""
        return self.chat(messages, add_generation_prompt, tools, options).text

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                 options: dict | None = None) -> list[int]:
        """A chat's prompt ids: every path that tokenizes a chat (server, CLI, LLM) comes through chat() and
        ids()."""
        return self.ids(self.chat(messages, add_generation_prompt, tools, options))

    def chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
             options: dict | None = None) -> ChatText:
        """The chat rendered, and where its template placed special tokens. A special token's text written in
        the messages or tools is hidden from the template (a stand-in character found nowhere in them takes its
        place), so each special token in the rendered text is the template's own; the characters come back, as
        text, after rendering. A chat without them renders as before, byte for byte."""
        strings = _strings([messages, tools])
        stand_ins = self._stand_ins(strings) if any(map(self._holds_special, strings)) else {}
        if stand_ins:
            messages, tools = _replaced(messages, stand_ins), _replaced(tools, stand_ins)
        rendered = self._render(messages, add_generation_prompt, tools, options or {})
        pieces: list[str | int] = []
        at = 0
        for m in self._special_re.finditer(rendered) if self._special_re else ():
            pieces += [_restored(rendered[at:m.start()], stand_ins), self._specials[m.group()]]
            at = m.end()
        pieces.append(_restored(rendered[at:], stand_ins))
        return ChatText(_restored(rendered, stand_ins), tuple(p for p in pieces if p != ""))

    def ids(self, chat: ChatText) -> list[int]:
        """A rendered chat's ids: the template's special tokens, and between them text read as text (HF splits
        its text at special tokens the same way, so an ordinary chat's ids are HF's)."""
        texts = [p for p in chat.pieces if isinstance(p, str)]
        encoded = iter(self._encode(texts, special=False) if texts else [])
        return [i for p in chat.pieces for i in ((p,) if isinstance(p, int) else next(encoded))]

    def _stand_ins(self, strings: list[str]) -> dict[str, str]:
        """A private-use character for each special token written in `strings`, found nowhere in them, in the
        template or in the template's own variables."""
        found = [s for s in self._specials if any(s in x for x in strings)]
        theirs = [*strings, *self._specials, self.chat_template or "", *(v or "" for v in self.special.values())]
        used = {c for x in theirs for c in _PLANE_15.findall(x)}
        free = list(islice((chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in used), len(found)))
        if len(free) < len(found):
            raise TfqError("the messages use every private-use character of plane 15; tfq cannot tell their special "
                           "tokens' text from the template's")
        return dict(zip(found, free))

    def _render(self, messages, add_generation_prompt: bool, tools, options: dict) -> str:
        """options: the template's own variables (chat_template_kwargs: Qwen3's enable_thinking); never the
        tokenizer's special tokens or the template's functions, whose text would become special tokens."""
        taken = next((k for k in options if k in self.special or k in ("raise_exception", "strftime_now", "range",
                                                                         "namespace", "dict", "cycler", "joiner")),
                     None)
        if taken is not None:
            raise TfqError(f"chat_template_kwargs: {taken!r} is the template's own; a request may set other variables")
        if not self.chat_template:
            raise TfqError("this model's tokenizer_config.json has no chat_template; tfq cannot format a chat for it")
        import jinja2

        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(**{**self.special, **options}, messages=messages,
                                         add_generation_prompt=add_generation_prompt, tools=tools or None)
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # a template variable of the wrong kind too
            raise TfqError(f"the chat template refused these messages: {e}") from None

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


@dataclass(frozen=True)
class ChatText:
    """A chat as its template rendered it: the text (HF's apply_chat_template's), and the same as pieces: text,
    or the id of a special token the template placed."""

    text: str
    pieces: tuple[str | int, ...]


def _strings(value) -> list[str]:
    """Every string in messages or tools (keys too: a schema's property names reach the template's tojson), in
    no particular order; a loop, not recursion, however deep a schema nests."""
    found, todo = [], [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            found.append(v)
        elif isinstance(v, dict):
            todo += [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple)):
            todo += v
    return found


def _restored(text: str, stand_ins: dict[str, str]) -> str:
    for special, stand_in in stand_ins.items():
        text = text.replace(stand_in, special)
    return text


def _replaced(value, stand_ins: dict[str, str]):
    """`value` with every special token's text in its strings replaced by its stand-in (longest first)."""
    if isinstance(value, str):
        for text, stand_in in stand_ins.items():
            value = value.replace(text, stand_in)
        return value
    if isinstance(value, dict):
        return {_replaced(k, stand_ins): _replaced(v, stand_ins) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replaced(v, stand_ins) for v in value]
    return value


def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # as HF: no HTML escaping, unlike jinja's own tojson
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TfqError(f"the model's chat template does not parse: {e}") from None


@dataclass
class StreamDecoder:
    """Feed ids one at a time; get back the text they complete.

    Text is released only when it ends on a whole character: a CJK character or an emoji split over
    several byte tokens comes out once its last byte arrives. The pieces, with `flush()`, join to
    exactly `decode(all ids)`.
    """

    tokenizer: Tokenizer
    skip_special: bool = False
    ids: list[int] = field(default_factory=list)
    _start: int = 0  # first id of the window decoded for context
    _done: int = 0  # ids up to here are already released

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        dec = self.tokenizer.decode
        before = dec(self.ids[self._start:self._done], self.skip_special)
        now = dec(self.ids[self._start:], self.skip_special)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        self._start, self._done = self._done, len(self.ids)
        return now[len(before):]
