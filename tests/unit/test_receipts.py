"""Receipts as data (tfq/receipts): the chain, the signature, reading files, a request made again from its
receipt, and how a replay's verdict names the first step that parts. No model here (tests/test_receipts.py
replays real ones)."""
from __future__ import annotations

import json

import pytest

from tfq.decode.grammar import Constraint
from tfq.decode.penalties import Penalties
from tfq.engine.stream import Finish, Request, Result
from tfq.errors import TfqError
from tfq.kernels.contract import RECIPE
from tfq.receipts.receipt import (
    Issuer,
    arithmetic,
    chain,
    read_key,
    read_receipts,
    request_of,
    sampling,
    sign,
    signed_by,
)
from tfq.receipts.replay import Group, compare, groups, refusal

KEY = b"k" * 32
REQUEST = Request((1, 2, 3), max_tokens=9, temperature=0.7, top_p=0.9, seed=2 ** 63 + 5, stop=("\n\n",),
                  penalties=Penalties(0.5, -0.25, 1.2, ((7, 3.5), (11, -100.0))),
                  constraint=Constraint("regex", "[a-z]+"))


def issued(key: bytes | None = KEY, ids=(5, 6, 7), digests=("a1", "b2", "c3"), finish=Finish.EOS) -> dict:
    issuer = Issuer("default", arithmetic("gguf-q8", "fp32", "rows", "cpu"), key)
    issuer.__dict__["model"] = {"name": "default", "sha256": "0" * 64}  # no model files here
    return issuer.receipt(REQUEST, Result("", list(ids), "", list(digests), finish))


def test_the_chain_changes_with_any_step_and_its_order():
    base = chain(["a", "b", "c"])
    assert chain(["a", "b", "c"]) == base
    for other in (["a", "b", "d"], ["b", "a", "c"], ["a", "b"], ["a", "b", "c", "d"]):
        assert chain(other) != base


def test_a_signature_holds_through_json_and_breaks_with_any_change_or_another_key():
    doc = issued()
    assert doc["signature"].startswith("hmac-sha256:")
    again = json.loads(json.dumps(doc))  # floats, a seed past 2^63, the grammar's text: the same bytes signed
    assert signed_by(again, KEY)
    assert not signed_by(again, b"x" * 32)  # control: another key
    for change in (lambda d: d["reply"].__setitem__(1, 99), lambda d: d["sampling"].__setitem__("temperature", 0.70001),
                   lambda d: d.__setitem__("chain", "0" * 64), lambda d: d.pop("signature")):
        altered = json.loads(json.dumps(doc))
        change(altered)
        assert not signed_by(altered, KEY)
    assert "signature" not in issued(key=None)
    assert signed_by(sign(issued(key=None), KEY), KEY)


def test_a_receipt_gives_back_the_request_that_made_it():
    doc = json.loads(json.dumps(issued()))
    again = request_of(doc)
    assert sampling(again) == {**doc["sampling"], "max_tokens": 3}
    assert (again.prompt, again.seed, again.penalties, again.constraint) == \
        (REQUEST.prompt, REQUEST.seed, REQUEST.penalties, REQUEST.constraint)
    assert again.max_tokens == 3  # the reply's length: a replay never runs past what the receipt holds


def verdict(doc: dict, ids, digests, finish="eos"):
    return compare("r", doc, list(ids), list(digests), finish)


def test_the_verdict_names_the_first_step_that_parts_with_both_values():
    doc = issued()
    assert verdict(doc, [5, 6, 7], ["a1", "b2", "c3"]).equal
    v = verdict(doc, [5, 8, 7], ["a1", "b2", "c3"])
    assert (v.equal, v.step) == (False, 1) and "token 6 in the receipt, 8 replayed" in v.what
    v = verdict(doc, [5, 6, 7], ["a1", "b2", "cX"])
    assert (v.equal, v.step) == (False, 2) and "logits digest c3 in the receipt, cX replayed" in v.what
    v = verdict(doc, [5], ["a1"], "stop")
    assert (v.equal, v.step) == (False, 1) and "the replay ended (stop)" in v.what
    v = verdict(doc, [5, 6, 7], ["a1", "b2", "c3"], "length")  # the receipt says EOS: an equal replay ends there too
    assert not v.equal and "ended by eos in the receipt, by length replayed" in v.what
    cut = issued(finish=Finish.LENGTH)
    assert verdict(cut, [5, 6, 7], ["a1", "b2", "c3"], "length").equal
    altered = {**doc, "chain": chain(["a1", "b2"])}
    v = verdict(altered, [5, 6, 7], ["a1", "b2", "c3"])
    assert not v.equal and "altered" in v.what


def test_receipts_are_read_as_one_object_a_list_or_lines(tmp_path):
    doc = issued()
    one, many, lines = tmp_path / "one.json", tmp_path / "many.json", tmp_path / "lines.jsonl"
    one.write_text(json.dumps(doc))
    many.write_text(json.dumps([doc, doc]))
    lines.write_text(json.dumps(doc) + "\n" + json.dumps(doc) + "\n\n")
    assert [len(read_receipts(p)) for p in (one, many, lines)] == [1, 2, 2]


@pytest.mark.parametrize("content, words", [
    ("{not json", "not JSON"), ("[]", "holds no receipt"), ('{"format": "tfq-receipt/9"}', "is not 'tfq-receipt/2'"),
    ('{"format": "tfq-receipt/1"}', "holds sha256 digests"),
    (json.dumps({**issued(), "digests": ["a1"]}), "3 reply tokens but 1 digests"),
    (json.dumps({k: v for k, v in issued().items() if k != "prompt"}), "field 'prompt' is missing"),
    (json.dumps({**issued(), "arithmetic": {"weights": "gguf"}}), "arithmetic lacks 'kv_dtype'"),
    (json.dumps({**issued(), "prompt": [1, "two"]}), "prompt and reply are token ids"),
    (json.dumps({**issued(), "sampling": {**issued()["sampling"], "temperature": -1}}), "not a request's"),
    (json.dumps({**issued(), "sampling": {**issued()["sampling"], "max_tokens": None}}), "not a request's"),
])
def test_a_file_that_is_not_receipts_is_one_line(tmp_path, content, words):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(TfqError) as e:
        read_receipts(bad)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_short_or_missing_key_is_refused(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(TfqError, match="the key is 3 bytes"):
        read_key(str(short), "--key")
    with pytest.raises(TfqError, match="cannot read it"):
        read_key(str(tmp_path / "none"), "--key")


def test_receipts_group_by_model_and_arithmetic_and_refuse_another_recipe_or_weights():
    a, b = issued(), issued()
    b["arithmetic"] = {**b["arithmetic"], "weights": "gguf"}
    found = groups([("a", a), ("b", b), ("c", a)], None)
    assert [[i for i, _, _ in g.items] for g in found] == [[0, 2], [1]]
    group = found[0]
    assert refusal(group, lambda _: "0" * 64) is None
    assert "the weights differ" in refusal(group, lambda _: "1" * 64)
    old = Group(group.name, group.sha256, tuple({**group.settings, "recipe": RECIPE - 1}.items()), group.items)
    assert f"recipe {RECIPE - 1}" in refusal(old, lambda _: "0" * 64)
