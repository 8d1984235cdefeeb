"""`tfq bench`: tfq's speed and memory under several arms, side by side with a peer engine on the same weights.

For each lane count every arm (whole, paged, partial, drafted) and the peer (HF transformers `generate`,
greedy, fp32, its own cache) run the same random-token prompts of exactly `prompt_tokens` ids for exactly
`tokens` reply tokens (tfq ignores EOS, the peer has min_new_tokens = max_new_tokens). A warm-up round comes
first; then `repeats` rounds, each running every arm and the peer once (peer last on even rounds, first on
odd ones), so each tfq/peer ratio is taken from runs side by side and a noisy machine hits both alike.
Figures are medians over the rounds.

The roofline: a decode step reads every linear weight and the output head once (the embedding is a lookup)
plus each stream's cached keys and values; divided by the memory bandwidth measured in this run, that is the
least time a step can take. fraction = that time / the measured step time.
"""
from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.plan import Plan, row_bytes
from tfq.stream import Request

ARMS = ("whole", "paged", "partial", "drafted")
ARM_ABOUT = {
    "whole": "every stream in a contiguous lane, rows attention, no drafting",
    "paged": "streams beyond the first on pages",
    "partial": "partial attention arithmetic instead of rows",
    "drafted": "n-gram drafts verified in the batch",
}
PEERS = ("hf", "none")
PAGE_ROWS = 256  # the paged arm's page rows when the plan has none
DRAFT = "ngram:4"  # the drafted arm's drafter when the plan drafts nothing
NO_EOS = (-1,)  # an id no vocabulary holds: a bench reply always runs to its full length
WARMUP_TOKENS = 8  # reply tokens of the warm-up round (the prompt is full length: every shape is met)
PEER_INSTALL = 'pip install -e ".[peer]"'
BANDWIDTH_MIB = 256  # well past any CPU cache
BANDWIDTH_TRIES = 7


@dataclass(frozen=True)
class BenchSettings:
    lanes: tuple[int, ...] = (1, 2, 4, 8)
    prompt_tokens: int = 128
    tokens: int = 32
    repeats: int = 3
    peer: str = "hf"
    arms: tuple[str, ...] = ARMS
    seed: int = 0
    threads: int | None = None  # torch threads for both engines; None: torch's default


# ------------------------------------------------------------------------------------------ bad input

def parse_lanes(text: str) -> tuple[int, ...]:
    """`1,2,4,8` -> (1, 2, 4, 8); anything else one TfqError line."""
    try:
        lanes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise TfqError(f"--lanes {text!r}: give lane counts separated by commas, e.g. 1,2,4,8") from None
    if not lanes:
        raise TfqError(f"--lanes {text!r}: give at least one lane count, e.g. 1,2,4,8")
    for n in lanes:
        if n < 1:
            raise TfqError(f"--lanes {n}: a lane count must be at least 1 (one stream), e.g. --lanes 1,2,4,8")
    return tuple(dict.fromkeys(lanes))


def parse_arms(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise TfqError(f"--arms names no arm; arms are {','.join(ARMS)}")
    for n in names:
        if n not in ARMS:
            raise TfqError(f"unknown arm {n!r}; arms are {','.join(ARMS)}")
    return names


def check_settings(s: BenchSettings) -> None:
    """Bad numbers, refused before anything loads."""
    if s.tokens < 1:
        raise TfqError(f"--tokens must be at least 1, got {s.tokens}")
    if s.prompt_tokens < 1:
        raise TfqError(f"--prompt-tokens must be at least 1, got {s.prompt_tokens}")
    if s.repeats < 1:
        raise TfqError(f"--repeats must be at least 1, got {s.repeats}")
    if s.threads is not None and s.threads < 1:
        raise TfqError(f"--threads must be at least 1, got {s.threads}")
    if s.peer not in PEERS:
        raise TfqError(f"--peer {s.peer!r}: choose hf (HF transformers generate) or none")


def check_against_plan(s: BenchSettings, plan: Plan) -> None:
    top = max(s.lanes)
    if top > plan.lanes:
        by = plan.source("lanes")
        raise TfqError(f"--lanes {top} is beyond the plan's {plan.lanes} lanes{f' (set by {by})' if by else ''}; "
                       f"raise the plan key lanes (--set lanes={top} or TFQ_LANES={top}) or bench fewer lanes")
    need = s.prompt_tokens + s.tokens
    if need > plan.window:
        raise TfqError(f"--prompt-tokens {s.prompt_tokens} + --tokens {s.tokens} = {need} rows do not fit the plan's "
                       f"window of {plan.window}; raise the plan key window (--set window={need}) or bench less")


def require_peer(peer: str) -> None:
    if peer != "hf":
        return
    import importlib

    try:
        importlib.import_module("transformers")
    except ImportError:
        raise TfqError(f"--peer hf needs HF transformers, which is not installed; install it with: {PEER_INSTALL} "
                       f"(or pass --peer none)") from None


# ------------------------------------------------------------------------------------------- the plans

def bench_window(plan: Plan, s: BenchSettings) -> int:
    """Rows each stream needs (prompt + reply), rounded up to whole pages, at most the plan's window: the
    cache is sized to the bench, not to the plan's longest chat (attention reads only a stream's own rows)."""
    pages = plan.kv.pages or PAGE_ROWS
    return min(plan.window, -(-(s.prompt_tokens + s.tokens) // pages) * pages)


def arm_plan(base: Plan, arm: str, lanes: int, window: int) -> Plan:
    """The base plan (its kv dtype, prefill chunk, budget) with this arm's keys; each tagged "bench ARM"."""
    pages = base.kv.pages or PAGE_ROWS
    changes: dict = {"lanes": lanes, "window": window, "attention": "rows", "draft": "none", "kv.pages": 0}
    if arm == "paged":
        changes.update({"kv.pages": pages, "kv.paged": "more", "kv.pool": (lanes - 1) * -(-window // pages)})
    elif arm == "partial":
        changes["attention"] = "partial"
    elif arm == "drafted":
        changes["draft"] = base.draft if base.draft != "none" else DRAFT
    plan = base.replace(paged_partial=False)
    for key, value in changes.items():
        if plan.get(key) != value:
            plan = plan.set(key, value, f"bench {arm}")
    return plan


def skipped_arm(arm: str, lanes: int) -> str | None:
    if arm == "paged" and lanes == 1:
        return "at 1 lane the only stream is contiguous (pages are for streams beyond the first): the whole arm"
    return None


# ---------------------------------------------------------------------------------------- the roofline

def weights_read_bytes(config: ModelConfig) -> int:
    """fp32 bytes a decode step reads of the weights: every linear layer, the norms and the output head.
    The embedding is a lookup of a few rows; when it is tied to the head, the head reads it whole."""
    untied_embedding = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
    return (config.param_count() - untied_embedding) * 4


def mean_context(prompt_tokens: int, tokens: int) -> float:
    """Mean keys per stream over the decode steps: step j (1..tokens-1) attends over prompt + j positions."""
    return prompt_tokens + tokens / 2


def kv_read_bytes(config: ModelConfig, kv_dtype: str, lanes: int, context: float) -> float:
    return lanes * context * row_bytes(config, kv_dtype)


def measure_bandwidth(mib: int = BANDWIDTH_MIB, tries: int = BANDWIDTH_TRIES) -> dict[int, float]:
    """Bytes/s of a streaming read (a sum over a tensor far larger than the caches), with one thread and with
    torch's threads as the engines use them: {threads: bytes/s}. Each is the second best of `tries` (a rate
    reached twice, so one glitch of the clock cannot set the roofline); on a shared machine a thread may wait
    for a busy core, so the caller takes the best of the thread counts."""
    a = torch.rand(mib * 2**20 // 4)  # distinct pages: nothing a hypervisor could merge
    a.sum()
    threads = torch.get_num_threads()
    out = {}
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            times = []
            for _ in range(tries):
                t0 = time.perf_counter()
                a.sum()
                times.append(time.perf_counter() - t0)
            out[n] = a.nbytes / sorted(times)[1]
    finally:
        torch.set_num_threads(threads)
    return out


# -------------------------------------------------------------------------------------------- memory

class MemoryProbe:
    """Resident memory of this process around one run. On Linux, writing 5 to /proc/self/clear_refs resets
    the peak (VmHWM) to the present, so each run's peak is its own; elsewhere the peak is the process's
    lifetime peak (ru_maxrss) and a run's own growth is unknown (None)."""

    def __init__(self):
        self.resettable = self._reset()
        self.before = 0

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status("VmHWM") is not None
        except OSError:
            return False

    def start(self) -> None:
        if self.resettable:
            self._reset()
        self.before = _status("VmRSS") or 0

    def stop(self) -> tuple[int, int | None]:
        """(peak resident bytes, bytes the run added above the resident memory it started with)."""
        if self.resettable:
            peak = _status("VmHWM") or 0
            return peak, max(0, peak - self.before)
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return usage * (1 if os.uname().sysname == "Darwin" else 1024), None


def _status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---------------------------------------------------------------------------------------------- runs

@dataclass
class Run:
    """One timed run of `lanes` streams: every stream's prompt and reply have the bench's lengths."""

    engine: str  # tfq | hf
    arm: str  # a tfq arm, or "peer"
    lanes: int
    round: int  # -1: warm-up
    first_token_s: float  # from the start to the last stream's first token (prefill + one draw)
    total_s: float
    decode_steps: int  # forwards after the first token
    replies: list[list[int]]
    peak_rss: int
    run_rss: int | None
    proposed: int = 0
    accepted: int = 0

    def figures(self, prompt_tokens: int) -> dict:
        reply = sum(len(r) for r in self.replies)
        decode_s = self.total_s - self.first_token_s
        decoded = reply - len(self.replies)  # tokens drawn after each stream's first
        rate = decoded / decode_s if decoded and decode_s > 0 else None
        return {
            "prefill_tokens_per_s": self.lanes * prompt_tokens / self.first_token_s,
            "ttft_s": self.first_token_s,
            "decode_tokens_per_s": rate,
            "decode_tokens_per_s_per_stream": rate / self.lanes if rate else None,
            "step_s": decode_s / self.decode_steps if self.decode_steps else None,
            "decode_steps": self.decode_steps,
            "total_s": self.total_s,
            "peak_rss_bytes": self.peak_rss,
            "run_rss_bytes": self.run_rss,
        }


class TfqArm:
    """One engine for one arm and lane count, reused by every round (its cache is allocated once)."""

    def __init__(self, name: str, plan: Plan, layout, loaded):
        from tfq.engine import Engine

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


class HfPeer:
    """HF transformers `generate` on the same checkpoint folder: greedy, fp32, its own (dynamic) cache."""

    def __init__(self, folder):
        import transformers
        from transformers import AutoModelForCausalLM

        self.version = transformers.__version__
        dtype_key = "dtype" if int(self.version.split(".")[0]) >= 5 else "torch_dtype"
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), **{dtype_key: torch.float32})
        except Exception as e:  # transformers raises many kinds; the user needs one line
            raise TfqError(f"the peer (HF transformers {self.version}) cannot load {folder}: "
                           f"{' '.join(str(e).split())[:300]}") from None
        self.model = model.to(torch.float32).eval()

    def run(self, prompts: list[list[int]], tokens: int, round_: int, probe: MemoryProbe) -> Run:
        from transformers import GenerationConfig

        ids = torch.tensor(prompts, dtype=torch.long)
        # The model's EOS stays; min_new_tokens keeps the peer from drawing it, so every reply has `tokens`.
        # Prompts are of equal length: nothing is padded.
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=tokens, min_new_tokens=tokens,
                                  pad_token_id=0, use_cache=True)
        clock = _Clock()
        probe.start()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      streamer=clock)
        total = time.perf_counter() - t0
        peak, grown = probe.stop()
        first = (clock.times[1] if len(clock.times) > 1 else time.perf_counter()) - t0
        replies = out[:, ids.shape[1]:].tolist()
        if any(len(r) != tokens for r in replies):
            raise TfqError(f"the peer drew {len(replies[0])} tokens, not {tokens}; its transformers "
                           f"{self.version} ignored min_new_tokens")
        return Run("hf", "peer", len(prompts), round_, first, total, tokens - 1, replies, peak, grown)


class _Clock:
    """A generate streamer that only notes when each put arrives: the prompt first, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


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


# ---------------------------------------------------------------------------------------------- bench

Progress = Callable[[str], None]  # called before each run with what runs next


@dataclass
class Bench:
    base: Plan
    config: ModelConfig
    loaded: object  # tfq.model.load.LoadedModel
    settings: BenchSettings
    peer: HfPeer | None = None
    runs: list[Run] = field(default_factory=list)
    cache_bytes: dict = field(default_factory=dict)  # (lanes, arm) -> bytes the engine allocated
    plans: dict = field(default_factory=dict)  # (lanes, arm) -> the arm's Plan
    skipped: list[dict] = field(default_factory=list)

    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.config.eos_token_ids) | frozenset(getattr(self.loaded.tokenizer, "eos_ids", ()))

    def arms_at(self, lanes: int) -> list[str]:
        return [a for a in self.settings.arms if skipped_arm(a, lanes) is None]

    def run_count(self) -> int:
        per = [len(self.arms_at(n)) + (self.peer is not None) for n in self.settings.lanes]
        return sum(per) * (self.settings.repeats + 1)

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
            runners = engines + ([self.peer] if self.peer is not None else [])
            for round_ in range(-1, s.repeats):
                order = runners if round_ % 2 == 0 or round_ < 0 else runners[-1:] + runners[:-1]
                tokens = min(s.tokens, WARMUP_TOKENS) if round_ < 0 else s.tokens
                for runner in order:
                    name = runner.name if isinstance(runner, TfqArm) else "peer (hf)"
                    what = "warm-up" if round_ < 0 else f"round {round_ + 1}/{s.repeats}"
                    progress(f"lanes {lanes}: {name}, {what}")
                    run = runner.run(prompts, tokens, round_, probe)
                    if round_ >= 0:
                        self.runs.append(run)
            del engines, runners  # free this lane count's caches before the next

    # -- figures ------------------------------------------------------------------------------------------
    def rows(self, bandwidth: float) -> list[dict]:
        s = self.settings
        out = []
        context = mean_context(s.prompt_tokens, s.tokens)
        weights = weights_read_bytes(self.config)
        for lanes in s.lanes:
            peer_runs = {r.round: r for r in self.runs if r.lanes == lanes and r.engine == "hf"}
            names = self.arms_at(lanes) + (["peer"] if peer_runs else [])
            for arm in names:
                runs = [r for r in self.runs if r.lanes == lanes and r.arm == arm]
                figs = [r.figures(s.prompt_tokens) for r in runs]
                row = {"lanes": lanes, "engine": runs[0].engine, "arm": arm, "rounds": len(runs)}
                for key in figs[0]:
                    row[key] = _median([f[key] for f in figs])
                kv_dtype = self.plans[lanes, arm].kv.dtype if arm != "peer" else "fp32"
                step_bytes = weights + kv_read_bytes(self.config, kv_dtype, lanes, context)
                row["bytes_per_step"] = int(step_bytes)
                row["roofline_step_s"] = step_bytes / bandwidth
                row["roofline_fraction"] = (row["roofline_step_s"] / row["step_s"]) if row["step_s"] else None
                row["cache_bytes"] = self.cache_bytes.get((lanes, arm))
                if arm != "peer":
                    p = self.plans[lanes, arm]
                    row["plan"] = {"window": p.window, "lanes": p.lanes, "kv_dtype": p.kv.dtype,
                                   "kv_pages": p.kv.pages, "kv_paged": p.kv.paged, "kv_pool": p.kv.pool,
                                   "attention": p.attention, "draft": p.draft, "prefill_chunk": p.prefill_chunk}
                    row["vs_peer"] = _ratios(runs, peer_runs, s.prompt_tokens) if peer_runs else None
                    if arm == "drafted":
                        proposed, accepted = sum(r.proposed for r in runs), sum(r.accepted for r in runs)
                        row["drafted"] = {"proposed": proposed, "accepted": accepted,
                                          "acceptance": accepted / proposed if proposed else None}
                    if peer_runs:
                        row["same_reply_as_peer"] = _agreement(runs, peer_runs, self.eos_ids())
                row["runs"] = figs
                out.append(row)
        return out


def _median(values: Sequence):
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratios(runs: list[Run], peer_runs: dict[int, Run], prompt_tokens: int) -> dict:
    """Medians of tfq/peer per round: each ratio is of two runs side by side."""
    out = {}
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        ratios = []
        for r in runs:
            mine, theirs = r.figures(prompt_tokens)[key], peer_runs[r.round].figures(prompt_tokens)[key]
            if mine and theirs:
                ratios.append(mine / theirs)
        out[key.replace("_tokens_per_s", "")] = _median(ratios)
    return out


def _agreement(runs: list[Run], peer_runs: dict[int, Run], eos: frozenset[int]) -> dict:
    """How far tfq's replies follow the peer's (same weights, both greedy in fp32, sums in other orders, so
    a near tie may part them). Compared up to tfq's first EOS: there the peer, held by min_new_tokens, must
    draw something else."""
    whole = lead = total = 0
    for r in runs:
        for mine, theirs in zip(r.replies, peer_runs[r.round].replies):
            n = next((i for i, t in enumerate(mine) if t in eos), len(mine))
            parting = next((i for i in range(n) if mine[i] != theirs[i]), n)
            whole += parting == n
            lead += parting / n if n else 1.0
            total += 1
    return {"whole_replies": whole / total, "tokens_before_parting": lead / total}


def build_report(bench: Bench, bandwidths: tuple[dict, dict], loads: tuple, wall: float) -> dict:
    """Everything the run measured, JSON-ready. The bandwidth used is the best read of the start and the end
    (measure_bandwidth): on a shared machine the best read is the nearest to the physical limit."""
    import platform

    s, config = bench.settings, bench.config
    bandwidth = max(max(b.values()) for b in bandwidths)
    rows = bench.rows(bandwidth)
    return {
        "settings": {"model": bench.base.model, "folder": str(bench.loaded.folder), "lanes": list(s.lanes),
                     "prompt_tokens": s.prompt_tokens, "tokens": s.tokens, "repeats": s.repeats, "peer": s.peer,
                     "arms": list(s.arms), "seed": s.seed, "window": bench_window(bench.base, s)},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "transformers": bench.peer.version if bench.peer else None,
                    "python": platform.python_version(), "load_average_before": list(loads[0]),
                    "load_average_after": list(loads[1]), "bandwidth_bytes_per_s": bandwidth,
                    "bandwidth_start": _by_threads(bandwidths[0]), "bandwidth_end": _by_threads(bandwidths[1]),
                    "rss_peak_is_per_run": MemoryProbe().resettable},
        "model": {"family": config.family, "parameters": config.param_count(),
                  "weights_read_per_step_bytes": weights_read_bytes(config)},
        "wall_s": wall,
        "rows": rows,
        "skipped": bench.skipped,
        "targets": targets(rows),
    }


def _by_threads(measured: dict[int, float]) -> dict[str, float]:
    return {f"{n} thread{'s' * (n > 1)}": bw for n, bw in measured.items()}


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets for this machine, where the run measured what they need."""
    by = {(r["lanes"], r["arm"]): r for r in rows}
    out = []

    def add(what: str, value, goal: float) -> None:
        if value is not None:
            out.append({"target": what, "value": value, "goal": goal, "met": value >= goal})

    if (1, "whole") in by:
        add("decode at 1 lane, fraction of the bandwidth roofline", by[1, "whole"]["roofline_fraction"], 0.7)
        add("decode at 1 lane vs the peer", (by[1, "whole"].get("vs_peer") or {}).get("decode"), 1.5)
    if (8, "whole") in by:
        add("decode at 8 lanes vs the peer", (by[8, "whole"].get("vs_peer") or {}).get("decode"), 3.0)
        if (1, "whole") in by and by[1, "whole"]["decode_tokens_per_s"] and by[8, "whole"]["decode_tokens_per_s"]:
            add("aggregate decode, 8 lanes / 1 lane",
                by[8, "whole"]["decode_tokens_per_s"] / by[1, "whole"]["decode_tokens_per_s"], 4.0)
    for (lanes, arm), row in by.items():
        whole = by.get((lanes, "whole"))
        if arm == "paged" and whole and row["decode_tokens_per_s"] and whole["decode_tokens_per_s"]:
            add(f"paged / whole decode at {lanes} lanes (within 5%)",
                row["decode_tokens_per_s"] / whole["decode_tokens_per_s"], 0.95)
    return out
