"""A model without weights, for the engine's model-free tests: the real Engine, scheduler, runner, cache and pages
around a forward that costs nothing.

Each forward stores every row's token and position in the cache (layer 0's keys, at the rows the engine gave),
then reads back, for each row that draws, the keys its attention batch names (a decode row's `lengths`, a chunk
row's keys up to its own position) and hashes them into a logits row of `vocab` fp32 values. So a row's bits
are a function of the tokens the cache holds at and before its position: a row the scheduler booked as cached but
never fed, or a page two streams wrote, would change them. `shaped` is the control: it also hashes how many rows
the forward holds, so a row's bits depend on its batch (what tfq's arithmetic never lets happen), and replies
together no longer equal replies alone.
"""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from tfq.kernels.contract import CACHE_DTYPES
from tfq.model.config import ModelConfig

VOCAB = 64


class Holds:
    """The stub's start-up record: it has no layer whose rows could depend on their batch (its forward is a hash
    of the cache's rows), so every thread count and forward size holds (tfq.engine.layer_guard.LayerProof)."""

    def holds(self, threads: int, rows: int, chunk: int, draws: int = 1) -> None:
        return None


class StubModel:
    def __init__(self, vocab: int = VOCAB, shaped: bool = False):
        self.config = ModelConfig(family="stub", vocab_size=vocab, hidden_size=2, intermediate_size=2, num_layers=1,
                                  num_heads=1, num_kv_heads=1, head_dim=2, rope_theta=1e4, rms_eps=1e-6,
                                  max_positions=4096, tie_embeddings=True, weights_dtype="float32")
        self.backend = SimpleNamespace(name="stub", device=torch.device("cpu"), interpreted=False)
        self.proved = {(dtype, partial): Holds() for dtype in CACHE_DTYPES for partial in (False, True)}
        self.shaped = shaped
        self.rows_run = 0  # rows through forward, in all

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, cache_rows: torch.Tensor, batch,
                logit_rows: torch.Tensor, segments=None, facts=None) -> torch.Tensor:  # facts: no object fills them
        keys = cache.k[0]
        keys[cache_rows, 0, 0] = ids.to(keys.dtype)
        keys[cache_rows, 0, 1] = (positions + 1).to(keys.dtype)  # 0: a row never written
        self.rows_run += len(ids)
        reads = {}  # forward row -> the store rows its attention reads, in position order
        if batch.decode is not None:
            for q, rows, n in zip(batch.decode.q_rows.tolist(), batch.decode.cache_rows, batch.decode.lengths.tolist()):
                reads[q] = rows[:n]
        for c in batch.chunks:
            for j in range(c.count):
                reads[c.q_start + j] = c.cache_rows[:c.first_pos + j + 1]
        extra = f"{len(ids)}".encode() if self.shaped else b""
        rows = [self._row(keys[reads[r], 0].float().numpy().tobytes() + extra) for r in logit_rows.tolist()]
        return torch.stack(rows) if rows else torch.zeros(0, self.config.vocab_size)

    def _row(self, seen: bytes) -> torch.Tensor:
        seed = int.from_bytes(hashlib.blake2b(seen, digest_size=8).digest(), "little") >> 1
        return torch.randn(self.config.vocab_size, generator=torch.Generator().manual_seed(seed))


class Guesser:
    """A drafter whose guesses the test controls: a stream's next tokens from `truth` (its label -> its reply
    alone), each one wrong where `wrong(position in the reply)` says, so some verifies keep every guess and
    others stop at a wrong one."""

    def __init__(self, truth: dict[str, list[int]], k: int = 3, wrong=lambda at: at % 4 == 2, vocab: int = VOCAB):
        self.truth, self.k, self.wrong, self.vocab = truth, k, wrong, vocab
        self.proposals: list[tuple[str, int, list[int]]] = []  # (label, tokens of the reply so far, guesses)

    def propose(self, streams, budgets: list[int]) -> list[list[int]]:
        out = []
        for st, budget in zip(streams, budgets):
            at = len(st.reply)
            right = self.truth[st.request.label][at:at + budget]
            out.append([(t + 1) % self.vocab if self.wrong(at + j) else t for j, t in enumerate(right)])
            if out[-1]:
                self.proposals.append((st.request.label, at, out[-1]))
        return out
