"""tfq's logs: a logger per layer (tfq.engine.scheduler, tfq.engine.core, tfq.serve.*), one line per event
(admit, preempt,
finish, abort, refusal, fault), quiet unless asked, and never a prompt's text unless the operator asks."""
from __future__ import annotations

import json
import logging

import pytest

from engines import engine as make_engine
from served import NAME, raw, server, tiny_served
from tfq.engine.stream import Request
from tfq.serve.background import serving

CANARY = "zebra canary 41"


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_models):
    return tiny_served(tiny_dirs, tiny_models)


def test_the_engine_logs_admissions_preemptions_finishes_and_aborts(tiny_models, caplog):
    model = tiny_models["qwen2"].model
    engine = make_engine(model, lanes=3, page_rows=64, paged_all=True, pool_pages=4)
    caplog.set_level(logging.DEBUG, logger="tfq")
    ids = [engine.add(Request(tuple(range(3, 3 + n)), max_tokens=12)) for n in (150, 150, 40)]
    engine.step()
    engine.abort(ids[2])
    while engine.has_work():
        engine.step()
    lines = [r.getMessage() for r in caplog.records if r.name in ("tfq.engine.scheduler", "tfq.engine.core")]
    assert any(" admitted to lane " in ln for ln in lines)
    assert any("preempted for lack of pages" in ln for ln in lines)
    assert sum("finished (length)" in ln for ln in lines) == 2 and sum("finished (abort)" in ln for ln in lines) == 1
    assert all("\n" not in ln for ln in lines)


@pytest.mark.parametrize("log_prompts", [False, True])
def test_the_server_never_logs_a_prompt_unless_asked(tiny, caplog, log_prompts):
    caplog.set_level(logging.DEBUG, logger="tfq")
    with serving(server(tiny, served={"log_prompts": log_prompts})) as base:
        status, _, _ = raw(base, "POST", "/v1/completions",
                           json.dumps({"model": NAME, "prompt": CANARY, "max_tokens": 3}).encode())
        assert status == 200
        status, _, _ = raw(base, "POST", "/v1/completions", json.dumps({"model": NAME, "prompt": CANARY,
                                                                        "max_tokens": 0}).encode())
        assert status == 400
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("tfq")]
    assert any(ln.startswith("refused 400") for ln in lines)
    assert any(CANARY in ln for ln in lines) is log_prompts
