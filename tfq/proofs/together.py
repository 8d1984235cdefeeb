"""The exactness check behind `tfq together`: a suite run alone and together under every arm, chat by chat.

The reference is every chat alone on a whole (unpaged) plan with `rows` attention, run once. Each arm is the
same suite under other settings (K together, pages, chunked prefill, preemption), derived from the user's plan
by changing a few keys, and must equal the reference in token ids and in the bits of every step's logits. Two
controls change the arithmetic on purpose (`partial`, and the field report's paged/partial split); they must
come out RED, or the check could not have seen a fault. Evidence (one JSON per arm, summary.json) is written
as arms finish, so an interrupted run leaves what it has. An arm whose plan cannot be made is refused, naming
it; one on other page rows than the plan's is left out instead, with a line saying why, unless it was named.

The arms and their verdicts are tfq/proofs/together_arms.py; the evidence's records together_evidence.py.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tfq.engine.stream import Request, Result
from tfq.errors import TfqError
from tfq.plan import Layout, Plan, plan_json, plan_lines
from tfq.proofs.together_arms import (
    ARMS,
    EXACT,
    FAIL,
    RED,
    REFERENCE,
    Arm,
    ChatComparison,
    Context,
    arm_names,
    arm_plan,
    arms_for,
    check_options,
    compare,
    context_for,
    judge,
    reach,
    scored_chats,
    scores_tally,
    select_arms,
)
from tfq.proofs.together_evidence import chat_record, suite_facts, versions, write_json

INTERRUPTED_EXIT = 130

# What the command and the tests import from here; the arms themselves live in together_arms.
__all__ = [
    "ARMS", "EXACT", "FAIL", "INTERRUPTED_EXIT", "RED", "Arm", "ArmRun", "ChatComparison", "Check", "CheckSuite",
    "Context", "Listener", "arm_names", "arms_for", "check_options", "select_arms",
]


@dataclass(frozen=True)
class CheckSuite:
    """The suite a check runs: its chats as parsed, their requests (each reply capped at `tokens`), and the file
    they came from (copied into the evidence)."""

    chats: Sequence
    requests: Sequence[Request]
    path: Path | None = None
    tokens: int | None = None


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

    cold: dict[int, Result] = field(default_factory=dict)  # a warm arm's first pass, by chat index
    cold_comparisons: list[ChatComparison] = field(default_factory=list)  # the first pass's, in cold's order

    @property
    def preemptions(self) -> int:
        return sum(r.preempted for r in self.results if r is not None)

    @property
    def reused(self) -> int:
        """Rows streams took from the prefix cache, both passes."""
        return sum(r.reused for r in [*self.results, *self.cold.values()] if r is not None)

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

    @property
    def scores(self) -> tuple[int, int]:
        """(prompt scores equal, compared), both passes."""
        return scores_tally([*self.comparisons, *self.cold_comparisons])

    @property
    def partings(self) -> list[str]:
        cold = [f"cold: {c.where()}" for c in self.cold_comparisons if not c.equal]
        return [c.where() for c in self.comparisons if not c.equal] + cold


class Listener:
    """Progress hooks; the command shows them with rich, tests leave them silent."""

    def arm_started(self, run: ArmRun, group: int) -> None: ...
    def chat_started(self, run: ArmRun, index: int) -> None: ...  # alone arms only
    def pass_started(self, run: ArmRun, name: str) -> None: ...  # warm arms: "cold", then "warm"
    def token(self, run: ArmRun, index: int, token_id: int) -> None: ...
    def arm_finished(self, run: ArmRun) -> None: ...


class Check:
    """The reference plus the chosen arms, over one loaded model, writing evidence into `evidence`."""

    def __init__(self, base: Plan, config, loaded, suite: CheckSuite, arms: Sequence[Arm], group: int,
                 evidence: Path | None, listener: Listener | None = None, named: bool = False):
        """`named`: the user chose the arms (--arms), so one whose plan cannot be made is refused, not left out."""
        self.config, self.loaded, self.chats = config, loaded, list(suite.chats)
        self.requests = list(suite.requests)
        self.group = group
        self.evidence = evidence
        self.listener = listener or Listener()
        self.suite_path, self.tokens = suite.path, suite.tokens
        for r in self.requests:
            r.validate()
            if len(r.prompt) >= base.window:
                raise TfqError(f"chat {r.label}: its prompt of {len(r.prompt)} tokens does not fit the plan's window "
                               f"of {base.window} rows; raise window (--set window=...) or shorten the chat")
        self.context = context_for(base, self.requests, group)
        arms = [a for a in arms if a.applies(config, base.tp)]  # each model kind its own controls
        # Every arm's plan and layout first: a plan that does not fit fails before anything runs.
        self.left_out: list[str] = []  # a line for each arm left out, saying why
        prepared = [self._prepare(arm, base, named) for arm in (REFERENCE, *arms)]
        self.runs = [run for run in prepared if run is not None]
        self.scored = scored_chats(self.requests) if any(r.arm.scores for r in self.arms) else frozenset()
        self.started = time.time()
        self.seconds = self.cpu_seconds = 0.0  # wall, and CPU time of this process (other load shows as a gap)
        self.complete = False
        self.interrupted_in: str | None = None
        self.versions = versions(loaded)
        self.split: dict[tuple[int, bool], object] = {}  # (tp, all-reduce) -> the model split over its ranks

    def _loaded(self, run: ArmRun):
        """The reference's model (one process), or the arm's split over its plan's ranks, loaded once."""
        if run.plan.tp == 1:
            return self.loaded
        from tfq.model.load import load_model

        key = (run.plan.tp, run.arm.reduce)
        if key not in self.split:
            self.split[key] = load_model(run.plan.model, progress=False, device=run.layout.device,
                                         weights=self.loaded.weights, tp=run.plan.tp, reduce=run.arm.reduce)
        return self.split[key]

    def _prepare(self, arm: Arm, base: Plan, named: bool) -> ArmRun | None:
        """The arm's run, or None when it is left out (its own page rows, not the plan's, cannot be planned)."""
        plan = arm_plan(arm, base, self.context)
        try:
            return ArmRun(arm, plan, plan.layout(self.config), [None] * len(self.requests))
        except TfqError as e:
            if arm is REFERENCE:
                raise TfqError(f"the reference (each chat alone, no pages): {e}") from None
            if named or plan.kv.pages == base.kv.pages:
                raise TfqError(f"arm {arm.name}: {e}; or leave arm {arm.name} out of --arms") from None
            self.left_out.append(f"arm {arm.name} left out: {e}")
            return None

    def _requests(self, run: ArmRun) -> list[Request]:
        """The suite as this run asks it: the reference and the warm arms score the prompts of the scored chats."""
        if run is not self.reference and not run.arm.scores:
            return self.requests
        return [dataclasses.replace(r, prompt_logprobs=0) if i in self.scored and r.prompt_logprobs is None else r
                for i, r in enumerate(self.requests)]

    def _compare(self, run: ArmRun, i: int, result: Result) -> ChatComparison:
        return compare(self.reference.results[i], result, scores=run.arm.scores and i in self.scored)

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
        from tfq.engine.core import Controls, Engine

        self.listener.arm_started(run, self.group)
        policy = run.arm.arithmetic(run.plan.attention == "partial") if run.arm.arithmetic else None
        engine = Engine.from_plan(run.plan, run.layout, self._loaded(run), controls=Controls(
            arithmetic=policy, snapshot_offset=run.arm.snapshot_offset))
        t0 = time.perf_counter()
        requests = self._requests(run)
        order = list(self.context.longest_first) if run.arm.longest_first else list(range(len(requests)))
        if run.arm.warm:
            order = self._warm_up(run, engine, policy, requests)
        if run.arm.together:
            on_token = lambda k, token, _: self.listener.token(run, order[k], token)  # noqa: E731
            results = engine.generate([requests[i] for i in order], on_token)
            for i, result in zip(order, results):
                run.results[i] = result
        else:
            for i, request in enumerate(requests):
                self.listener.chat_started(run, i)
                on_token = lambda _, token, __, i=i: self.listener.token(run, i, token)  # noqa: E731
                run.results[i] = engine.generate([request], on_token)[0]
        run.seconds = time.perf_counter() - t0
        if run is not self.reference:
            run.comparisons = [self._compare(run, i, r) for i, r in enumerate(run.results)]
            run.cold_comparisons = [self._compare(run, i, r) for i, r in run.cold.items()]
            run.verdict, run.note = judge(run.arm, run.comparisons, run.preemptions, reach(self.reference.results),
                                          run.drafted, run.cold_comparisons, run.reused)
        run.complete = True
        self._write_arm(run)
        self.listener.arm_finished(run)

    def _warm_up(self, run: ArmRun, engine, policy, requests: list[Request]) -> list[int]:
        """A warm arm's first pass: the longest half of the suite, cold, longest last (so its pages are the last
        to be evicted). Returns the second pass's order: that half warm, longest first, each followed by a chat
        of the other half, so warm and cold streams share forwards."""
        by_length = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt))
        first = by_length[len(requests) // 2:]
        self.listener.pass_started(run, "cold")
        on_token = lambda k, token, _: self.listener.token(run, first[k], token)  # noqa: E731
        run.cold = dict(zip(first, engine.generate([requests[i] for i in first], on_token)))
        if hasattr(policy, "warm"):
            policy.warm()
        self.listener.pass_started(run, "warm")
        warm, others = first[::-1], [i for i in range(len(requests)) if i not in run.cold]
        return [i for pair in zip(warm, others + [None] * len(warm)) for i in pair if i is not None]

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
            "suite": suite_facts(self.suite_path, self.chats),
            "context": dataclasses.asdict(self.context),
            "longest_context": reach([r for r in self.reference.results if r is not None]),
            "versions": self.versions,
            "reference": {"seconds": round(self.reference.seconds, 2), "complete": self.reference.complete},
            "scored_chats": [self.requests[i].label for i in sorted(self.scored)],
            "left_out": self.left_out,
            "arms": [_arm_summary(r) for r in self.arms],
        }

    def _write_summary(self) -> None:
        if self.evidence is not None:
            write_json(self.evidence / "summary.json", self.summary())

    def _write_arm(self, run: ArmRun) -> None:
        if self.evidence is None:
            return
        requests = self._requests(run)
        doc = {
            "arm": run.arm.name, "mode": run.arm.mode(self.group), "about": run.arm.about,
            "control": run.arm.control, "complete": run.complete, "verdict": run.verdict or None,
            "note": run.note, "seconds": round(run.seconds, 2), "preemptions": run.preemptions,
            "reused_rows": run.reused,
            "plan": plan_json(run.plan, self.config, run.layout), "versions": self.versions,
            "chats": [chat_record(req, res, cmp)
                      for req, res, cmp in zip(requests, run.results, run.comparisons or [None] * len(run.results))
                      if res is not None],
        }
        if run.cold:  # a warm arm's first pass
            cold = dict(zip(run.cold, run.cold_comparisons or [None] * len(run.cold)))
            doc["cold"] = [chat_record(requests[i], res, cold[i]) for i, res in run.cold.items()]
        write_json(self.evidence / f"{run.arm.name}.json", doc)

    def plan_lines(self, run: ArmRun) -> list[str]:
        return plan_lines(run.plan, self.config, run.layout)


def _arm_summary(run: ArmRun) -> dict:
    return {
        "arm": run.arm.name, "control": run.arm.control, "complete": run.complete, "verdict": run.verdict or None,
        "note": run.note, "equal_ids": run.equal_ids, "equal_logits": run.equal_logits,
        "prompt_scores_equal": run.scores[0], "prompt_scores_compared": run.scores[1],
        "chats": len(run.results), "preemptions": run.preemptions, "reused_rows": run.reused,
        "seconds": round(run.seconds, 2),
        "partings": run.partings,
    }
