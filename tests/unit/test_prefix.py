"""The prefix cache without a model: a pool's held pages are never evicted, idle ones go least recently used
first; the plan's key and its line. The engine's warm and cold runs are in tests/test_prefix.py."""
from __future__ import annotations

import pytest

from tfq.engine.pages import PagePool
from tfq.engine.prefix import PrefixCache, root_key


def test_held_pages_are_never_evicted_and_idle_ones_go_least_recently_used_first():
    pool = PagePool(0, 128, page_rows=64, pool_pages=4, prefix=PrefixCache(root_key("test")))
    a, b = pool.paged(), pool.paged()
    assert pool.grow(a, 128) and pool.grow(b, 128)
    pool.publish(a, list(range(128)), 128)
    pool.publish(b, list(range(100, 228)), 128)
    pool.release(a)
    pool.release(b)  # a's pages went idle first
    c = pool.paged()
    assert pool.adopt(c, list(range(128)) + [7]) == 128  # a's two pages, mapped again
    assert pool.grow(c, 256)  # two more: b's idle pages are evicted, a's held ones are not
    assert len(set(c.pages)) == 4
    assert not pool.prefix.idle and pool.available == 0
    d = pool.paged()
    assert pool.adopt(d, list(range(100, 228)) + [1]) == 0  # b's rows are gone
    assert not pool.grow(d, 64)  # nothing left: every page is held
    pool.release(c)
    assert sum(pool.refs) == 0 and pool.unheld == 4


def test_the_plan_key():
    from tfq.errors import TfqError
    from tfq.plan import load_plan, parse_plan_text

    assert parse_plan_text("kv:\n  prefix_cache: on\n", "p.yaml").kv.prefix_cache == "on"  # YAML's boolean on
    assert load_plan(None, {"TFQ_KV_PREFIX_CACHE": "1"}, []).kv.prefix_cache == "on"
    assert load_plan(None, {}, []).kv.prefix_cache == "off"
    with pytest.raises(TfqError, match="kv.prefix_cache must be on or off"):
        load_plan(None, {}, ["kv.prefix_cache=maybe"])


@pytest.mark.parametrize("sets, words", [
    (["kv.pages=256", "kv.prefix_cache=on"], "may keep all"),
    (["kv.prefix_cache=on"], "nothing is reused"),
    (["kv.pages=256", "kv.prefix_cache=off"], "every stream computes its whole prompt"),
])
def test_the_plan_line(sets, words):
    from tfq.model.config import ModelConfig
    from tfq.plan import load_plan, plan_lines

    plan = load_plan(None, {}, sets + ["budget=4GiB"])
    config = ModelConfig.from_dict({
        "model_type": "qwen2", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "max_position_embeddings": 32768, "torch_dtype": "float32", "tie_word_embeddings": True})
    line = next(ln for ln in plan_lines(plan, config, plan.layout(config)) if ln.startswith("prefix cache:"))
    assert words in line
