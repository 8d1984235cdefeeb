"""The exactness check behind `tfq together`: a suite run alone and together under every arm, chat by chat.

The reference is every chat alone on a whole (unpaged) plan with `rows` attention, run once. Each arm is the
same suite under other settings (K together, pages, chunked prefill, preemption), derived from the user's plan
by changing a few keys, and must equal the reference in token ids and in the bits of every step's logits. Two
controls change the arithmetic on purpose (`partial`, and the field report's paged/partial split); they must
come out RED, or the check could not have seen a fault. Evidence (one JSON per arm, summary.json) is written
as arms finish, so an interrupted run leaves what it has.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tfq.errors import TfqError
from tfq.plan import Layout, Plan, plan_json, plan_lines
from tfq.stream import Request, Result
from tfq.kernels.contract import KEY_TILE, SPLIT_ROWS

EXACT, RED, FAIL = "EXACT", "RED", "FAIL"
CHUNK_ROWS = 61  # odd and prime: chunk boundaries fall inside key tiles and pages, never on them
DEFAULT_PAGE_ROWS = 256
SMALL_PAGE_ROWS = KEY_TILE  # for windows too short to span several 256-row pages
INTERRUPTED_EXIT = 130


# ------------------------------------------------------------------------------------------------ arms

@dataclass(frozen=True)
class Context:
    """What the arms' plans are derived from: the suite's shape and the check's options."""

    group: int
    page_rows: int
    chunk: int
    preempt_window: int  # rows the longest chat needs, rounded up to pages (at most the plan's window)
    preempt_pool: int  # pages for one such window: too few for the group, so streams are preempted


@dataclass(frozen=True)
class Arm:
    name: str
    together: bool  # K at a time (continuous batching over K lanes), else each chat alone
    about: str
    changes: Callable[[Context], dict[str, Any]]  # plan keys this arm sets, beyond lanes and arithmetic
    control: bool = False  # changes the arithmetic on purpose: must come out RED
    must_preempt: bool = False
    must_draft: bool = False

    def mode(self, group: int) -> str:
        return f"{group} together" if self.together else "alone"


REFERENCE = Arm("reference", False, "every chat alone, whole (no pages), rows attention",
                lambda c: {"kv.pages": 0})

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
    Arm("preempted", True, "K together on pages, a pool too small for all: streams evicted and recomputed",
        lambda c: {"kv.pages": c.page_rows, "kv.paged": "all", "window": c.preempt_window,
                   "kv.pool": c.preempt_pool},
        must_preempt=True),
    Arm("drafted", True, "K together on pages, drafting by prompt lookup (ngram:4), guesses verified in the batch",
        lambda c: {"kv.pages": c.page_rows, "kv.paged": "more", "draft": "ngram:4"}, must_draft=True),
    Arm("drafted-model", True, "K together, the model drafting for itself (4 guesses a verify)",
        lambda c: {"kv.pages": 0, "draft": "self"}, must_draft=True),
    Arm("partial", True, "control: partial attention arithmetic instead of rows; must differ",
        lambda c: {"kv.pages": 0, "attention": "partial"}, control=True),
    Arm("paged-partial", True, "control: the field report's split (forwards holding a paged stream run "
        "partial); must differ", lambda c: {"kv.pages": c.page_rows, "kv.paged": "more", "paged_partial": True},
        control=True),
)


def arm_names() -> list[str]:
    return [a.name for a in ARMS]


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
    need = max(len(r.prompt) + r.max_tokens for r in requests)
    window = min(plan.window, -(-need // pages) * pages)
    chunk = CHUNK_ROWS if plan.prefill_chunk != CHUNK_ROWS else 47
    return Context(group=group, page_rows=pages, chunk=chunk, preempt_window=window,
                   preempt_pool=-(-window // pages))


def arm_plan(arm: Arm, base: Plan, ctx: Context) -> Plan:
    """The base plan with this arm's keys set; each changed key is tagged "set by arm NAME" in its plan lines."""
    changes: dict[str, Any] = {"lanes": ctx.group if arm.together else 1, "attention": "rows", "paged_partial": False,
                               "draft": "none"}
    changes.update(arm.changes(ctx))
    plan = base
    for key, value in changes.items():
        if plan.get(key) != value:
            plan = plan.set(key, value, f"arm {arm.name}")
    return plan


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

    @property
    def equal(self) -> bool:
        return self.ids_equal and self.logits_equal and self.error is None

    def where(self) -> str:
        if self.error:
            return f"{self.chat}: failed"
        if self.token is not None:
            char = f", char {self.char}" if self.char is not None else ""
            return f"{self.chat} @ token {self.token}{char}"
        if self.step is not None:
            return f"{self.chat}: logits @ step {self.step}"
        return ""


def _first_difference(a: Sequence, b: Sequence) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: Result, got: Result) -> ChatComparison:
    return ChatComparison(
        chat=reference.label, ids_equal=got.ids == reference.ids, logits_equal=got.digests == reference.digests,
        token=_first_difference(reference.ids, got.ids), char=_first_difference(reference.text, got.text),
        step=_first_difference(reference.digests, got.digests),
        error=got.error or (f"the reference run failed: {reference.error}" if reference.error else None))


def reach(results: Sequence[Result]) -> int:
    """Most keys any step of any reply attended over (its prompt and the reply before the last token)."""
    return max((r.prompt_tokens + len(r.ids) - 1 for r in results), default=0)


def judge(arm: Arm, comparisons: Sequence[ChatComparison], preemptions: int, longest: int,
          drafted: tuple[int, int] = (0, 0)) -> tuple[str, str]:
    """(verdict, a short note saying why)."""
    n = len(comparisons)
    failed = [c for c in comparisons if c.error]
    if failed:
        return FAIL, f"{len(failed)} of {n} runs failed: {failed[0].chat}: {failed[0].error}"
    if arm.control:
        differ = sum(not c.logits_equal for c in comparisons)
        if differ:
            return RED, f"{differ} of {n} replies' logits differ, as they must"
        if longest <= SPLIT_ROWS:
            return FAIL, (f"cannot differ: the longest context is {longest} rows and partial only changes bits past "
                          f"{SPLIT_ROWS} rows; add a longer chat or raise --tokens")
        return FAIL, "its logits equal the reference: the check did not see an arithmetic change"
    differ = [c for c in comparisons if not c.equal]
    if differ:
        return FAIL, f"{len(differ)} of {n} replies differ from their runs alone"
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


# --------------------------------------------------------------------------------------------- running

@dataclass
class ArmRun:
    arm: Arm
    plan: Plan
    layout: Layout
    results: list[Result | None]
    seconds: float = 0.0
    comparisons: list[ChatComparison] = field(default_factory=list)
    verdict: str = ""
    note: str = ""
    complete: bool = False

    @property
    def preemptions(self) -> int:
        return sum(r.preempted for r in self.results if r is not None)

    @property
    def drafted(self) -> tuple[int, int]:
        done = [r for r in self.results if r is not None]
        return sum(r.proposed for r in done), sum(r.accepted for r in done)

    @property
    def equal_ids(self) -> int:
        return sum(c.ids_equal and c.error is None for c in self.comparisons)

    @property
    def equal_logits(self) -> int:
        return sum(c.logits_equal and c.error is None for c in self.comparisons)


class Listener:
    """Progress hooks; the command shows them with rich, tests leave them silent."""

    def arm_started(self, run: ArmRun, group: int) -> None: ...
    def chat_started(self, run: ArmRun, index: int) -> None: ...  # alone arms only
    def token(self, run: ArmRun, index: int, token_id: int) -> None: ...
    def arm_finished(self, run: ArmRun) -> None: ...


class Check:
    """The reference plus the chosen arms, over one loaded model, writing evidence into `evidence`."""

    def __init__(self, base: Plan, config, loaded, chats, requests: Sequence[Request], arms: Sequence[Arm],
                 group: int, evidence: Path | None, listener: Listener | None = None,
                 suite_path: Path | None = None, tokens: int | None = None):
        self.config, self.loaded, self.chats = config, loaded, list(chats)
        self.requests = list(requests)
        self.group = group
        self.evidence = evidence
        self.listener = listener or Listener()
        self.suite_path, self.tokens = suite_path, tokens
        for r in self.requests:
            r.validate()
            if len(r.prompt) >= base.window:
                raise TfqError(f"chat {r.label}: its prompt of {len(r.prompt)} tokens does not fit the plan's window "
                               f"of {base.window} rows; raise window (--set window=...) or shorten the chat")
        self.context = context_for(base, self.requests, group)
        # Every arm's plan and layout first: a plan that does not fit fails before anything runs.
        self.runs = [self._prepare(arm, base) for arm in (REFERENCE, *arms)]
        self.started = time.time()
        self.seconds = self.cpu_seconds = 0.0  # wall, and CPU time of this process (other load shows as a gap)
        self.complete = False
        self.interrupted_in: str | None = None
        self.versions = versions(loaded)

    def _prepare(self, arm: Arm, base: Plan) -> ArmRun:
        plan = arm_plan(arm, base, self.context)
        return ArmRun(arm, plan, plan.layout(self.config), [None] * len(self.requests))

    @property
    def reference(self) -> ArmRun:
        return self.runs[0]

    @property
    def arms(self) -> list[ArmRun]:
        return self.runs[1:]

    def run(self) -> "Check":
        """Run the reference, then every arm; on Ctrl-C keep what is done and mark the summary incomplete."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        if self.evidence is not None:
            self.evidence.mkdir(parents=True, exist_ok=True)
            if self.suite_path is not None:
                (self.evidence / "suite.yaml").write_bytes(self.suite_path.read_bytes())
        try:
            for run in self.runs:
                self._run_arm(run)
                self.seconds, self.cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
                self._write_summary()
            self.complete = True
        except KeyboardInterrupt:
            current = next((r for r in self.runs if not r.complete), None)
            self.interrupted_in = current.arm.name if current else None
            if current is not None and any(current.results):
                self._write_arm(current)  # the chats it finished, marked incomplete
        self.seconds = time.perf_counter() - t0
        self.cpu_seconds = time.process_time() - cpu0
        self._write_summary()
        return self

    def _run_arm(self, run: ArmRun) -> None:
        from tfq.engine import Engine

        self.listener.arm_started(run, self.group)
        engine = Engine.from_plan(run.plan, run.layout, self.loaded)
        t0 = time.perf_counter()
        if run.arm.together:
            on_token = lambda i, token, _: self.listener.token(run, i, token)  # noqa: E731
            run.results = list(engine.generate(self.requests, on_token))
        else:
            for i, request in enumerate(self.requests):
                self.listener.chat_started(run, i)
                on_token = lambda _, token, __, i=i: self.listener.token(run, i, token)  # noqa: E731
                run.results[i] = engine.generate([request], on_token)[0]
        run.seconds = time.perf_counter() - t0
        if run is not self.reference:
            run.comparisons = [compare(a, b) for a, b in zip(self.reference.results, run.results)]
            run.verdict, run.note = judge(run.arm, run.comparisons, run.preemptions, reach(self.reference.results),
                                          run.drafted)
        run.complete = True
        self._write_arm(run)
        self.listener.arm_finished(run)

    # -- results --------------------------------------------------------------------------------------
    @property
    def passed(self) -> bool:
        return self.complete and all(r.verdict in (EXACT, RED) for r in self.arms)

    @property
    def exit_code(self) -> int:
        if not self.complete:
            return INTERRUPTED_EXIT
        return 0 if self.passed else 1

    def summary(self) -> dict:
        return {
            "complete": self.complete,
            "interrupted_in": self.interrupted_in,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "seconds": round(self.seconds, 2),
            "cpu_seconds": round(self.cpu_seconds, 2),
            "group": self.group,
            "tokens": self.tokens,
            "suite": _suite_facts(self.suite_path, self.chats),
            "context": dataclasses.asdict(self.context),
            "longest_context": reach([r for r in self.reference.results if r is not None]),
            "versions": self.versions,
            "reference": {"seconds": round(self.reference.seconds, 2), "complete": self.reference.complete},
            "arms": [_arm_summary(r) for r in self.arms],
        }

    def _write_summary(self) -> None:
        if self.evidence is not None:
            _write_json(self.evidence / "summary.json", self.summary())

    def _write_arm(self, run: ArmRun) -> None:
        if self.evidence is None:
            return
        doc = {
            "arm": run.arm.name, "mode": run.arm.mode(self.group), "about": run.arm.about,
            "control": run.arm.control, "complete": run.complete, "verdict": run.verdict or None,
            "note": run.note, "seconds": round(run.seconds, 2), "preemptions": run.preemptions,
            "plan": plan_json(run.plan, self.config, run.layout), "versions": self.versions,
            "chats": [_chat_record(req, res, cmp)
                      for req, res, cmp in zip(self.requests, run.results, run.comparisons or [None] * len(run.results))
                      if res is not None],
        }
        _write_json(self.evidence / f"{run.arm.name}.json", doc)

    def plan_lines(self, run: ArmRun) -> list[str]:
        return plan_lines(run.plan, self.config, run.layout)


def _arm_summary(run: ArmRun) -> dict:
    return {
        "arm": run.arm.name, "control": run.arm.control, "complete": run.complete, "verdict": run.verdict or None,
        "note": run.note, "equal_ids": run.equal_ids, "equal_logits": run.equal_logits,
        "chats": len(run.results), "preemptions": run.preemptions, "seconds": round(run.seconds, 2),
        "partings": [c.where() for c in run.comparisons if not c.equal],
    }


def _chat_record(request: Request, result: Result, comparison: ChatComparison | None) -> dict:
    record = {
        "chat": request.label, "prompt_tokens": len(request.prompt), "max_tokens": request.max_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "seed": request.seed,
        "finish": result.finish, "error": result.error, "preempted": result.preempted, "recomputed": result.recomputed,
        "proposed": result.proposed, "accepted": result.accepted,
        "first_token_s": round(result.first_token_s, 3), "seconds": round(result.total_s, 3),
        "text": result.text, "ids": result.ids, "digests": result.digests,
    }
    if comparison is not None:
        record["compared"] = {k: v for k, v in dataclasses.asdict(comparison).items() if k not in ("chat", "error")}
    return record


def _suite_facts(path: Path | None, chats) -> dict:
    facts: dict[str, Any] = {"chats": [c.name for c in chats]}
    if path is not None:
        facts["path"] = str(path)
        facts["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return facts


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a reader (or a Ctrl-C) never sees half a file


# -------------------------------------------------------------------------------------------- versions

_HASH_LIMIT = 256 << 20  # hash weight files up to this size; the default model is named by its GGUF's sha


def versions(loaded) -> dict:
    import torch

    import tfq

    from tfq.proofs.startup import build_facts

    return {"tfq": tfq.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "threads": torch.get_num_threads(), "argv": sys.argv[1:],
            "kernels": loaded.model.backend.name, "device": loaded.model.backend.where,
            "build": build_facts(), "model": model_identity(Path(loaded.folder))}


def model_identity(folder: Path) -> dict:
    """Where the weights came from and hashes that pin them, when cheap."""
    from tfq.model import default
    from tfq.model.source import converted_dir

    ident: dict[str, Any] = {"folder": str(folder)}
    config = folder / "config.json"
    if config.is_file():
        ident["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    if folder.parent == converted_dir("x").parent:  # converted from a GGUF: the folder is named by its sha256
        sha = folder.name.rsplit("-v", 1)[0]
        ident["gguf_sha256"] = sha
        ident["default_model"] = sha == default.SHA256
        return ident
    weights = sorted(folder.glob("*.safetensors"))
    size = sum(w.stat().st_size for w in weights)
    ident["weights_bytes"] = size
    if size <= _HASH_LIMIT:
        ident["weights_sha256"] = {w.name: hashlib.sha256(w.read_bytes()).hexdigest() for w in weights}
    return ident
