"""The bench's runs: per lane count one engine an arm, a warm-up round, then rounds that interleave the arms
and the peer (the peer last on even rounds, first on odd ones), so each tfq/peer ratio comes from runs side
by side."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tfq.bench.measure import MemoryProbe
from tfq.bench.llama_peer import LlamaPeer
from tfq.bench.peer import HfPeer
from tfq.bench.runs import Run, TfqArm, ordinary_vocab, random_prompts
from tfq.bench.settings import BenchSettings, arm_plan, bench_window, skipped_arm
from tfq.model.config import ModelConfig
from tfq.plan import Plan

WARMUP_TOKENS = 8  # reply tokens of the warm-up round (the prompt is full length: every shape is met)
BREAKDOWN_STEPS = 4  # decode steps each pass of the per-op breakdown times (tfq.bench.breakdown)

Progress = Callable[[str], None]  # called before each run with what runs next


@dataclass
class Bench:
    base: Plan
    config: ModelConfig
    loaded: object  # tfq.model.load.LoadedModel
    settings: BenchSettings
    peer: HfPeer | LlamaPeer | None = None
    runs: list[Run] = field(default_factory=list)
    cache_bytes: dict = field(default_factory=dict)  # (lanes, arm) -> bytes the engine allocated
    plans: dict = field(default_factory=dict)  # (lanes, arm) -> the arm's Plan
    skipped: list[dict] = field(default_factory=list)
    breakdown: dict = field(default_factory=dict)  # lanes -> the whole arm's decode step split by op kind

    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.config.eos_token_ids) | frozenset(getattr(self.loaded.tokenizer, "eos_ids", ()))

    def arms_at(self, lanes: int) -> list[str]:
        return [a for a in self.settings.arms if skipped_arm(a, lanes) is None]

    def run_count(self) -> int:
        per = [len(self.arms_at(n)) + (self.peer is not None) for n in self.settings.lanes]
        breakdowns = sum(bool(self.arms_at(n)) and self.arms_at(n)[0] == "whole" for n in self.settings.lanes)
        return sum(per) * (self.settings.repeats + 1) + breakdowns

    def run(self, progress: Progress = lambda what: None) -> None:
        s = self.settings
        window = bench_window(self.base, s)
        vocab = ordinary_vocab(self.config, self.loaded.tokenizer)
        probe = MemoryProbe()
        for lanes in s.lanes:
            for arm in s.arms:
                why = skipped_arm(arm, lanes)
                if why:
                    self.skipped.append({"lanes": lanes, "arm": arm, "why": why})
            prompts = random_prompts(lanes, s.prompt_tokens, vocab, s.seed + lanes)
            engines = []
            for arm in self.arms_at(lanes):
                plan = arm_plan(self.base, arm, lanes, window)
                engines.append(TfqArm(arm, plan, plan.layout(self.config), self.loaded))
                self.plans[lanes, arm], self.cache_bytes[lanes, arm] = plan, engines[-1].cache_bytes
            if self.peer is not None:
                self.peer.prepare(lanes, window)
            runners = engines + ([self.peer] if self.peer is not None else [])
            for round_ in range(-1, s.repeats):
                order = runners if round_ % 2 == 0 or round_ < 0 else runners[-1:] + runners[:-1]
                tokens = min(s.tokens, WARMUP_TOKENS) if round_ < 0 else s.tokens
                for runner in order:
                    name = runner.name if isinstance(runner, TfqArm) else f"peer ({runner.name})"
                    what = "warm-up" if round_ < 0 else f"round {round_ + 1}/{s.repeats}"
                    progress(f"lanes {lanes}: {name}, {what}")
                    run = runner.run(prompts, tokens, round_, probe)
                    if round_ >= 0:
                        self.runs.append(run)
            if engines and engines[0].name == "whole":
                progress(f"lanes {lanes}: where a whole decode step's time goes")
                self.breakdown[lanes] = engines[0].breakdown(prompts, BREAKDOWN_STEPS)
            del engines, runners  # free this lane count's caches before the next
