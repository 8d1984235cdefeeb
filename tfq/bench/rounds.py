"""The bench's runs: per lane count one engine an arm, a warm-up round, then rounds that interleave the arms
and the peer (the peer last on even rounds, first on odd ones), so each tfq/peer ratio comes from runs side
by side. A peer too large to sit beside tfq runs apart instead (run_apart), before tfq loads. A peer that
fails drops out with one line: its runs at that lane count go, tfq's stand."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tfq.bench.memory import MemoryProbe
from tfq.bench.peers.choice import PeerSide
from tfq.bench.peers.parent_end import ChildPeer, PeerFailed
from tfq.bench.record import Run
from tfq.bench.runs import TfqArm, ordinary_vocab, random_prompts
from tfq.bench.settings import BenchSettings, arm_plan, bench_window, skipped_arm
from tfq.model.config import ModelConfig
from tfq.plan import Plan

WARMUP_TOKENS = 8  # reply tokens of the warm-up round
# prompt tokens of the warm-up round, at least: it meets every shape a round meets (prompt chunks of up to
# prefill_chunk rows, decode rows), and a longer prompt only repeats them (a 32k prompt's warm-up would
# double a long-context bench)
WARMUP_PROMPT = 1024
BREAKDOWN_STEPS = 4  # decode steps each pass of the per-op breakdown times (tfq.bench.breakdown)

Progress = Callable[[str], None]  # called before each run with what runs next


@dataclass
class Bench:
    base: Plan
    config: ModelConfig
    loaded: object  # tfq.model.load.LoadedModel
    settings: BenchSettings
    peer: PeerSide | None = None
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
        per = [len(self.arms_at(n)) + (self.peer is not None and self.peer.beside is not None)
               for n in self.settings.lanes]
        breakdowns = sum(bool(self.arms_at(n)) and self.arms_at(n)[0] == "whole" for n in self.settings.lanes)
        return sum(per) * (self.settings.repeats + 1) + breakdowns

    def run(self, progress: Progress = lambda what: None) -> None:
        s = self.settings
        window = bench_window(self.base, s)
        vocab = ordinary_vocab(self.config, self.loaded.tokenizer)
        probe = MemoryProbe()
        if self.peer is not None:
            self.runs += self.peer.runs  # made apart, before tfq loaded
        for lanes in s.lanes:
            for arm in s.arms:
                why = skipped_arm(arm, lanes)
                if why:
                    self.skipped.append({"lanes": lanes, "arm": arm, "why": why})
            prompts = bench_prompts(s, lanes, vocab)
            engines = []
            for arm in self.arms_at(lanes):
                plan = arm_plan(self.base, arm, lanes, window)
                engines.append(TfqArm(arm, plan, plan.layout(self.config), self.loaded))
                self.plans[lanes, arm], self.cache_bytes[lanes, arm] = plan, engines[-1].cache_bytes
            peer = self._prepared_peer(lanes, window)
            runners = engines + ([peer] if peer is not None else [])
            for round_ in range(-1, s.repeats):
                order = runners if round_ % 2 == 0 or round_ < 0 else runners[-1:] + runners[:-1]
                for runner in list(order):
                    name = runner.name if isinstance(runner, TfqArm) else f"peer ({runner.name})"
                    progress(f"lanes {lanes}: {name}, {round_words(round_, s.repeats)}")
                    try:
                        run = runner.run(round_prompts(prompts, self.base, round_), round_tokens(s, round_),
                                         round_, probe)
                    except PeerFailed as e:
                        self._drop_peer(e, lanes)
                        runners.remove(runner)
                        continue
                    if round_ >= 0:
                        self.runs.append(run)
            if engines and engines[0].name == "whole":
                progress(f"lanes {lanes}: where a whole decode step's time goes")
                self.breakdown[lanes] = engines[0].breakdown(prompts, BREAKDOWN_STEPS)
            del engines, runners  # free this lane count's caches before the next

    def _prepared_peer(self, lanes: int, window: int) -> ChildPeer | None:
        """The peer sized for this lane count, when it runs beside the arms (None once it failed)."""
        peer = self.peer.beside if self.peer is not None else None
        if peer is not None:
            try:
                peer.prepare(lanes, window)
            except PeerFailed as e:
                self._drop_peer(e, lanes)
                return None
        return peer

    def _drop_peer(self, e: PeerFailed, lanes: int) -> None:
        """The peer's line printed; its runs at this lane count go (a row is whole rounds or none)."""
        self.peer.fail(e)
        self.runs = [r for r in self.runs if not (r.lanes == lanes and r.arm == "peer")]


def run_apart(peer: PeerSide, settings: BenchSettings, plan: Plan, config: ModelConfig, threads: int,
              progress: Progress = lambda what: None) -> None:
    """The peer alone, before tfq loads: every lane count's warm-up and rounds, on the prompts the arms will
    get; then its process exits. A failure keeps the lane counts it finished."""
    from tfq.model.source import resolve_model
    from tfq.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model(plan.model, progress=False, weights=False))
    vocab, window, probe = ordinary_vocab(config, tokenizer), bench_window(plan, settings), MemoryProbe()
    engine, lanes = peer.engine, 0
    try:
        engine.load(peer.path, threads)
        for lanes in settings.lanes:
            prompts = bench_prompts(settings, lanes, vocab)
            engine.prepare(lanes, window)
            for round_ in range(-1, settings.repeats):
                progress(f"lanes {lanes}: peer ({peer.name}) apart, {round_words(round_, settings.repeats)}")
                run = engine.run(round_prompts(prompts, plan, round_), round_tokens(settings, round_), round_, probe)
                if round_ >= 0:
                    peer.runs.append(run)
    except PeerFailed as e:
        peer.runs = [r for r in peer.runs if r.lanes != lanes]
        peer.fail(e)
    finally:
        engine.close()


def apart_run_count(settings: BenchSettings) -> int:
    return len(settings.lanes) * (settings.repeats + 1)


def bench_prompts(s: BenchSettings, lanes: int, vocab: int) -> list[list[int]]:
    """The prompts of a lane count: the same for every arm and the peer, beside or apart."""
    return random_prompts(lanes, s.prompt_tokens, vocab, s.seed + lanes)


def round_prompts(prompts: list[list[int]], plan: Plan, round_: int) -> list[list[int]]:
    """A round's prompts: the warm-up's cut to WARMUP_PROMPT tokens, or to the plan's prefill chunk if longer."""
    return [p[:max(WARMUP_PROMPT, plan.prefill_chunk)] for p in prompts] if round_ < 0 else prompts


def round_tokens(s: BenchSettings, round_: int) -> int:
    return min(s.tokens, WARMUP_TOKENS) if round_ < 0 else s.tokens


def round_words(round_: int, repeats: int) -> str:
    return "warm-up" if round_ < 0 else f"round {round_ + 1}/{repeats}"
