"""What the engine tests share: an engine on a model with the settings and controls a test names, its results,
each request's run alone (the rule's reference), and the comparisons of results bit for bit."""
from __future__ import annotations

import weakref
from dataclasses import fields, replace

import torch

from tfq.engine.batch import Feed, forward
from tfq.engine.cache import CacheSpec, KVCache
from tfq.engine.core import Controls, Engine, EngineSettings
from tfq.engine.stream import Request, Result
from tfq.proofs.case import same_bits

WINDOW = 512
SETTINGS = frozenset(f.name for f in fields(EngineSettings))
CONTROLS = frozenset(f.name for f in fields(Controls))


def engine(model, settings: EngineSettings | None = None, **kw) -> Engine:
    """An engine on `model`. Its settings: `settings` (default: window 512, one lane) with the keywords that name
    EngineSettings' fields put in; its controls: `controls` (default: none) with the keywords that name Controls'
    fields (arithmetic, page_order_seed, mask, compile) put in; the other keywords go to Engine (no EOS unless
    given)."""
    settings_kw = {k: kw.pop(k) for k in list(kw) if k in SETTINGS}
    controls_kw = {k: kw.pop(k) for k in list(kw) if k in CONTROLS}
    settings = replace(settings or EngineSettings(window=WINDOW, lanes=1), **settings_kw)
    if controls_kw:
        kw["controls"] = replace(kw.get("controls", Controls()), **controls_kw)
    kw.setdefault("eos_ids", ())
    return Engine(model, settings, **kw)


def run(model, requests: list[Request], settings: EngineSettings | None = None, **kw) -> list[Result]:
    """The requests' results through one engine (engine()'s arguments)."""
    return engine(model, settings, **kw).generate(requests)


def run_on(model, requests: list[Request], settings: EngineSettings | None = None,
           **kw) -> tuple[list[Result], Engine]:
    """run()'s results and the engine that gave them, for what it counted (preemptions, its drafter's guesses)."""
    e = engine(model, settings, **kw)
    return e.generate(requests), e


def alone(model, requests: list[Request], settings: EngineSettings | None = None, **kw) -> list[Result]:
    """Each request's result from a fresh engine of its own (engine()'s arguments: one lane unless given): the
    run alone that the exactness rule compares every other run with."""
    return [run(model, [r], settings, **kw)[0] for r in requests]


def one_by_one(e: Engine, requests: list[Request]) -> list[Result]:
    """Each request's result alone through the one engine `e`, one after another: an engine compiles a grammar
    once, so where requests are constrained this is the run alone at a fresh engine's cost of one."""
    return [e.generate([r])[0] for r in requests]


_ALONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(request, settings): Result}


def alone_once(model, request: Request, **settings) -> Result:
    """alone() of one request on an engine whose settings are window 512 and one lane with the EngineSettings
    fields `settings` put in, computed once per model, request and settings (hypothesis draws the same requests
    again and again) and kept while the model lives, without logits rows."""
    known = _ALONE.setdefault(model, {})
    key = (request, replace(EngineSettings(window=WINDOW, lanes=1), **settings))
    if key not in known:
        known[key] = run(model, [request], key[1])[0]
    return known[key]


def bits(results: list[Result]) -> list[tuple[list[int], list[str]]]:
    """What the rule compares: each stream's token ids and the digests of its logits rows."""
    return [(r.ids, r.digests) for r in results]


def same(a: Result, b: Result) -> bool:
    """Equal ids and logits rows bit for bit (the engines kept their logits)."""
    return a.ids == b.ids and len(a.logits) == len(b.logits) and all(map(same_bits, a.logits, b.logits))


def all_same(a: list[Result], b: list[Result]) -> bool:
    """As many results, each pair same() (the engines kept their logits)."""
    return len(a) == len(b) and all(map(same, a, b))


def one_forward(loaded, ids: list[int], window: int = WINDOW) -> torch.Tensor:
    """The logits of every row of one prompt in one forward, from an empty cache of one lane."""
    cache = KVCache(loaded.config, CacheSpec(lanes=1, window=window, slots=1))
    return forward(loaded.model, cache, [Feed(cache.pages.lane(0), 0, ids, len(ids))])[0]
