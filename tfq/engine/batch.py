"""One forward's rows: from what each stream feeds to the tensors the model and the attention take."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tfq.engine.cache import KVCache
from tfq.engine.pages import Placement
from tfq.kernels.attention import AttentionBatch, Chunk, DecodeGroup, tile_count
from tfq.kernels.contract import KEY_TILE
from tfq.kernels.layer import DrawFacts
from tfq.model.segments import Segment, Segments


@dataclass
class Feed:
    """Tokens one stream brings to a forward, at positions start, start+1, ..."""

    placement: Placement
    start: int
    tokens: list[int]
    logits: int = 1  # how many of its last rows need logits (0: none)
    guesses: int = 0  # of its tokens, the last ones a drafter guessed (a verify: a hybrid saves its state first)

    @property
    def chunk(self) -> int:
        """Rows of the stream's own tokens (a prompt chunk, or the token it drew last); its guesses follow."""
        return len(self.tokens) - self.guesses


@dataclass(frozen=True)
class Arithmetic:
    """How one forward computes: the plan's (the same for every forward, whatever it holds), or a check's
    control (tfq/engine/runner.py's policies). Carried by the forward's rows, never by a flag through the model."""

    partial: bool = False  # attention by the `partial` recipe (tfq/kernels/attention.py)
    chunked_deltanet: bool = False  # a hybrid's prompt chunks by the chunked DeltaNet algorithm: a control only
    experts_by_load: bool = False  # a mixture's experts combined in the batch's order of load: a control only


@dataclass
class StepRows:
    """A forward's tensors: every feed's rows concatenated in feed order."""

    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    cache_rows: torch.Tensor  # [N] where each row's key and value are stored
    batch: AttentionBatch
    logit_rows: torch.Tensor  # rows whose logits are drawn from, feed by feed
    counts: list[int]  # logits rows of each feed
    segments: Segments
    facts: DrawFacts | None = None  # what the one object's head says of each logits row (DecodeRows' tables)


def step_rows(cache: KVCache, feeds: list[Feed], arithmetic: Arithmetic) -> StepRows:
    """Built in numpy lists and arrays, each turned into a tensor once: torch.tensor of a list costs several
    microseconds a call, more on the caches a forward left cold."""
    ids, positions, write_rows, logit_rows = [], [], [], []
    decode, chunks, segments = [], [], []
    row = 0
    for f in feeds:
        n = len(f.tokens)
        segments.append(Segment(row, n, f.placement.slot, f.start == 0, f.guesses > 0))
        ids.extend(f.tokens)
        positions.extend(range(f.start, f.start + n))
        write_rows.append(cache.row_array(f.placement, f.start, n))
        if n == 1:
            decode.append((row, f))
        else:
            chunks.append(Chunk(row, n, f.start, cache.key_rows(f.placement, f.start + n)))
        logit_rows.extend(range(row + n - f.logits, row + n))
        row += n
    return StepRows(_longs(ids), _longs(positions), torch.from_numpy(np.concatenate(write_rows)),
                    AttentionBatch(_decode_group(cache, decode), chunks, arithmetic.partial), _longs(logit_rows),
                    [f.logits for f in feeds],
                    Segments.of(segments, arithmetic.chunked_deltanet, arithmetic.experts_by_load))


def _longs(values: list) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))


class DecodeRows:
    """The tables of the last forward whose every feed was one decode row (one token of its own, past position 0,
    its logits drawn), kept and rewritten in place while what they hold beyond each row's token and position is
    the same: the feeds' lanes, key tiles and the blocks those tiles lie on. A decode step at one lane spent a
    sixth of a millisecond building them anew from fifteen small arrays, each cold after the weights streamed
    through the caches. The same values as step_rows by construction (tests/unit/test_engine_decisions.py checks
    them equal). One owner: the runner of one cache, whose forwards read the tables before the next is made."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.kept: StepRows | None = None
        self.key: tuple = ()
        self.served = False  # the last forward ran on these tables
        self.stamp = 0  # advanced every forward they serve: the facts of that forward carry it
        self._ids = self._positions = self._rows = self._lengths = self._facts = None  # numpy views of the tensors

    def rows(self, feeds: list[Feed], arithmetic: Arithmetic) -> StepRows:
        self.served = all(len(f.tokens) == 1 and f.logits == 1 and f.guesses == 0 and f.start > 0 for f in feeds)
        if not self.served:
            return step_rows(self.cache, feeds, arithmetic)
        self.stamp += 1
        key = (arithmetic, tuple(self._holds(f) for f in feeds))
        if key != self.key:  # () at first: no forward's key
            self.kept, self.key = step_rows(self.cache, feeds, arithmetic), key
            self.kept.facts = DrawFacts.blank(len(feeds), self.stamp)
            d = self.kept.batch.decode
            self._ids, self._positions, self._rows, self._lengths, self._facts = (t.numpy() for t in (
                self.kept.ids, self.kept.positions, self.kept.cache_rows, d.lengths, self.kept.facts.table))
            return self.kept
        self.kept.facts.stamp = self.stamp
        for i, f in enumerate(feeds):
            self._ids[i], self._positions[i], self._lengths[i] = f.tokens[0], f.start, f.start + 1
            self._rows[i] = f.placement.row(f.start)
        self.kept.batch.memo.clear()  # what the attention derived from the last step's lengths
        self.kept.batch.decode.memo.clear()
        return self.kept

    def drawn(self, i: int) -> tuple[bool, int] | None:
        """What the last forward's one object said of feed i's logits row: (every value finite, its first
        largest); None where that forward did not run on these tables or its head ran elsewhere."""
        if not self.served:
            return None
        finite, first, stamp = self._facts[i].tolist()
        return (finite == 1, first) if stamp == self.stamp else None

    @staticmethod
    def _holds(f: Feed) -> tuple:
        """What a decode row's tables hold beside its token and position: its lane, its key tiles and the blocks
        they lie on (a stream's tiles lie on its first blocks: a lane's one, a paged stream's pages)."""
        p = f.placement
        padded = tile_count(f.start + 1) * KEY_TILE
        return p.slot, p.paged, p.block_rows, padded, tuple(p.blocks[:-(-padded // p.block_rows)])


def forward(model, cache: KVCache, feeds: list[Feed], arithmetic: Arithmetic = Arithmetic(),
            kept: DecodeRows | None = None) -> list[torch.Tensor]:
    """Run every feed in one forward (cache first), in `arithmetic`; returns each feed's logits rows
    [logits, vocab]. `kept`: the runner's decode tables, rewritten in place where they serve."""
    s = kept.rows(feeds, arithmetic) if kept is not None else step_rows(cache, feeds, arithmetic)
    cache.ahead.before(s.cache_rows.numpy())
    logits = model.forward(s.ids, s.positions, cache, s.cache_rows, s.batch, s.logit_rows, s.segments, s.facts)
    return [logits] if len(s.counts) == 1 else list(logits.split(s.counts))  # split: tens of us a step at one lane


def _decode_group(cache: KVCache, decode: list[tuple[int, Feed]]) -> DecodeGroup | None:
    if not decode:
        return None
    lengths = [f.start + 1 for _, f in decode]
    keys = [cache.key_row_array(f.placement, n) for (_, f), n in zip(decode, lengths)]
    if len(keys) == 1:  # one lane: its own rows, no padding
        rows = keys[0][None]
    else:
        rows = np.zeros((len(keys), max(len(k) for k in keys)), dtype=np.int64)
        for i, k in enumerate(keys):
            rows[i, :len(k)] = k  # past a stream's own tiles: row 0, masked
    return DecodeGroup(_longs([r for r, _ in decode]), torch.from_numpy(rows), _longs(lengths))
