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
from typing import Callable, Sequence

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


# llguidance's limits on a grammar and on the work of each token, written out (its defaults, documented in
# docs/serve.md): a grammar past them is refused when it is compiled, a reply past them fails its own stream.
# A compiled matcher caches the lexer states it builds and counts them against max_lexer_states for its life,
# and copies of a matcher share that cache; so each stream compiles its own matcher (OwnCompile) and checks a
# drafter's guesses on a second one of its own: whether a limit is reached is then a function of the stream's
# own reply, never of the requests before it or beside it.
LIMITS = (("max_items_in_row", 2000), ("initial_lexer_fuel", 1_000_000), ("step_lexer_fuel", 200_000),
          ("step_max_items", 50_000), ("max_lexer_states", 250_000), ("max_grammar_size", 500_000))


@dataclass(frozen=True)
class OwnCompile:
    """How a stream's matcher is made (production): compiled afresh from the grammar's text."""

    limits: tuple[tuple[str, int], ...] = LIMITS

    def __call__(self, llg, text: str):
        import llguidance

        return llguidance.LLMatcher(llg, text, log_level=0, limits=llguidance.LLParserLimits(**dict(self.limits)))


class SharedCompile:
    """A check's control: one compiled matcher a grammar, each stream handed a copy (what tfq did before). The
    copies share the lexer's cache of states and its limit, so a stream fails or not by the streams that walked
    the grammar before it (RED)."""

    def __init__(self, limits: tuple[tuple[str, int], ...] = LIMITS):
        self.own = OwnCompile(limits)
        self.kept: dict[str, object] = {}

    def __call__(self, llg, text: str):
        if text not in self.kept:
            self.kept[text] = self.own(llg, text)
        return self.kept[text].deep_copy()


@dataclass(frozen=True)
class Grammar:
    """A constraint llguidance accepted: its grammar text, compiled afresh for every stream that follows it."""

    constraint: Constraint
    text: str


class Grammars:
    """One model's grammars: llguidance's view of its tokenizer (built once, about a second), the grammars it
    accepted, and each stream's matchers. probes: streams check a drafter's guesses (a matcher more each)."""

    KEPT = 64  # accepted grammars kept (a server's clients send the same schemas again and again)

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int], probes: bool = False,
                 compile_: Callable | None = None):
        try:
            import llguidance
        except ImportError:
            raise TfqError("structured outputs need llguidance; install it: pip install llguidance") from None
        self.vocab = vocab
        self.probes = probes
        self.compile = compile_ or OwnCompile()
        self.llg = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=sorted(eos_ids))
        self._accepted: OrderedDict[Constraint, Grammar] = OrderedDict()
        self._lock = threading.Lock()  # guards the dict only: no compile runs under it

    def check(self, constraint: Constraint) -> Grammar:
        """The constraint's grammar, once llguidance accepts it; a grammar it refuses raises TfqError with its
        reason. Accepted grammars are kept, never a matcher: a matcher carries the state of its walk."""
        with self._lock:
            kept = self._accepted.get(constraint)
            if kept is not None:
                self._accepted.move_to_end(constraint)
                return kept
        try:
            text = constraint.grammar()
            trial = self.compile(self.llg, text)
            reason = trial.get_error() if trial.is_error() else None
        except (ValueError, RuntimeError, TypeError) as e:
            reason = str(e)
        if reason is not None:
            raise TfqError(f"the {constraint.kind.replace('_', ' ')} cannot be used: {_one_line(reason)}")
        grammar = Grammar(constraint, text)
        with self._lock:
            self._accepted[constraint] = grammar
            while len(self._accepted) > self.KEPT:
                self._accepted.popitem(last=False)
        return grammar

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A stream's own matcher at the start of its reply (compiled here: a server calls it off the engine's
        thread)."""
        grammar = self.check(constraint)
        probe = _Walk(self.compile(self.llg, grammar.text)) if self.probes else None
        return Matcher(_Walk(self.compile(self.llg, grammar.text)), self.vocab, probe)


class _Walk:
    """A compiled matcher following a reply: it consumes the reply's tokens not yet consumed, and begins again
    from its own start when the reply is not an extension of what it consumed (a stream recomputed after
    preemption), so its state is a function of the reply alone."""

    def __init__(self, start):
        self._start = start  # never consumes: what it begins again from (a copy shares its own cache only)
        self.m = start.deep_copy()
        self._taken: list[int] = []

    def at(self, reply: Sequence[int]) -> None:
        n = len(self._taken)
        if len(reply) < n or list(reply[:n]) != self._taken:
            self.m, self._taken, n = self._start.deep_copy(), [], 0
        for t in reply[n:]:
            if not self.m.consume_token(int(t)):
                raise TfqError(f"the reply left its grammar at token {t}: {_one_line(self.m.get_error())}")
            self._taken.append(int(t))


class Matcher:
    """A grammar's state along one reply; `probe`, a matcher of its own that checks a drafter's guesses (so
    guesses the stream never draws build no lexer state in the stream's own matcher)."""

    def __init__(self, walk: _Walk, vocab: int, probe: _Walk | None = None):
        self._walk = walk
        self._probe = probe
        self.vocab = vocab

    def at(self, reply: Sequence[int]) -> None:
        """Follow the reply (its state is always a function of the reply alone)."""
        self._walk.at(reply)

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next (an end-of-sequence token only where it may end)."""
        m = self._walk.m
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        if m.is_error():
            raise TfqError(f"the grammar failed: {_one_line(m.get_error())}")
        return np.unpackbits(bits, bitorder="little")[:self.vocab].view(bool)

    def valid_prefix(self, reply: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of `tokens`, after `reply`, the grammar allows in a row (a drafter's guesses). 0 without a
        probe, or once the probe fails (a limit): guesses change no bits, so fewer of them is always exact."""
        if not tokens or self._probe is None:
            return 0
        try:
            self._probe.at(reply)
            n = int(self._probe.m.validate_tokens([int(t) for t in tokens]))
            if self._probe.m.is_error():
                raise TfqError(self._probe.m.get_error())
            return n
        except TfqError:
            self._probe = None
            return 0


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
