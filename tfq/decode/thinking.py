"""A thinking model's reply split into its thinking and its answer: Qwen3 and Qwen3.5 write
`<think>...</think>` before the answer (Qwen3.5's chat template opens the block in the prompt itself).

The split is a function of the reply's text and of whether the prompt left the reply inside the block, so it is as
exact as the reply. Streamed, text that may begin a tag is held until the next piece settles it. Tool calls can
stand in the thinking too (`calls_in`): they are found there as well as after it.
"""
from __future__ import annotations

import re

from tfq.decode.tools import CLOSE as CALL_CLOSE
from tfq.decode.tools import OPEN as CALL_OPEN
from tfq.decode.tools import ToolCall, block_call, held_prefix

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template makes a thinking model's prompts (it writes the thinking block's tag)."""
    return bool(template) and OPEN in template


def opened(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the reply inside a thinking block (Qwen3.5's generation prompt ends with
    `<think>\\n`; Qwen3's with thinking off ends with an empty, closed block)."""
    return prompt_text.rstrip().endswith(OPEN)


class ThinkStream:
    """A reply's text as it comes, split into (thinking, answer) pieces."""

    def __init__(self, inside: bool):
        self.state = "in" if inside else "start"  # start -> in -> after -> out, or start -> out
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.held += piece
        thinking, answer = "", ""
        while True:
            text = self.held
            if self.state == "start":
                head = text.lstrip()
                if head.startswith(OPEN):
                    self.state, self.held = "in", head[len(OPEN):]
                    continue
                if OPEN.startswith(head):  # may still become the tag
                    return thinking, answer
                self.state = "out"
                continue
            if self.state == "in":
                end = text.find(CLOSE)
                if end < 0:
                    keep = held_prefix(text, CLOSE)
                    self.held = text[len(text) - keep:]
                    return thinking + text[:len(text) - keep], answer
                thinking += text[:end]
                self.state, self.held = "after", text[end + len(CLOSE):]
                continue
            if self.state == "after":  # the blank lines between the block and the answer
                rest = text.lstrip("\n")
                if not rest:
                    self.held = ""
                    return thinking, answer
                self.state, self.held = "out", rest
                continue
            self.held = ""
            return thinking, answer + text

    def finish(self) -> tuple[str, str]:
        """What is held at the end: unfinished thinking stays thinking; anything else is answer."""
        left, self.held = self.held, ""
        if self.state == "in":
            return left, ""
        return "", "" if self.state == "after" else left


def split(text: str, inside: bool) -> tuple[str, str]:
    """(thinking, answer) of a whole reply."""
    stream = ThinkStream(inside)
    a, b = stream.feed(text)
    c, d = stream.finish()
    return a + c, b + d


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


def calls_in(thinking: str) -> list[ToolCall]:
    """The tool calls written whole inside the thinking (blocks that do not parse as calls are thinking)."""
    found = (block_call(m.group(1).strip()) for m in _BLOCK.finditer(thinking))
    return [c for c in found if c is not None]
