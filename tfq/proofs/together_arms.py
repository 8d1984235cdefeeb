"""The arms of `tfq together` and how each is judged.

Every arm's plan is the user's plan with a few keys changed (tfq.plan.derive, each tagged "arm NAME"); its
replies are compared with the reference's, chat by chat, in token ids and in the bits of every step's
logits. A control changes the arithmetic on purpose and must come out RED. The warm arms also ask for prompt
scores on every other chat and compare them, every float's bits, with the same chat's scores alone.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tfq.decode.sampling import TokenLogprob
from tfq.engine.runner import ColdPartial, Policy, chunked_deltanet, experts_by_load, paged_partial
from tfq.engine.stream import Request, Result
from tfq.errors import TfqError
from tfq.kernels.contract import KEY_TILE, SPLIT_ROWS
from tfq.plan import Plan, derive, pages_for

EXACT, RED, FAIL = "EXACT", "RED", "FAIL"
CHUNK_ROWS = 61  # odd and prime: chunk boundaries fall inside key tiles and pages, never on them
DEFAULT_PAGE_ROWS = 256
SMALL_PAGE_ROWS = KEY_TILE  # for windows too short to span several 256-row pages


@dataclass(frozen=True)
class Context:
    """What the arms' plans are derived from: the suite's shape and the check's options."""

    group: int
    page_rows: int
    chunk: int
    preempt_page_rows: int  # the plan's page rows, or a multiple of them where those cannot overflow its pool
    preempt_window: int  # rows the longest chat needs, rounded up to pages (at most the plan's window)
    preempt_pool: int  # pages for one such window: too few for the group, so streams are preempted
    longest_first: tuple[int, ...] = ()  # chats by prompt length, longest first: the preempted arm's order


@dataclass(frozen=True)
class Arm:
    name: str
    together: bool  # K at a time (continuous batching over K lanes), else each chat alone
    about: str
    changes: Callable[[Context], dict[str, Any]]  # plan keys this arm sets, beyond lanes and arithmetic
    control: bool = False  # changes the arithmetic on purpose: must come out RED
    # the arithmetic handed to the engine instead of the plan's: made, for each engine, from the plan's attention
    # (partial or not), as a policy may keep a state (tfq/engine/runner.py)
    arithmetic: Callable[[bool], Policy] | None = None
    must_preempt: bool = False
    must_draft: bool = False
    warm: bool = False  # the suite in two passes through one engine: a first half cold, then all of it, mixed
    scores: bool = False  # every other chat asks for prompt scores, compared bit for bit with its scores alone
    longest_first: bool = False  # the chats go in longest prompt first, not in the suite's order
    models: str = "all"  # what it applies to: all | hybrid (Qwen3.5) | attention (no DeltaNet layers) | moe
    reduce: bool = False  # tensor parallelism's usual split (o and down summed across ranks): plans with tp > 1
    snapshot_offset: int = 0  # a hybrid's prefix cache keeps its states this many rows past their page (a control)

    def applies(self, config, tp: int = 1) -> bool:
        if self.reduce and tp == 1 or config.hybrid and tp > 1 and self.warm:  # a hybrid's states: one process
            return False
        if self.models == "moe":
            return config.moe is not None
        return self.models == "all" or (self.models == "hybrid") == config.hybrid

    def mode(self, group: int) -> str:
        return f"{group} together" if self.together else "alone"


REFERENCE = Arm("reference", False, "every chat alone, whole (no pages), rows attention, one process (tp: 1)",
                lambda c: {"kv.pages": 0, "tp": 1})

# Adding an arm is one entry here.
ARMS: tuple[Arm, ...] = (
    Arm("whole", True, "K together, every stream in a contiguous lane", lambda c: {"kv.pages": 0}),
    Arm("paged-alone", False, "each chat alone, its cache on pages",
        lambda c: {"kv.pages": c.page_rows, "kv.paged": "all"}),
    Arm("paged", True, "K together, streams beyond the first on pages (the field report's case)",
        lambda c: {"kv.pages": c.page_rows, "kv.paged": "more"}),
    Arm("paged-all", True, "K together, every stream on pages",
        lambda c: {"kv.pages": c.page_rows, "kv.paged": "all"}),
    Arm("chunked", True, "K together, prompts fed in small odd-sized chunks",
        lambda c: {"kv.pages": 0, "prefill_chunk": c.chunk}),
    Arm("preempted", True, "K together on pages, longest prompts first, a pool of one window (whatever the plan's): "
        "the first K prompts overflow it, so streams are evicted and recomputed",
        lambda c: {"kv.pages": c.preempt_page_rows, "kv.paged": "all", "window": c.preempt_window,
                   "kv.pool": c.preempt_pool, "kv.prefix_cache": "off"},
        must_preempt=True, longest_first=True),
    Arm("drafted", True, "K together on pages, drafting by prompt lookup (ngram:4), guesses verified in the batch",
        lambda c: {"kv.pages": c.page_rows, "kv.paged": "more", "draft": "ngram:4"}, must_draft=True),
    Arm("drafted-model", True, "K together, the model drafting for itself (4 guesses a verify)",
        lambda c: {"kv.pages": 0, "draft": "self"}, must_draft=True),
    Arm("prefix", True, "K together on pages with the prefix cache: half the suite cold, then all of it (that "
        "half warm, mixed with the others) through the same cache; every other chat scores its prompt",
        lambda c: {"kv.pages": c.page_rows, "kv.paged": "all", "kv.prefix_cache": "on"}, warm=True, scores=True),
    Arm("partial", True, "control: partial attention arithmetic instead of rows; must differ",
        lambda c: {"kv.pages": 0, "attention": "partial"}, control=True),
    Arm("paged-partial", True, "control: the field report's split (forwards holding a paged stream run "
        "partial); must differ", lambda c: {"kv.pages": c.page_rows, "kv.paged": "more"}, control=True,
        arithmetic=lambda partial: paged_partial),
    Arm("prefix-partial", True, "control: the prefix arm with its first pass in partial, so warm rows streams "
        "map pages computed in partial; must differ (64-row pages: a prompt past 320 rows reuses rows past the "
        "first split; prompts scored in the cold pass differ past it too)",
        lambda c: {"kv.pages": SMALL_PAGE_ROWS, "kv.paged": "all", "kv.prefix_cache": "on"}, control=True,
        arithmetic=lambda partial: ColdPartial(), warm=True, scores=True, models="attention"),
    Arm("prefix-offset", True, "control: the prefix arm on a hybrid, its DeltaNet states kept one row past their "
        "pages, so warm streams start one row off; must differ", lambda c: {"kv.pages": SMALL_PAGE_ROWS, "kv.paged":
        "all", "kv.prefix_cache": "on"}, control=True, warm=True, models="hybrid", snapshot_offset=1),
    Arm("deltanet-chunks", True, "control: a hybrid's prompt chunks by the chunked DeltaNet algorithm (64-row "
        "blocks, as transformers prefills), decode rows by the recurrence; must differ",
        lambda c: {"kv.pages": 0}, control=True, arithmetic=chunked_deltanet,
        models="hybrid"),
    Arm("experts-by-load", True, "control: a mixture's experts combined in the order of how many of the "
        "forward's rows chose them, as a fused MoE kernel sums; must differ", lambda c: {"kv.pages": 0},
        control=True, arithmetic=experts_by_load, models="moe"),
    Arm("all-reduce", True, "control: tensor parallelism split as usual (o and down by their inputs, the ranks' "
        "partial sums added by an all-reduce); must differ", lambda c: {"kv.pages": 0}, control=True, reduce=True),
)


def arm_names() -> list[str]:
    return [a.name for a in ARMS]


def arms_for(arms: Sequence[Arm], config, named: bool, tp: int = 1) -> tuple[list[Arm], str]:
    """The arms that apply, and for a hybrid a line naming those left out (the prefix cache's attention control; a
    hybrid's controls leave other models, the all-reduce control tp: 1, silently). Named ones that do not: refused."""
    left_out = [a for a in arms if not a.applies(config, tp)]
    if left_out and named:
        a = left_out[0]
        if a.reduce and tp == 1 or a.warm and config.hybrid and tp > 1:
            raise TfqError(f"arm {a.name} " + ("splits the model over ranks: run it with --set tp=2 (or more)" if
                           a.reduce else "keeps a hybrid's states in one process: run it with tp 1"))
        kinds = {"hybrid": "hybrid (qwen3_5)", "attention": "attention-only", "moe": "mixture-of-experts"}
        raise TfqError(f"arm {a.name} does not apply to this model: it runs on {kinds[a.models]} models; leave it "
                       f"out of --arms")
    kept = [a for a in arms if a.applies(config, tp)]
    left_out = [a for a in left_out if not a.reduce and a.models != "moe"]
    if not left_out or not config.hybrid:
        return kept, ""
    why = ("a hybrid's prefix cache keeps its DeltaNet states in one process: tp 1 only" if tp > 1 else
           "a control of attention's arithmetic under the prefix cache; a hybrid's is prefix-offset")
    return kept, f"arms left out: {', '.join(a.name for a in left_out)} ({why})"


def select_arms(text: str | None) -> list[Arm]:
    """`whole,paged` -> those arms in the order given; None or empty -> all of them."""
    if text is None or not text.strip():
        return list(ARMS)
    by_name = {a.name: a for a in ARMS}
    chosen: list[Arm] = []
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        if name not in by_name:
            raise TfqError(f"unknown arm {name!r}; arms are {', '.join(by_name)}")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    if not chosen:
        raise TfqError(f"--arms names no arm; arms are {', '.join(by_name)}")
    return chosen


def check_options(plan: Plan, group: int, tokens: int) -> None:
    """Bad numbers, refused before the model loads."""
    if tokens < 1:
        raise TfqError(f"--tokens must be at least 1, got {tokens}")
    if group < 2:
        raise TfqError(f"--group must be at least 2 (K streams run together), got {group}")
    if group > plan.lanes:
        raise TfqError(f"--group {group} is larger than the plan's {plan.lanes} lanes; use --group {plan.lanes} "
                       f"or less, or raise lanes (--set lanes={group})")


def page_rows_for(plan: Plan) -> int:
    """The plan's page rows when it has pages, else 256 (64 for windows too short for several 256-row pages)."""
    if plan.kv.pages:
        return plan.kv.pages
    return DEFAULT_PAGE_ROWS if plan.window >= 8 * DEFAULT_PAGE_ROWS else SMALL_PAGE_ROWS


def context_for(plan: Plan, requests: Sequence[Request], group: int) -> Context:
    pages = page_rows_for(plan)
    chunk = CHUNK_ROWS if plan.prefill_chunk != CHUNK_ROWS else 47
    order = tuple(sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt)))
    page_rows, window, pool = preemption(plan, [len(requests[i].prompt) for i in order],
                                         max(len(r.prompt) + r.max_tokens for r in requests), group)
    return Context(group=group, page_rows=pages, chunk=chunk, preempt_page_rows=page_rows, preempt_window=window,
                   preempt_pool=pool, longest_first=order)


def preemption(plan: Plan, prompts: Sequence[int], need: int, group: int) -> tuple[int, int, int]:
    """The preempted arm's (page rows, window, pool), so that it must preempt whatever the plan's pool: the pool
    holds one window of the longest chat, and the first `group` prompts (longest first) need more pages than
    that at some step of their prefill. Pages of the plan's rows when they do, else of the fewest multiple of
    them that does: at worst a page of a whole window, a pool of one, which any two streams overflow at once."""
    rows = page_rows_for(plan)
    for page in range(rows, pages_for(min(need, plan.window), rows) * rows + 1, rows):
        window = min(plan.window, pages_for(need, page) * page)
        pool = pages_for(window, page)
        if overflows(prompts[:group], plan.prefill_chunk, page, pool):
            break
    return page, window, pool


def overflows(prompts: Sequence[int], chunk: int, page_rows: int, pool: int) -> bool:
    """Whether streams admitted together with these prompts must hold more than `pool` pages at some step:
    each takes `chunk` rows of its prompt a step, and none can end before the step that takes its last chunk."""
    steps = max((pages_for(n, chunk) for n in prompts), default=0)
    return any(sum(pages_for(min(n, s * chunk), page_rows) for n in prompts if pages_for(n, chunk) >= s) > pool
               for s in range(1, steps + 1))


def arm_plan(arm: Arm, base: Plan, ctx: Context) -> Plan:
    """The base plan with this arm's keys set; each changed key is tagged "set by arm NAME" in its plan lines."""
    changes: dict[str, Any] = {"lanes": ctx.group if arm.together else 1, "attention": "rows", "draft": "none"}
    changes.update(arm.changes(ctx))
    changes.update(pool_rows_kept(base, changes))
    return derive(base, changes, f"arm {arm.name}")


def pool_rows_kept(base: Plan, changes: dict[str, Any]) -> dict[str, Any]:
    """An arm on pages of other rows than the plan's keeps the rows of the plan's explicit pool, in more (or
    fewer) pages. Without pages the plan's pool is unused and holds no rows: the arm's pool is auto."""
    rows = changes.get("kv.pages", base.kv.pages)
    if not rows or rows == base.kv.pages or "kv.pool" in changes or base.kv.pool == "auto":
        return {}
    if not base.kv.pages:
        return {"kv.pool": "auto"}
    return {"kv.pool": pages_for(int(base.kv.pool) * base.kv.pages, rows)}


def scored_chats(requests: Sequence[Request]) -> frozenset[int]:
    """The chats whose prompt scores the warm arms compare: every other one by prompt length, the longest not.
    A stream scoring its prompt maps no cached page, so the others (the longest among them) keep reusing rows."""
    by_length = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt))
    return frozenset(by_length[1::2])


# ------------------------------------------------------------------------------------------- comparing

@dataclass
class ChatComparison:
    chat: str
    ids_equal: bool
    logits_equal: bool
    token: int | None = None  # first reply token that differs (None: ids equal)
    char: int | None = None  # first character of the reply text that differs (None: texts equal)
    step: int | None = None  # first step whose logits bits differ (None: all equal)
    error: str | None = None  # the arm's run of this chat failed
    scores_equal: bool | None = None  # its prompt scores' bits equal the reference's (None: not compared)
    score_at: int | None = None  # first prompt token whose score differs or is missing (None: all equal)

    @property
    def equal(self) -> bool:
        return self.ids_equal and self.logits_equal and self.scores_equal is not False and self.error is None

    def where(self) -> str:
        if self.error:
            return f"{self.chat}: failed"
        if self.token is not None:
            char = f", char {self.char}" if self.char is not None else ""
            return f"{self.chat} @ token {self.token}{char}"
        if self.step is not None:
            return f"{self.chat}: logits @ step {self.step}"
        if self.score_at is not None:
            return f"{self.chat}: prompt score @ prompt token {self.score_at}"
        return ""


def _first_difference(a: Sequence, b: Sequence) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: Result, got: Result, scores: bool = False) -> ChatComparison:
    """`scores`: the chat asked for prompt scores in both runs, and they are compared too."""
    score_at = score_parting(reference, got) if scores else None
    return ChatComparison(
        chat=reference.label, ids_equal=got.ids == reference.ids, logits_equal=got.digests == reference.digests,
        token=_first_difference(reference.ids, got.ids), char=_first_difference(reference.text, got.text),
        step=_first_difference(reference.digests, got.digests),
        error=got.error or (f"the reference run failed: {reference.error}" if reference.error else None),
        scores_equal=score_at is None if scores else None, score_at=score_at)


def score_digest(score: TokenLogprob | None) -> str | None:
    """A prompt token's score as the bits of every number in it: the token, its log-probability (a float64),
    and each top token with its own."""
    if score is None:
        return None
    packed = struct.pack("<qd", score.token, score.logprob)
    packed += b"".join(struct.pack("<qd", token, lp) for token, lp in score.top)
    return hashlib.sha256(packed).hexdigest()[:16]


def score_digests(result: Result) -> list[str | None] | None:
    """Each prompt token's score digest (None for the first, which nothing scores); None when it has no scores."""
    if result.prompt_logprobs is None:
        return None
    return [score_digest(s) for s in result.prompt_logprobs]


def score_parting(reference: Result, got: Result) -> int | None:
    """The first prompt token (from the second: nothing scores the first) whose score differs or is missing on
    either side; None when every one is there and equal."""
    a, b = score_digests(reference), score_digests(got)
    if a is None or b is None:
        return 1
    for i in range(1, max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if x is None or y is None or x != y:
            return i
    return None


def reach(results: Sequence[Result]) -> int:
    """Most keys any step of any reply attended over (its prompt and the reply before the last token)."""
    return max((r.prompt_tokens + len(r.ids) - 1 for r in results), default=0)


def scores_tally(comparisons: Sequence[ChatComparison]) -> tuple[int, int]:
    """(prompt scores equal, prompt scores compared)."""
    compared = [c for c in comparisons if c.scores_equal is not None]
    return sum(c.scores_equal and c.error is None for c in compared), len(compared)


def _differ(comparisons: Sequence[ChatComparison], what: str) -> str:
    """Why unequal comparisons fail an arm: replies that differ, or else prompt scores alone."""
    replies = [c for c in comparisons if not (c.ids_equal and c.logits_equal)]
    if replies:
        return f"{len(replies)} of {len(comparisons)} {what} differ from their runs alone: {replies[0].where()}"
    equal, compared = scores_tally(comparisons)
    first = next(c for c in comparisons if c.scores_equal is False)
    return (f"{compared - equal} of {compared} prompt scores of the {what} differ from their runs alone: "
            f"{first.where()}")


def judge(arm: Arm, comparisons: Sequence[ChatComparison], preemptions: int, longest: int,
          drafted: tuple[int, int] = (0, 0), cold: Sequence[ChatComparison] = (), reused: int = 0) -> tuple[str, str]:
    """(verdict, a short note saying why). `cold`: a warm arm's first pass; `reused`: rows from its cache."""
    failed = [c for c in [*comparisons, *cold] if c.error]
    if failed:
        return FAIL, f"{len(failed)} of {len(comparisons) + len(cold)} runs failed: {failed[0].chat}: {failed[0].error}"
    equal, compared = scores_tally([*comparisons, *cold])
    if arm.control:
        return _judge_control(arm, comparisons, longest, equal, compared)
    if any(not c.equal for c in comparisons):
        return FAIL, _differ(comparisons, "replies")
    if any(not c.equal for c in cold):
        return FAIL, _differ(cold, "replies of the cold pass")
    return _judge_exercised(arm, preemptions, drafted, reused, compared)


def _judge_control(arm: Arm, comparisons: Sequence[ChatComparison], longest: int, equal: int,
                   compared: int) -> tuple[str, str]:
    """A control is RED when its logits or prompt scores differ from the reference; else it fails, saying why its
    change of the arithmetic could not show."""
    differ = sum(not c.logits_equal for c in comparisons)
    if differ or equal < compared:
        scores = f", {compared - equal} of {compared} prompt scores" if compared else ""
        return RED, f"{differ} of {len(comparisons)} replies' logits{scores} differ, as they must"
    if arm.arithmetic is chunked_deltanet:
        return FAIL, "its logits equal the reference: the chunked DeltaNet arithmetic did not show"
    if arm.reduce:
        return FAIL, "its logits equal the reference: the sums split across ranks did not show"
    if longest <= SPLIT_ROWS:
        return FAIL, (f"cannot differ: the longest context is {longest} rows and partial only changes bits past "
                      f"{SPLIT_ROWS} rows; add a longer chat or raise --tokens")
    if arm.warm:
        return FAIL, (f"its logits equal the reference: no page it reused holds rows past the first {SPLIT_ROWS} "
                      f"keys; add a chat whose prompt is longer than {SPLIT_ROWS + SMALL_PAGE_ROWS} rows")
    return FAIL, "its logits equal the reference: the check did not see an arithmetic change"


def _judge_exercised(arm: Arm, preemptions: int, drafted: tuple[int, int], reused: int,
                     compared: int) -> tuple[str, str]:
    """Every reply equals its run alone: EXACT when what the arm exists to exercise (reuse from the prefix cache,
    prompt scores, preemption, drafting) happened, FAIL when it went untested."""
    if arm.warm and reused == 0:
        return FAIL, "no row was taken from the prefix cache, so reuse went untested"
    if arm.scores and compared == 0:
        return FAIL, "no chat scored its prompt, so prompt scores went untested"
    if arm.warm:
        scores = f", {compared} prompt scores equal bit for bit" if compared else ""
        return EXACT, f"{reused} rows from the prefix cache, cold and warm replies exact{scores}"
    if arm.must_preempt and preemptions == 0:
        return FAIL, "no stream was preempted (the pool held them all), so recomputation went untested"
    if arm.must_preempt:
        return EXACT, f"{preemptions} preemptions, every stream exact after them"
    proposed, accepted = drafted
    if arm.must_draft and accepted == 0:
        return FAIL, f"{proposed} guesses proposed, none accepted, so verification went untested"
    if arm.must_draft:
        return EXACT, f"{accepted} of {proposed} guesses accepted"
    return EXACT, ""
