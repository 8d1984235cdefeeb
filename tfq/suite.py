"""A suite of chats (YAML): what `tfq together` checks and what `tfq chat --prompts` can run."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from tfq.errors import TfqError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Chat:
    name: str
    messages: tuple[dict, ...]
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


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
        unknown = set(item) - {"name", "messages", "max_tokens", "temperature", "top_p", "seed"}
        if unknown:
            raise TfqError(f"{at}: unknown key {sorted(unknown)[0]!r}; keys are name, messages, max_tokens, "
                           f"temperature, top_p, seed")
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
                max_tokens=None if item.get("max_tokens") is None else int(item["max_tokens"]),
                temperature=float(item.get("temperature", 0.0)),
                top_p=float(item.get("top_p", 1.0)),
                seed=int(item.get("seed", 0)),
            )
        except (TypeError, ValueError) as e:
            raise TfqError(f"{at}: {e}") from None
        if chat.max_tokens is not None and chat.max_tokens < 1 or chat.temperature < 0 or not 0 < chat.top_p <= 1:
            raise TfqError(f"{at}: max_tokens must be >= 1, temperature >= 0, top_p in (0, 1]")
        chats.append(chat)
    return chats


def load_suite(path: str | Path) -> list[Chat]:
    path = Path(path)
    if not path.is_file():
        raise TfqError(f"{path}: no such suite file")
    try:
        doc = yaml.safe_load(path.read_text())
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
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise TfqError(f"{path}: no prompts in it (one prompt per line)")
    return [chat_from_prompt(ln, f"p{i + 1}") for i, ln in enumerate(lines)]
