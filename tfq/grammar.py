"""Structured outputs: a grammar a reply must follow (a JSON schema, any JSON object, a regex, a choice of strings,
a Lark grammar), as a mask of the tokens allowed next, by llguidance.

The mask is a function of the grammar and the stream's own reply tokens (a `Matcher` follows them, and rebuilds
itself from them whenever it is not at them: a stream recomputed after preemption, a reply continued elsewhere).
It is applied to the stream's own exact logits row, so a constrained reply is the same alone or together. No
token is forced ahead of the model (no jump-forward): every token is drawn from the row, as without a grammar.

Why llguidance (benchmarks/grammar_engines.py measures it beside xgrammar on examples/schemas.json): it takes
the tokenizer's own JSON, depends on nothing, and its masks cost tens of microseconds a token on a 151k vocab.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tfq.errors import TfqError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# JSON as json.dumps writes it: whitespace only after a separator. Free whitespace lets a model pad a reply with
# blanks until its budget runs out, a known failure of constrained decoding.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What a reply must match. source: the JSON schema as JSON text, the regex, the choices as a JSON list of
    strings, or the Lark grammar (llguidance's dialect); empty for json_object."""

    kind: str
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Constraint":
        return cls("json_schema", json.dumps(schema))  # key order kept: properties come in the schema's order

    def grammar(self) -> str:
        """llguidance's grammar text."""
        import llguidance

        compile_ = llguidance.LLMatcher
        if self.kind == "json_schema":
            return compile_.grammar_from_json_schema(self.source, overrides=JSON_STYLE)
        if self.kind == "json_object":
            return compile_.grammar_from_json_schema({"type": "object"}, overrides=JSON_STYLE)
        if self.kind == "regex":
            return compile_.grammar_from_regex(self.source)
        if self.kind == "choice":
            return compile_.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.source)))
        if self.kind == "lark":
            return compile_.grammar_from_lark(self.source)
        raise TfqError(f"constraint kind {self.kind!r}: choose one of {', '.join(KINDS)}")


def constraint_of(json_schema: dict | bool | None = None, json_object: bool = False, regex: str | None = None,
                  choice: Sequence[str] | None = None, lark: str | None = None) -> Constraint | None:
    """The one constraint of a request's settings (None: none); two at once is an error."""
    given = [k for k, v in (("json_schema", json_schema is not None), ("json_object", json_object),
                            ("regex", regex is not None), ("choice", choice is not None),
                            ("lark", lark is not None)) if v]
    if len(given) > 1:
        raise TfqError(f"{' and '.join(given)}: give one constraint at most")
    if not given:
        return None
    if json_schema is not None:
        if not isinstance(json_schema, (dict, bool)):
            raise TfqError("json_schema: a JSON schema is an object (or true/false)")
        return Constraint.json_schema(json_schema)
    if choice is not None:
        if not choice or not all(isinstance(c, str) and c for c in choice):
            raise TfqError("choice: give a non-empty list of non-empty strings")
        return Constraint("choice", json.dumps(list(choice)))
    if json_object:
        return Constraint("json_object")
    return Constraint("regex", regex) if regex is not None else Constraint("lark", lark)


class Grammars:
    """One model's grammars: llguidance's view of its tokenizer (built once, about a second), and matchers."""

    KEPT = 64  # compiled grammars kept (a server's clients send the same schemas again and again)

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]):
        try:
            import llguidance
        except ImportError:
            raise TfqError("structured outputs need llguidance; install it: pip install llguidance") from None
        self.vocab = vocab
        self.llg = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=sorted(eos_ids))
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()  # a server checks grammars in its request threads, the engine in its own

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A matcher at the start of a reply; a grammar llguidance refuses raises TfqError with its reason."""
        import llguidance

        with self._lock:
            start = self._compiled.get(constraint)
            if start is None:
                try:
                    start = llguidance.LLMatcher(self.llg, constraint.grammar(), log_level=0)
                    reason = start.get_error() if start.is_error() else None
                except (ValueError, RuntimeError, TypeError) as e:
                    reason = str(e)
                if reason is not None:
                    raise TfqError(f"the {constraint.kind.replace('_', ' ')} cannot be used: {_one_line(reason)}")
                self._compiled[constraint] = start
                while len(self._compiled) > self.KEPT:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(constraint)
            return Matcher(start.deep_copy(), self.vocab)


class Matcher:
    """A grammar's state along one reply."""

    def __init__(self, matcher, vocab: int):
        self._start = matcher.deep_copy()  # to begin again from
        self._m = matcher
        self._taken: list[int] = []  # the reply tokens it has consumed
        self.vocab = vocab

    def at(self, reply: Sequence[int]) -> None:
        """Follow the reply: consume its tokens not yet consumed; begin again if the reply is not an extension
        of what it consumed (so its state is always a function of the reply alone)."""
        n = len(self._taken)
        if len(reply) < n or list(reply[:n]) != self._taken:
            self._m, self._taken, n = self._start.deep_copy(), [], 0
        for t in reply[n:]:
            if not self._m.consume_token(int(t)):
                raise TfqError(f"the reply left its grammar at token {t}: {_one_line(self._m.get_error())}")
            self._taken.append(int(t))

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next (an end-of-sequence token only where it may end)."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if self._m.is_error():
            raise TfqError(f"the grammar failed: {_one_line(self._m.get_error())}")
        return np.unpackbits(bits, bitorder="little")[:self.vocab].view(bool)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, after the reply so far, the grammar allows in a row (a drafter's guesses)."""
        return int(self._m.validate_tokens([int(t) for t in tokens])) if tokens else 0


def _one_line(reason: str) -> str:
    """llguidance's reason, which may run over lines, as one bounded line."""
    return " ".join(reason.split())[:300] or "no reason given"


class OwnMask:
    """Each row's mask, computed for that row alone (what production does)."""

    def __call__(self, matcher: Matcher) -> np.ndarray:
        return matcher.allowed()


class SharedMask:
    """A check's control: one mask buffer for every row the engine draws, or-ed into and never cleared, so a row
    may draw a token only another row's grammar allows: its reply then depends on the batch (RED)."""

    def __init__(self):
        self.buffer: np.ndarray | None = None

    def __call__(self, matcher: Matcher) -> np.ndarray:
        own = matcher.allowed()
        self.buffer = own.copy() if self.buffer is None else self.buffer | own
        return self.buffer
