"""Lanes sized to the streams a command knows (tfq/plan/streams.py): N prompts take min(N, the plan's lanes) lanes
unless the plan file, TFQ_LANES or --set named lanes; the plan line says which. The checks compare whole layouts
and lines; each rule's control is a case where the same check must give the plan's 8 lanes."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tfq.cli.chat import chat_streams
from tfq.model.config import ModelConfig
from tfq.plan import DEFAULT_LANES, Plan, Streams, load_plan, plan_lines, size_lanes
from tfq.plan.resolve import resolve_plan
from unit.test_plan import PLANS, TINY, TINY_ROW

SIZED_ONE = "lanes: 1 stream in one forward at most (sized to 1 prompt; --set lanes=N to change)"


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_dict(TINY)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


@pytest.fixture(autouse=True)
def no_tfq_variables(monkeypatch):
    """resolve_plan reads the environment: a TFQ_LANES set outside would name lanes."""
    from tfq.plan import ENV_FLAGS, ENV_VALUES

    for var in list(ENV_VALUES) + list(ENV_FLAGS):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("count,lanes", [(1, 1), (2, 2), (7, 7), (8, 8), (20, 8)])
def test_n_prompts_take_n_lanes_capped_at_the_plans(count, lanes):
    plan = size_lanes(load_plan(None, env={}), Streams.of(count, "prompt"))
    assert plan.lanes == lanes
    sized = plan.source("lanes")  # the plan's own 8 lanes (8 prompts or more) are no sizing, and say nothing
    assert sized == (f"sized to {count} prompt{'s' * (count > 1)}; --set lanes=N to change" if lanes < 8 else None)


def test_unknown_streams_keep_the_plans_lanes():
    """The server's case (and tfq together's, bench's): no streams given, the plan's lanes stay."""
    plan = load_plan(None, env={})
    assert size_lanes(plan, None) == plan and size_lanes(plan, None).lanes == DEFAULT_LANES


@pytest.mark.parametrize("how", ["--set", "TFQ_LANES", "plan file", "the shipped default file"])
def test_a_named_lanes_wins(how, tmp_path):
    path, env, sets = None, {}, []
    if how == "--set":
        sets = ["lanes=3"]
    elif how == "TFQ_LANES":
        env = {"TFQ_LANES": "3"}
    elif how == "plan file":
        path = tmp_path / "plan.yaml"
        path.write_text("lanes: 3\nwindow: 2048\n")
    else:
        path = PLANS / "default.yaml"  # it writes lanes: 8, so a user who passes it keeps 8
    plan = load_plan(path, env=env, sets=sets)
    assert size_lanes(plan, Streams.of(1, "prompt")) == plan


@pytest.mark.parametrize("text", ["window: 2048\n", "lanes:\nwindow: 2048\n"])
def test_a_plan_file_without_lanes_is_sized(text, tmp_path):
    """The control of the plan-file case: the same rule sizes a file that does not write lanes (an empty `lanes:`
    keeps the default, so it names nothing)."""
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    plan = load_plan(path, env={})
    assert plan.lanes == DEFAULT_LANES and size_lanes(plan, Streams.of(1, "prompt")).lanes == 1


def test_sized_layout_holds_one_lane(tiny):
    """What the engine allocates follows: one lane's cache rows and one lane's prompt chunk of activations."""
    base = load_plan(None, env={}).set("budget", "1GiB")
    one, eight = (plan.layout(tiny) for plan in (size_lanes(base, Streams.of(1, "prompt")), base))
    assert (one.lanes, one.rows_total, one.cache_bytes) == (1, 4096, 4096 * TINY_ROW)
    assert one.forward_rows == 512 and one.activation_bytes * 8 == eight.activation_bytes
    assert (eight.lanes, eight.cache_bytes) == (8, 8 * 4096 * TINY_ROW)  # the control: the plan unsized
    assert one.window == eight.window == 4096  # the window stays the plan's


def test_plan_lines_say_the_lanes_were_sized(tiny):
    plan = size_lanes(load_plan(None, env={}, sets=["kv.pages=256", "budget=1GiB"]), Streams.of(1, "prompt"))
    lines = plan_lines(plan, tiny, plan.layout(tiny))
    assert SIZED_ONE in lines
    assert "0 more taking pages: lanes is 1 (sized to 1 prompt; --set lanes=N to change), so stream 0 runs alone" \
        in lines
    assert any(ln.startswith("activations:") and "(1 lane x a 512-row prompt chunk)" in ln for ln in lines)
    two = size_lanes(Plan(budget="1GiB"), Streams.of(2, "prompt"))
    assert "lanes: 2 streams in one forward at most (sized to 2 prompts; --set lanes=N to change)" in \
        plan_lines(two, tiny, two.layout(tiny))
    unsized = Plan(budget="1GiB")  # the control: no sizing, no words
    assert "lanes: 8 streams in one forward at most" in plan_lines(unsized, tiny, unsized.layout(tiny))


def _resolved(tiny_dir: Path, sets: list[str], streams: Streams | None) -> tuple[int, list[str]]:
    out = io.StringIO()
    plan, _, layout = resolve_plan(None, str(tiny_dir), [*sets, "budget=1GiB"], False,
                                   Console(file=out, width=400), streams)
    assert layout.lanes == plan.lanes
    return layout.lanes, out.getvalue().splitlines()


@pytest.mark.parametrize("prompts,lanes,words", [
    (1, 1, "(sized to 1 prompt; --set lanes=N to change)"),
    (2, 2, "(sized to 2 prompts; --set lanes=N to change)"),
    (0, 1, "(sized to an interactive chat, one reply at a time; --set lanes=N to change)"),
    (9, 8, ""),
])
def test_tfq_chat_resolves_its_plan_to_its_prompts(prompts, lanes, words, tiny_dir):
    """tfq chat's streams (chat_streams) through the plan every command resolves: the lanes and the line it prints."""
    got, lines = _resolved(tiny_dir, [], chat_streams(prompts))
    assert got == lanes
    assert f"lanes: {lanes} stream{'s' * (lanes > 1)} in one forward at most{' ' * bool(words)}{words}" in lines


def test_set_lanes_wins_over_a_chats_prompts(tiny_dir):
    got, lines = _resolved(tiny_dir, ["lanes=4"], chat_streams(1))
    assert got == 4 and "lanes: 4 streams in one forward at most (set by --set)" in lines
    got, lines = _resolved(tiny_dir, [], None)  # the server's resolve: no streams
    assert got == 8 and "lanes: 8 streams in one forward at most" in lines
