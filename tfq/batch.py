"""One forward's rows: from what each stream feeds to the tensors the model and the attention take."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionBatch, Chunk, DecodeGroup
from tfq.cache import KVCache, Placement


@dataclass
class Feed:
    """Tokens one stream brings to a forward, at positions start, start+1, ..."""

    placement: Placement
    start: int
    tokens: list[int]
    logits: int = 1  # how many of its last rows need logits (0: none)


def forward(model, cache: KVCache, feeds: list[Feed], partial: bool) -> list[torch.Tensor]:
    """Run every feed in one forward (cache first); returns each feed's logits rows [logits, vocab]."""
    ids, positions, write_rows, logit_rows = [], [], [], []
    decode, chunks = [], []
    row = 0
    for f in feeds:
        n = len(f.tokens)
        ids.extend(f.tokens)
        positions.extend(range(f.start, f.start + n))
        write_rows.append(cache.rows(f.placement, f.start, n))
        if n == 1:
            decode.append((row, f))
        else:
            chunks.append(Chunk(row, n, f.start, cache.key_rows(f.placement, f.start + n)))
        logit_rows.extend(range(row + n - f.logits, row + n))
        row += n
    batch = AttentionBatch(_decode_group(cache, decode), chunks, partial)
    logits = model.forward(torch.tensor(ids), torch.tensor(positions), cache, torch.cat(write_rows), batch,
                           torch.tensor(logit_rows, dtype=torch.long))
    return list(logits.split([f.logits for f in feeds]))


def _decode_group(cache: KVCache, decode: list[tuple[int, Feed]]) -> DecodeGroup | None:
    if not decode:
        return None
    lengths = [f.start + 1 for _, f in decode]
    keys = [cache.key_rows(f.placement, n) for (_, f), n in zip(decode, lengths)]
    rows = torch.zeros(len(keys), max(len(k) for k in keys), dtype=torch.long)
    for i, k in enumerate(keys):
        rows[i, :len(k)] = k  # past a stream's own tiles: row 0, masked
    return DecodeGroup(torch.tensor([r for r, _ in decode]), rows, torch.tensor(lengths))
