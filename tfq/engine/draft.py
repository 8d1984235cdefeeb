"""Drafters: cheap guesses at a stream's next tokens, which the target model verifies in one forward.

A guess only decides how many rows a verify forward holds; which tokens a stream keeps is decided by the
target's own logits, row by row, so a reply is the same with any drafter or none (docs/contract.md).
"""
from __future__ import annotations

from typing import Protocol

from tfq.engine.batch import Feed, forward
from tfq.engine.cache import CacheSpec, KVCache
from tfq.engine.stream import Stream
from tfq.errors import TfqError

NGRAM_LONGEST = 3  # the longest suffix prompt lookup tries to match


class Drafter(Protocol):
    k: int

    def propose(self, streams: list[Stream], budgets: list[int]) -> list[list[int]]:
        """Up to budgets[i] guessed tokens to follow streams[i].tokens (the stream's first stream.cached tokens
        are true: the target holds them; a drafter that keeps state trims what it ran past them first)."""


class NgramDrafter:
    """Prompt lookup: continue the latest earlier occurrence of the stream's last n tokens (n = 3, 2, 1)."""

    def __init__(self, k: int = 4):
        self.k = k

    def propose(self, streams: list[Stream], budgets: list[int]) -> list[list[int]]:
        return [lookup(st.tokens, b) for st, b in zip(streams, budgets)]


def accepted(guesses: list[int], draws: list[int]) -> int:
    """How many guesses the draws confirm: draw j confirms guess j when it equals it and every draw before it
    confirmed its own. A stream draws on while its draws all confirm (the row after a kept guess is right), so
    the draw after the last confirmed guess is its last in that forward."""
    kept = 0
    for guess, draw in zip(guesses, draws):
        if guess != draw:
            break
        kept += 1
    return kept


def lookup(tokens: list[int], k: int, longest: int = NGRAM_LONGEST) -> list[int]:
    if k <= 0:
        return []
    for n in range(min(longest, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):  # latest match first, never the tail itself
            if tokens[i:i + n] == tail:
                return tokens[i + n:i + n + k]
    return []


class ModelDrafter:
    """A small model guessing greedily, with its own contiguous cache per lane of the engine.

    What a lane's cache holds belongs to one stream's one admission (its id and times preempted): another
    starts over. Before guessing, a stream's rows are trimmed to the tokens the target holds (stream.cached),
    which drops the guesses of the last verify whatever it kept. A hybrid drafter's state cannot be cut back
    to a position as its keys can: after catching up with a stream's true tokens it copies its state to a
    checkpoint slot (lanes + lane), and trimming past it brings that checkpoint back."""

    def __init__(self, model, lanes: int, window: int, k: int = 4):
        self.model = model
        self.k = k
        self.lanes = lanes
        self.cache = KVCache(model.config, CacheSpec(lanes=lanes, window=window, slots=2 * lanes),
                             backend=model.backend)
        self.owner: dict[int, tuple[int, int]] = {}  # lane -> (stream id, times preempted) its rows are of
        self.cached: dict[int, int] = {}  # lane -> positions in the drafter's cache
        self.checkpoint: dict[int, int] = {}  # hybrid: lane -> positions its checkpoint holds

    def propose(self, streams: list[Stream], budgets: list[int]) -> list[list[int]]:
        for st in streams:
            self.settle(st)
        guesses: list[list[int]] = [[] for _ in streams]
        feeds = {i: st.tokens[self.cached[st.lane]:] for i, st in enumerate(streams)}
        for _ in range(max(budgets, default=0)):
            active = [i for i, st in enumerate(streams) if len(guesses[i]) < budgets[i]]
            if not active:
                break
            batch = [Feed(self.cache.pages.lane(streams[i].lane), self.cached[streams[i].lane], feeds[i])
                     for i in active]
            for i, logits in zip(active, forward(self.model, self.cache, batch)):
                lane = streams[i].lane
                self.cached[lane] += len(feeds[i])
                if self.cache.state is not None and not guesses[i]:  # caught up with the true tokens
                    self.model.copy_state(self.cache, lane, self.lanes + lane)
                    self.checkpoint[lane] = self.cached[lane]
                guesses[i].append(int(logits[-1].argmax()))
                feeds[i] = guesses[i][-1:]
        return guesses

    def settle(self, stream: Stream) -> None:
        """The lane's rows trimmed to the stream's true tokens (stream.cached positions); none if they are
        another stream's, or of an earlier admission of this one."""
        lane, who = stream.lane, (stream.id, stream.preempted)
        if self.owner.get(lane) != who:
            self.owner[lane], self.cached[lane] = who, 0
            self.checkpoint.pop(lane, None)
        held = self.cached[lane]
        if self.cache.state is not None and held > stream.cached:  # it ran past a rejected guess
            self.model.copy_state(self.cache, self.lanes + lane, lane)
            held = self.checkpoint.get(lane, 0)
        self.cached[lane] = min(held, stream.cached)


def make_drafter(spec: str, target, lanes: int, window: int) -> Drafter | None:
    """none | ngram | ngram:K | self (the target drafts for itself) | a checkpoint (folder or .gguf) sharing
    the target's tokenizer. target: tfq.model.load.LoadedModel."""
    from tfq.plan import parse_draft

    kind, k = parse_draft(spec)
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(k or 4)
    if spec == "self":
        return ModelDrafter(target.model, lanes, window)
    from tfq.model.load import load_model

    loaded = load_model(spec, device=target.model.backend.device)
    probe = "def f(x):\n    return x * 2  # 你好 🚀"
    if loaded.tokenizer.vocab_size != target.tokenizer.vocab_size or \
            loaded.tokenizer.encode(probe) != target.tokenizer.encode(probe):
        raise TfqError(f"draft model {spec} does not share the target's tokenizer; pick a drafter of the same "
                       f"family and vocabulary, or use draft: ngram")
    return ModelDrafter(loaded.model, lanes, window)
