"""One timed run of tfq: the same random prompts for every arm; a run's figures are tfq.bench.record's."""
from __future__ import annotations

import torch

from tfq.bench.memory import MemoryProbe
from tfq.bench.record import Run
from tfq.engine.stream import Request
from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.plan import Layout, Plan

NO_EOS = (-1,)  # an id no vocabulary holds: a bench reply always runs to its full length


class TfqArm:
    """One engine for one arm and lane count, reused by every round (its cache is allocated once)."""

    def __init__(self, name: str, plan: Plan, layout: Layout, loaded):
        from tfq.engine.core import Engine

        self.name, self.plan = name, plan
        self.engine = Engine.from_plan(plan, layout, loaded, eos_ids=NO_EOS, threads=None)  # counts stay as set

    @property
    def cache_bytes(self) -> int:
        return self.engine.cache.nbytes

    def run(self, prompts: list[list[int]], tokens: int, round_: int, probe: MemoryProbe) -> Run:
        requests = [Request(tuple(p), max_tokens=tokens, label=f"s{i}") for i, p in enumerate(prompts)]
        prefill_forwards = -(-len(prompts[0]) // self.plan.prefill_chunk)
        before = self.engine.forwards
        probe.start()
        results = self.engine.generate(requests)
        peak, grown = probe.stop()
        for r in results:
            if r.error:
                raise TfqError(f"bench arm {self.name}: {r.error}")
        return Run("tfq", self.name, len(prompts), round_, max(r.first_token_s for r in results),
                   max(r.total_s for r in results), self.engine.forwards - before - prefill_forwards,
                   [list(r.ids) for r in results], peak, grown,
                   proposed=sum(r.proposed for r in results), accepted=sum(r.accepted for r in results))


    def breakdown(self, prompts: list[list[int]], steps: int) -> dict:
        """Where a decode step's time goes with these streams past their prompts (tfq.bench.breakdown)."""
        from tfq.bench.breakdown import step_breakdown

        ids = [self.engine.add(Request(tuple(p), max_tokens=2 * steps + 2, label=f"s{i}"))
               for i, p in enumerate(prompts)]
        try:
            while any(self.engine.streams[i].cached < len(p) for i, p in zip(ids, prompts)):
                self.engine.step()  # prefill (and the first draw)
            return step_breakdown(self.engine, steps)
        finally:
            for i in ids:
                self.engine.abort(i)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def ordinary_vocab(config: ModelConfig, tokenizer) -> int:
    """Ids below the first added (special) token: what random prompts draw from."""
    top = config.vocab_size
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        top = min(top, tokenizer.vocab_size)
        added = getattr(backend, "get_added_tokens_decoder", lambda: {})()
        if added and min(added) > 0:
            top = min(top, min(added))
    return top
