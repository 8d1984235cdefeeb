"""What the engine tests share: an engine on a model with the settings a test names, its results, and the
comparisons of results bit for bit."""
from __future__ import annotations

import torch

from tfq.engine.batch import Feed, forward
from tfq.engine.cache import CacheSpec, KVCache
from tfq.engine.core import Engine, EngineSettings
from tfq.proofs.case import same_bits
from tfq.engine.stream import Request, Result

WINDOW = 512


def engine(model, settings: EngineSettings | None = None, **kw) -> Engine:
    """An engine on `model`: `settings`, or EngineSettings made of the keywords that name its fields (window 512
    and one lane unless given); the other keywords go to Engine (no EOS unless given)."""
    fields = {k: kw.pop(k) for k in list(kw) if k in EngineSettings.__dataclass_fields__}
    kw.setdefault("eos_ids", ())
    return Engine(model, settings or EngineSettings(**{"window": WINDOW, "lanes": 1, **fields}), **kw)


def run(model, requests: list[Request], settings: EngineSettings | None = None, **kw) -> list[Result]:
    """The requests' results through one engine (engine()'s arguments)."""
    return engine(model, settings, **kw).generate(requests)


def bits(results: list[Result]) -> list[tuple[list[int], list[str]]]:
    """What the rule compares: each stream's token ids and the digests of its logits rows."""
    return [(r.ids, r.digests) for r in results]


def same(a: Result, b: Result) -> bool:
    """Equal ids and logits rows bit for bit (the engines kept their logits)."""
    return a.ids == b.ids and len(a.logits) == len(b.logits) and all(map(same_bits, a.logits, b.logits))


def one_forward(loaded, ids: list[int], window: int = WINDOW) -> torch.Tensor:
    """The logits of every row of one prompt in one forward, from an empty cache of one lane."""
    cache = KVCache(loaded.config, CacheSpec(lanes=1, window=window, slots=1))
    return forward(loaded.model, cache, [Feed(cache.pages.lane(0), 0, ids, len(ids))])[0]
