"""Text to ids and back, from a checkpoint folder's tokenizer.json and its chat template."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterable

from tfq.errors import TfqError

# Tokens that end a reply in Qwen models, besides the configured eos.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


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

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special tokens written in it recognized, none added. Through encode_batch, which lets go
        of the GIL while it works (encode holds it: a megabyte of text stalled every other thread for a second)."""
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

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

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
                    ) -> str:
        """The chat template rendered the way HF transformers' apply_chat_template renders it (tools: OpenAI's
        list of {"type": "function", "function": {...}}, for a template that lists them)."""
        if not self.chat_template:
            raise TfqError("this model's tokenizer_config.json has no chat_template; tfq cannot format a chat for it")
        import jinja2

        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None, **self.special
            )
        except jinja2.TemplateError as e:
            raise TfqError(f"the chat template refused these messages: {e}") from None

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
                 ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


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
