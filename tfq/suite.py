"""A suite of chats (YAML): what `tfq together` checks and what `tfq chat --prompts` can run."""
from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

import yaml

from tfq.decode.grammar import Constraint, constraint_of
from tfq.decode.penalties import Penalties
from tfq.engine.stream import Request
from tfq.errors import TfqError

ROLES = ("system", "user", "assistant")
SHAPING = ("json_schema", "presence_penalty", "frequency_penalty", "repetition_penalty")  # a chat's own


@dataclass(frozen=True)
class Chat:
    """A chat and the settings it fixes itself; None leaves a setting to the command line (0 is a setting)."""

    name: str
    messages: tuple[dict, ...]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    penalties: Penalties = Penalties()  # presence_penalty, frequency_penalty, repetition_penalty
    constraint: Constraint | None = None  # json_schema: the reply follows it


def chat_from_prompt(prompt: str, name: str, system: str | None = None) -> Chat:
    messages = ({"role": "system", "content": system},) if system else ()
    return Chat(name, messages + ({"role": "user", "content": prompt},))


def parse_suite(doc, where: str) -> list[Chat]:
    if isinstance(doc, dict) and "chats" in doc:
        doc = doc["chats"]
    if not isinstance(doc, list) or not doc:
        raise TfqError(f"{where}: a suite is a non-empty YAML list of chats (each with `messages`)")
    chats = []
    for i, item in enumerate(doc):
        at = f"{where}: chat {i + 1}"
        if not isinstance(item, dict):
            raise TfqError(f"{at} is not a mapping; write `- messages: [{{role: user, content: ...}}]`")
        unknown = set(item) - {"name", "messages", "max_tokens", "temperature", "top_p", "seed", *SHAPING}
        if unknown:
            raise TfqError(f"{at}: unknown key {sorted(unknown)[0]!r}; keys are name, messages, max_tokens, "
                           f"temperature, top_p, seed, {', '.join(SHAPING)}")
        messages = item.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TfqError(f"{at} has no messages; give a list of {{role, content}}")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise TfqError(f"{at}: each message needs role ({'/'.join(ROLES)}) and content (text)")
        try:
            chat = Chat(
                name=str(item.get("name") or f"chat{i + 1}"),
                messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
                max_tokens=_given(item, "max_tokens", int),
                temperature=_given(item, "temperature", float),
                top_p=_given(item, "top_p", float),
                seed=_given(item, "seed", int),
                penalties=Penalties(float(item.get("presence_penalty", 0.0)),
                                    float(item.get("frequency_penalty", 0.0)),
                                    float(item.get("repetition_penalty", 1.0))),
                constraint=constraint_of(json_schema=item["json_schema"]) if "json_schema" in item else None,
            )
        except (TfqError, TypeError, ValueError) as e:
            raise TfqError(f"{at}: {e}") from None
        chat.penalties.validate(at)
        if ((chat.max_tokens is not None and chat.max_tokens < 1)
                or (chat.temperature is not None and not chat.temperature >= 0)
                or (chat.top_p is not None and not 0 < chat.top_p <= 1)):
            raise TfqError(f"{at}: max_tokens must be >= 1, temperature >= 0, top_p in (0, 1]")
        chats.append(chat)
    return chats


def _given(item: dict, key: str, kind: type):
    """The chat's own value of `key`, or None when it does not set one (`key:` with no value sets none)."""
    value = item.get(key)
    return None if value is None else kind(value)


def read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark is dropped); one line naming the bad byte if not."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TfqError(f"{path}: cannot read it ({e.strerror or e})") from None
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = skip + e.start
        raise TfqError(f"{path}: not UTF-8 text (byte 0x{data[at]:02x} at offset {at}); "
                       f"save the file as UTF-8") from None


def load_suite(path: str | Path) -> list[Chat]:
    path = Path(path)
    if not path.is_file():
        raise TfqError(f"{path}: no such suite file")
    try:
        doc = yaml.safe_load(read_text(path))
    except yaml.YAMLError as e:
        raise TfqError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_suite(doc, str(path))


def load_prompts(path: str | Path) -> list[Chat]:
    """A YAML suite, or plain text with one prompt per line."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        return load_suite(path)
    if not path.is_file():
        raise TfqError(f"{path}: no such prompts file")
    lines = [ln.strip() for ln in read_text(path).splitlines() if ln.strip()]
    if not lines:
        raise TfqError(f"{path}: no prompts in it (one prompt per line)")
    return [chat_from_prompt(ln, f"p{i + 1}") for i, ln in enumerate(lines)]


def requests_for(chats: list[Chat], tokenizer, max_tokens: int, temperature: float, top_p: float,
                 seed: int, tools: list[dict] | None = None, options: dict | None = None, **shaping) -> list[Request]:
    """Chats -> engine requests; a chat's own settings win over the command line's whenever it sets them
    (temperature 0 or seed 0 included): only None takes the command line's. options: the chat template's own
    variables (Qwen3's enable_thinking)."""
    def own(value, default):
        return value if value is not None else default

    return [Request(prompt=tuple(tokenizer.chat_ids(list(c.messages), tools=tools, options=options)),
                    max_tokens=own(c.max_tokens, max_tokens),
                    temperature=own(c.temperature, temperature),
                    top_p=own(c.top_p, top_p),
                    seed=own(c.seed, seed), label=c.name, **{**shaping, **_own_shaping(c)}) for c in chats]


def _own_shaping(chat: Chat) -> dict:
    """The penalties and grammar a chat sets itself (they win over the command line's)."""
    own = {"penalties": chat.penalties} if chat.penalties else {}
    return {**own, "constraint": chat.constraint} if chat.constraint is not None else own


def default_suite() -> Path:
    """The shipped 12-chat suite: examples/chats.yaml in a source checkout, else the copy the wheel carries
    (package tfq.examples)."""
    import tfq

    path = Path(tfq.__file__).resolve().parent.parent / "examples" / "chats.yaml"
    if path.is_file():
        return path
    try:
        from importlib.resources import files

        shipped = files("tfq.examples") / "chats.yaml"
        if shipped.is_file():
            return Path(str(shipped))
    except ModuleNotFoundError:
        pass
    raise TfqError(f"the shipped suite is not there ({path}, nor package tfq.examples); pass --suite SUITE.yaml")
