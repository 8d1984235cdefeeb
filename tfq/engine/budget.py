"""One forward's budget: how many rows of its own tokens each stream may feed it. The scheduler asks, oldest
stream first, `take(stream, rows)`, and the budget grants at most that many within what is left of three bounds:

- rows: while some stream decodes, `step_tokens` rows a forward, the decodes (and their guesses) counted first;
  prompt chunks share the rest. Until the cost of steps is learned it holds whether a stream decodes or not: the
  first steps teach the cost, and none of them may run long on a machine whose speed is not known yet.
- time: instead, with `step_steps` and the cost learned (tfq/engine/step_cost.py), the prompt rows that keep the
  step within that many decode steps of the running streams (a prompt's: one row where it stands).
- logits: a stream scoring its prompt (every row a logits row) takes only what the forward's `logits_rows`
  leave once every other stream's drawing rows are counted (the plan keeps logits_rows at least lanes x
  drawing rows, so the oldest always gets a row).

A decode (the last token and its guesses) is never cut by the rows or the time. None of this touches a bit: it
only decides how many prompt rows share a forward, and chunking is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

from tfq.engine.step_cost import StepCost, Work, chunk_work
from tfq.engine.stream import Stream


@dataclass
class Budget:
    rows: int | None = None  # prompt rows the forward may still take; None: no bound
    logits: int | None = None  # logits rows left to streams scoring their prompt; None: no bound
    cost: StepCost | None = None  # with `seconds`, the time bound; None: no such bound
    seconds: float = 0.0  # what the forward may cost
    work: Work = Work()  # what it holds so far, in the cost's terms

    @classmethod
    def of(cls, running: list[Stream], cost: StepCost, step_tokens: int = 0, step_steps: int = 0,
           logits_rows: int = 0) -> "Budget":
        """The budget of a forward of the `running` streams (their guesses set); 0: no such bound."""
        decoding = [st for st in running if st.pending == 1]
        timed = bool(step_steps and decoding and cost.ready)
        budget = cls()
        if step_tokens and (decoding or not cost.ready) and not timed:
            budget.rows = step_tokens - sum(1 + len(st.guesses) for st in decoding)
        if timed:
            budget.work = Work.total(chunk_work(st.cached, 1 + len(st.guesses)) for st in decoding)
            prompts = Work.total(chunk_work(st.cached, 1) for st in running if st.pending > 1)
            budget.cost, budget.seconds = cost, step_steps * cost.seconds(budget.work + prompts)
        if logits_rows:
            budget.logits = logits_rows - sum(1 + len(st.guesses) for st in running if not st.scoring)
        return budget

    def take(self, st: Stream, rows: int) -> int:
        """Rows of its own tokens `st` feeds this forward, at most `rows` (0: it sits the forward out); what it
        takes is no longer left for the streams after it."""
        prompt = st.pending > 1
        if prompt and self.rows is not None:
            rows = min(rows, self.rows)
        if prompt and self.cost is not None:
            rows = self._rows_in_time(st, rows)
            self.work += chunk_work(st.cached, rows)  # as timed: before the logits bound may cut it
        if st.scoring and self.logits is not None:
            rows = min(rows, self.logits - len(st.guesses))
        rows = max(0, rows)
        if prompt and self.rows is not None:
            self.rows -= rows
        if st.scoring and self.logits is not None:
            self.logits -= rows
        return rows

    def _rows_in_time(self, st: Stream, most: int) -> int:
        """The most prompt rows of `st` (at most `most`) that the forward, holding `work` already, takes within
        `seconds`. The oldest prompt always gets a row: the bound is at least the decodes and a row of each
        prompt where it stands, and the cost (a + b * rows + c * keys) has no term below 0."""
        lo, hi = 0, most  # the step's cost grows with every row: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.seconds(self.work + chunk_work(st.cached, mid)) <= self.seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo
