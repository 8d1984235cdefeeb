"""`tfq serve` on the real default model under load: 32 calls with the `openai` client, on pages with a pool
small enough to preempt, each compared with its run alone on a fresh server; and the control, RED."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from serve_load import calls, differences, fire, tally
from served import replies_alone
from tfq.engine.core import Controls
from tfq.engine.runner import paged_partial
from tfq.plan.resolve import resolve_plan
from tfq.serve.background import build_served, serving

PAGED_PLAN = str(Path(__file__).parent.parent / "plans" / "paged.yaml")
SETS = ["window=768", "kv.pages=64", "kv.pool=12"]  # 12 pages of 64 rows for 7 paged lanes: preemption


@pytest.mark.slow
def test_default_model_under_load_equals_alone_and_the_control_is_red(default_model, tmp_path):
    plan, _, layout = resolve_plan(PAGED_PLAN, None, SETS, True, None)
    load = calls(seed=1, long_chars=1400)

    def fresh(**kw):
        return build_served(plan, layout, default_model, "default", **kw)

    rows = []
    t0 = time.perf_counter()
    alone = replies_alone(fresh, "default", load)
    rows.append(("each call alone, a fresh server each", tally(alone, alone), 0, time.perf_counter() - t0))
    for name, kw in (("32 calls together (rows)", {}),
                     ("control: paged streams partial", {"controls": Controls(arithmetic=paged_partial)})):
        t0 = time.perf_counter()
        served = fresh(**kw)
        with serving(served) as base:
            under = asyncio.run(fire(base, "default", load))
        rows.append((name, tally(under, alone), served.loop.engine.scheduler.preemptions, time.perf_counter() - t0))
        if kw:
            assert differences(under, alone, load) != [], "the control came out green"
        else:
            assert differences(under, alone, load) == []
            assert served.loop.engine.scheduler.preemptions > 0
            assert len(served.loop.engine.pages.free) == layout.pool_pages
    table = Table(title="tfq serve, default model: 32 calls (openai client) vs each alone")
    for col in ("run", "choices", "equal ids", "equal logprobs", "equal digests", "tokens", "preemptions", "s"):
        table.add_column(col)
    for name, t, pre, s in rows:
        table.add_row(name, str(t["choices"]), str(t["ids"]), str(t["logprobs"]), str(t["digests"]), str(t["tokens"]),
                      str(pre), f"{s:.0f}")
    Console(width=140).print(table)
